"""LoRA sync through one shared-memory file (jaxflow_bridge/contract/lora_shm.py): the trainer's flat bf16 export, the
engine's slot plan against vLLM-Omni's fused layers, and the worker's in-place write into a stand-in of vLLM-Omni
0.20's LoRA manager (its slots and its CPU copy), with refusal of non-finite values and the fallbacks."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch

from jaxflow_bridge.contract import lora_shm
from jaxflow_bridge.contract.lora import lora_pairs, to_vllm_omni
from jaxflow_bridge.sync import vllm_omni_slots as vol
from jaxflow_bridge.sync.binding import slot_plan
from tests.helpers import RANK, random_peft, run, tiny_config
from tests.helpers_vllm_omni import FakeFusedTransformer, FakeManager


class NoFile:
    """A SharedLoRA stand-in that writes nothing (its manifest: {})."""

    def __init__(self, spec, dtype):
        pass

    def write(self, lora):
        return {}

BF16 = np.dtype(ml_dtypes.bfloat16)
SCALE = 2.0


def shared_file(tensors: dict, tmp_path) -> tuple[lora_shm.SharedAdapterFile, dict]:
    """`tensors` (PEFT keys) in a shared file, lora_A first, as `jaxflow.sync.lora_sync.SharedLoRA` lays it out
    (`SharedAdapterFile.write_arrays`: the engine's own writer for arrays sent through Ray)."""
    f = lora_shm.SharedAdapterFile("bfloat16", root=tmp_path)
    manifest = f.write_arrays(tensors)
    kinds = ["lora_B" in k for k, _ in manifest["entries"]]
    assert kinds == sorted(kinds)  # every lora_A before every lora_B
    return f, manifest


def test_round_trip_token_and_size(tmp_path):
    tensors = random_peft()
    f, manifest = shared_file(tensors, tmp_path)
    back = lora_shm.read_arrays(manifest)
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        np.testing.assert_array_equal(back[k], v.astype(BF16))
    stale = {**manifest, "token": "00" * lora_shm.TOKEN_BYTES}
    with pytest.raises(FileNotFoundError, match="another adapter"):
        lora_shm.open_payload(stale)
    with pytest.raises(ValueError, match="bytes"):
        lora_shm.open_payload({**manifest, "entries": manifest["entries"][1:]})
    f.close()
    with pytest.raises(FileNotFoundError, match="not on this host"):
        lora_shm.open_payload(manifest)


def setup(tmp_path, tensors):
    table = vol.lora_module_table(FakeFusedTransformer())
    pairs = lora_pairs(to_vllm_omni(tensors))
    f, manifest = shared_file(tensors, tmp_path)
    plan, first_b = slot_plan(manifest, RANK, table)
    return FakeManager(table, pairs, RANK), pairs, manifest, plan, first_b


def test_in_place_write_fills_every_slot_and_the_cpu_copy(tmp_path):
    tensors = random_peft()
    manager, pairs, manifest, plan, first_b = setup(tmp_path, tensors)
    assert len(plan) == len(pairs) == 12 * 3  # every module of the default targets, 3 blocks
    payload = vol.MappedPayload().to(manifest, "cpu")
    assert vol.write_lora_slots(manager, payload, plan, first_b, SCALE, 7, "transformer") == {"written": len(plan)}
    layers = manager._lora_modules
    fused_slot = {"to_q": ("to_qkv", 0), "to_k": ("to_qkv", 1), "to_v": ("to_qkv", 2),
                  "add_q_proj": ("add_kv_proj", 0), "add_k_proj": ("add_kv_proj", 1), "add_v_proj": ("add_kv_proj", 2)}
    for module, (a, b) in pairs.items():
        prefix, _, leaf = module.rpartition(".")
        fused, slot = fused_slot.get(leaf, (None, 0))
        layer = f"transformer.{prefix}.{fused}" if fused else f"transformer.{module}"
        want_a = torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        want_b = torch.from_numpy(b.astype(np.float32)).to(torch.bfloat16) * SCALE  # vLLM-Omni's own rounding
        assert torch.equal(layers[layer].lora_a_stacked[slot][0, 0], want_a), module
        assert torch.equal(layers[layer].lora_b_stacked[slot][0, 0], want_b), module
        assert torch.equal(manager.masters[module].lora_a, want_a) and torch.equal(manager.masters[module].lora_b,
                                                                                   want_b)
    assert np.array_equal(lora_shm.read_arrays(manifest)[next(iter(tensors))],
                          tensors[next(iter(tensors))].astype(BF16))  # the file itself is never written to


def test_non_finite_values_are_refused_with_nothing_written(tmp_path):
    tensors = random_peft()
    bad = next(k for k in sorted(tensors) if "img_mlp.net.2.lora_B" in k)
    tensors[bad] = tensors[bad].copy()
    tensors[bad][0, 0] = np.nan
    manager, _, manifest, plan, first_b = setup(tmp_path, tensors)
    payload = vol.MappedPayload().to(manifest, "cpu")
    reply = vol.write_lora_slots(manager, payload, plan, first_b, SCALE, 7, "transformer")
    assert len(reply["refused"]) == 1 and "img_mlp.net.2: expected finite values" in reply["refused"][0]
    assert all(not t.any() for layer in manager._lora_modules.values() for t in layer.lora_a_stacked)


def test_a_manager_that_does_not_match_raises_instead_of_writing(tmp_path):
    manager, _, manifest, plan, first_b = setup(tmp_path, random_peft())
    payload = vol.MappedPayload().to(manifest, "cpu")
    with pytest.raises(RuntimeError, match="not the active one"):
        vol.write_lora_slots(manager, payload, plan, first_b, SCALE, 8, "transformer")
    del manager._lora_modules[f"transformer.{plan[-1][1]}"]
    with pytest.raises(RuntimeError, match="no wrapped layer"):
        vol.write_lora_slots(manager, payload, plan, first_b, SCALE, 7, "transformer")
    assert all(not t.any() for layer in manager._lora_modules.values() for t in layer.lora_a_stacked)


def test_slot_plan_refuses_a_wrong_shape_like_the_folder_path(tmp_path):
    tensors = random_peft()
    key = next(k for k in sorted(tensors) if "to_k.lora_B" in k)
    tensors[key] = tensors[key][:-1]
    table = vol.lora_module_table(FakeFusedTransformer())
    _, manifest = shared_file(tensors, tmp_path)
    with pytest.raises(ValueError, match=r"to_k\.lora_B\.weight: expected shape"):
        slot_plan(manifest, RANK, table)


@pytest.mark.slow
def test_trainer_export_is_the_peft_adapter_in_the_engine_dtype(tmp_path):
    """`SharedLoRA` (one jit: PEFT layout, bf16, flat) writes what `lora_to_peft` gives, cast to bf16, A first."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxflow.sync.lora_sync import SharedLoRA
    from jaxflow.families.qwen_image.config import QwenImageConfig
    from jaxflow.nn.config import ModelOptions
    from jaxflow.nn.lora import LoRAParam, lora_to_peft
    from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
    from jaxflow.families.qwen_image.transformer import QwenImageTransformer
    from tests.qwen_ref import TINY

    spec = LoRASpec(rank=4, alpha=8.0)
    model = QwenImageTransformer(QwenImageConfig(**TINY), ModelOptions(), spec, rngs=nnx.Rngs(0))
    lora = nnx.state(model, LoRAParam)
    lora = jax_tree_perturb(lora)
    shared = SharedLoRA(spec, "bfloat16")
    shared.file.path = tmp_path / shared.file.path.name
    manifest = shared.write(lora)
    got, want = lora_shm.read_arrays(manifest), lora_to_peft(lora, spec)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], np.asarray(jnp.asarray(want[k]).astype(jnp.bfloat16)))
    kinds = ["lora_B" in k for k, _ in manifest["entries"]]
    assert kinds == sorted(kinds)
    shared.close()
    assert not (tmp_path / shared.file.path.name).exists()


def jax_tree_perturb(state):
    """LoRA B starts at zero: give every leaf distinct values so that a misplaced tensor shows."""
    import jax
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def test_the_transport_is_chosen_once_from_the_hosts_and_a_failed_sync_never_switches_it(monkeypatch, caplog, capsys):
    """Engines on this host get the shared file, others arrays, an in-process engine device tensors; the choice is
    logged once. A server that cannot read the file fails the sync: each failure is logged and counted, the sync is
    retried once through the same transport, then the run stops with one line naming engine, transport and version
    (it once switched to arrays for good, silently but for one warning)."""
    import logging
    import socket

    from jaxflow.sync import transport

    here = {"engine": "diffusers", "dtype": "bfloat16", "host": socket.gethostname(), "lora_apply": "merged"}
    assert transport.choose_transport(False, 1, [here, here]) == "shm"
    assert transport.choose_transport(False, 1, [here, {**here, "host": "elsewhere"}]) == "ray"
    assert transport.choose_transport(True, 1, [{**here, "device": "cpu"}]) == "device"
    assert transport.choose_transport(True, 2, [{**here, "device": "cpu"}]) == "ray"

    calls = []

    class Rollout:
        last_ack = {}
        fail = 0

        def update_lora_shared(self, manifest, version, config):
            calls.append("shared")
            if Rollout.fail:
                Rollout.fail -= 1
                raise FileNotFoundError("shared LoRA file /dev/shm/x is not on this host")
            return 7

        def update_lora(self, tensors, version, config):
            calls.append("arrays")
            return 7

    monkeypatch.setattr(transport, "SharedLoRA", NoFile)
    spec = SimpleNamespace(peft_config=lambda: {"r": 4, "lora_alpha": 8})
    with caplog.at_level(logging.INFO, logger=transport.__name__):
        sync = transport.LoRASync(Rollout(), spec, "shm", here, verify=False)  # the check: tests/sync/test_sync_verify.py
        assert sync.serve(None, 1) == 7 and sync.failures == 0
        Rollout.fail = 1
        assert sync.serve(None, 2) == 7 and sync.failures == 1  # retried once, same transport
        Rollout.fail = 2
        with pytest.raises(RuntimeError, match=r"^LoRA sync of version 3 to the diffusers engine through shm failed "
                                               r"again: FileNotFoundError: shared LoRA file"):
            sync.serve(None, 3)
    assert calls == ["shared"] * 5 and sync.failures == 3
    assert capsys.readouterr().out == "LoRA sync: transport=shm, apply=merged, engine=diffusers\n"
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 3


@pytest.mark.slow
def test_a_run_through_ray_syncs_through_the_file_and_times_it(ray_session, tmp_path, monkeypatch):
    """The tiny run with its rollout in a Ray actor on this host: every sync goes through the shared file (its
    write timed as sync_write), and the run removes its file when it closes (its own: other tests' runs may be
    writing theirs at the same time)."""
    import jaxflow.sync.lora_sync

    made = []

    class Recorded(lora_shm.SharedAdapterFile):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.path)

    monkeypatch.setattr(jaxflow.sync.lora_sync, "SharedAdapterFile", Recorded)
    out = run(tiny_config(tmp_path / "run", num_steps=2))
    assert all("time/sync_write" in row for row in out["history"])
    assert len(made) == 1 and not made[0].exists()


def test_a_syncs_parts_are_named_for_the_start_up_line(monkeypatch, capsys):
    """The first sync's line names its parts: the trainer's write, the engines' apply (their ack's seconds) and the
    served-weight check; a transport that times no parts (Ray arrays) names none."""
    from jaxflow.sync import transport
    from jaxflow.trainer import phases

    class Rollout:
        last_ack = {"seconds": 11.4}

        def update_lora_shared(self, manifest, version, config):
            return 7

    monkeypatch.setattr(transport, "SharedLoRA", NoFile)
    spec = SimpleNamespace(peft_config=lambda: {"r": 4, "lora_alpha": 8})
    info = {"engine": "vllm_omni", "dtype": "bfloat16", "lora_apply": "merged"}
    sync = transport.LoRASync(Rollout(), spec, "shm", info, verify=False)
    with phases.recording() as seconds:
        sync.serve(None, 0)
    assert set(seconds) == {"sync_write", "sync_engine"}
    assert sync.summary(seconds) == "write 0 s, engines 11 s"
    sync.verify_s = 0.6
    assert sync.summary({**seconds, "sync_write": 1.5}) == "write 2 s, engines 11 s, check 1 s"
    assert sync.summary({}) == ""
    capsys.readouterr()
