"""vLLM-Omni's worker-side LoRA sinks (jaxflow_bridge/sync/vllm_omni_sinks.py) on a stand-in worker: Qwen-Image's fused
transformer (bf16 weights), vLLM-Omni's LoRA slots (tests/helpers_vllm_omni.py FakeManager). Every apply mode, with
the payload as arrays (float32, as over Ray) and as a shared bf16 file, serves what the payload asks, read back from
the worker's own tensors under the payload's PEFT names; a sink still holding version 1 when asked for version 2 is
caught. The worker gets its arguments as the engine sends them (`LoRAPayload.to_wire()`) after vLLM-Omni's msgpack
between a two-stage deployment's processes (and pickle, one stage's), which turns a dataclass into a dict."""
from types import SimpleNamespace

import ml_dtypes

import numpy as np
import pytest
import torch

from jaxflow_bridge.contract.lora import adapter_config, lora_pairs, to_vllm_omni
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.lora_shm import SharedAdapterFile
from jaxflow_bridge.contract.served import ServedProbe, differing
from jaxflow_bridge.sync.merge import MergedLoRA
from jaxflow_bridge.sync.probe import engine_names
from jaxflow_bridge.sync.vllm_omni_slots import lora_module_table
from tests.helpers import RANK, expected_served, random_peft
from tests.helpers_vllm_omni import (FakeFusedTransformer, FakeManager, FakeWorker, omni_msgpack_round_trip,
                                     pickle_round_trip)

CONFIG = adapter_config(RANK, 8.0, ["to_q"])  # the scale, 2; the tensors decide which modules bind
ADAPTER_ID = 7


def stand_in(mode: str) -> FakeWorker:
    transformer = FakeFusedTransformer()
    pipeline = SimpleNamespace(lora_component="transformer", transformer=transformer,
                               merged_lora=MergedLoRA() if mode == "merged" else None)
    return FakeWorker(pipeline)


def add_lora(worker: FakeWorker, payload: LoRAPayload) -> None:
    """What vLLM-Omni's add_lora leaves on the worker: the adapter in the manager's slots, active."""
    pairs = lora_pairs(to_vllm_omni(payload.arrays()))
    table = lora_module_table(worker.model_runner.pipeline.transformer)
    worker.lora_manager = FakeManager(table, pairs, RANK, "transformer", ADAPTER_ID, payload.scale)


def apply_rpc(worker, mode, payload, loaded=False, wire=omni_msgpack_round_trip) -> dict:
    """`rollout_apply_lora`'s reply to the engine's arguments, both across the transport `wire`."""
    args = (mode, payload.to_wire(), engine_names(to_vllm_omni, payload.modules), ADAPTER_ID if loaded else None)
    return wire(worker.rollout_apply_lora(*wire(args)))


def apply(worker, mode, payload, loaded=False) -> ServedProbe:
    reply = apply_rpc(worker, mode, payload, loaded)
    assert reply["written"] == len(payload.modules), reply
    return ServedProbe.from_dict(reply["served"])


@pytest.fixture(params=["arrays", "shared"])
def payloads(request, tmp_path):
    """Version v of an adapter over every default target of 3 blocks (36 modules: the probe reads 32); a shared one
    in a file of its own (the trainer rewrites one file, but a test keeps every version readable)."""
    files = []

    def make(version):
        tensors = random_peft(seed=version)
        if request.param == "arrays":
            return LoRAPayload(version, CONFIG, tensors=tensors)
        files.append(SharedAdapterFile("bfloat16", root=tmp_path))
        return LoRAPayload(version, CONFIG, shared=files[-1].write_arrays(tensors))
    yield make
    for file in files:
        file.close()


@pytest.mark.parametrize("mode", ["layers", "folder", "merged"])
def test_every_mode_serves_the_payload_and_a_stale_adapter_is_caught(payloads, mode):
    worker = stand_in(mode)
    v1, v2, v3 = payloads(1), payloads(2), payloads(3)
    if mode == "merged":
        probe = apply(worker, mode, v1)
    else:
        add_lora(worker, v1)
        probe = apply(worker, mode, v1, loaded=True)
    assert probe.version == 1 and probe.bound_modules == 36 and len(probe.deltas) == 32
    assert set(probe.deltas) <= set(v1.modules) and "transformer_blocks.0.attn.to_out.0" in v1.modules
    assert differing(expected_served(v1), probe) == []
    sink = worker.rollout_sink(mode)
    assert differing(expected_served(v2), sink.served(v2)) == sorted(expected_served(v2))
    if mode == "folder":  # nothing written in place: every adapter comes through add_lora
        assert apply_rpc(worker, mode, v2)["error"] is True
        add_lora(worker, v2)
        probe = apply(worker, mode, v2, loaded=True)
    else:
        probe = apply(worker, mode, v2)
    assert differing(expected_served(v2), probe) == []
    if mode == "merged":  # the bare base while it is restored, then the next adapter merged from it
        worker.rollout_restore_base()
        assert not any(np.any(v) for v in sink.served(v2).deltas.values())
        assert differing(expected_served(v3), apply(worker, mode, v3)) == []


def test_the_adapter_loaded_but_not_yet_active_is_read_from_the_managers_copy(payloads):
    """After add_lora, vLLM-Omni activates an adapter (copies it into the slots) with the first request that
    carries it: until then the probe reads the copy it will activate, not the slots of the previous one."""
    worker = stand_in("folder")
    v1 = payloads(1)
    add_lora(worker, v1)
    with torch.no_grad():
        for wrapped in worker.lora_manager._lora_modules.values():  # the slots of another adapter
            for t in (*wrapped.lora_a_stacked, *wrapped.lora_b_stacked):
                t.zero_()
    worker.lora_manager._active_adapter_id = ADAPTER_ID - 1
    assert differing(expected_served(v1), apply(worker, "folder", v1, loaded=True)) == []
    worker.lora_manager._active_adapter_id = ADAPTER_ID
    assert differing(expected_served(v1), worker.rollout_sink("folder").served(v1)) == sorted(expected_served(v1))


def test_a_non_finite_payload_is_refused_with_nothing_written(payloads):
    worker = stand_in("layers")
    v1 = payloads(1)
    add_lora(worker, v1)
    apply(worker, "layers", v1, loaded=True)
    bad = dict(random_peft(seed=2))
    key = next(k for k in bad if k.endswith("to_q.lora_A.weight"))
    bad[key] = np.full_like(bad[key], np.nan)
    payload = LoRAPayload(2, CONFIG, tensors=bad)
    reply = apply_rpc(worker, "layers", payload)
    assert "finite" in reply["refused"] and "previous adapter keeps serving" in reply["refused"]
    assert differing(expected_served(v1), worker.rollout_sink("layers").served(v1)) == []


def test_merged_serves_the_previous_adapter_again_after_a_refusal_while_restoring(payloads):
    """The engine refused an adapter after `release_adapter` began restoring the base: the workers merge the previous
    one again, and the probe reads it back; before that they serve the bare base and refuse to sample."""
    worker = stand_in("merged")
    v1 = payloads(1)
    apply(worker, "merged", v1)
    worker.rollout_restore_base()
    with pytest.raises(RuntimeError, match="being restored"):
        worker.rollout_sink("merged").check_serving()
    assert worker.rollout_serve_again() == {"written": 36}
    assert differing(expected_served(v1), worker.rollout_sink("merged").served(v1)) == []


@pytest.mark.parametrize("wire", [omni_msgpack_round_trip, pickle_round_trip], ids=["msgpack", "pickle"])
@pytest.mark.parametrize("form", ["float32", "bfloat16", "shared"])
def test_the_payload_crosses_either_transport_as_plain_values(wire, form, tmp_path):
    """msgpack (a two-stage deployment) turns the payload dataclass into a dict and refuses bfloat16 arrays; its wire
    form comes back byte for byte (dtype, shape, manifest) through msgpack and pickle, and the worker serves it."""
    tensors = random_peft(seed=4)
    if form == "bfloat16":
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    shared = SharedAdapterFile("bfloat16", root=tmp_path)
    payload = LoRAPayload(4, CONFIG, shared=shared.write_arrays(tensors)) if form == "shared" else \
        LoRAPayload(4, CONFIG, tensors=tensors)
    if form == "bfloat16":  # the dataclass as it was sent: refused whole (numpy has no bfloat16 kind msgpack takes)
        with pytest.raises(TypeError, match="not serializable"):
            omni_msgpack_round_trip(payload)
    else:  # or a dict, without `.shared`, at the worker
        assert isinstance(omni_msgpack_round_trip(payload), dict)
    back = LoRAPayload.from_wire(wire(payload.to_wire()))
    assert (back.version, back.config, back.shared) == (4, CONFIG, payload.shared and wire(payload.shared))
    for key, array in payload.arrays().items():
        got = back.arrays()[key]
        assert got.dtype == array.dtype and got.shape == array.shape and got.tobytes() == array.tobytes(), key
    reply = apply_rpc(stand_in("merged"), "merged", payload, wire=wire)
    assert reply["written"] == len(payload.modules), reply
    assert differing(expected_served(payload), ServedProbe.from_dict(reply["served"])) == []
    shared.close()


def test_a_zero_first_adapter_is_served_at_once_and_settles_before_the_weights_move():
    """Every run's first sync (B = 0) writes nothing: its probe reads zero deltas while the base's host copies are
    taken in the background; `rollout_settle` (the engine's sleep calls it first) waits for them."""
    worker = stand_in("merged")
    tensors = {k: (np.zeros_like(v) if "lora_B" in k else v) for k, v in random_peft(seed=1).items()}
    zero = LoRAPayload(1, CONFIG, tensors=tensors)
    probe = apply(worker, "merged", zero)
    assert probe.bound_modules == 36 and not any(np.any(v) for v in probe.deltas.values())
    assert differing(expected_served(zero), probe) == []
    assert worker.rollout_settle() == {"settled": True}
    merged = worker.model_runner.pipeline.merged_lora
    assert merged.serving and len(merged.copies) == len({id(w) for w, _, _ in merged.served_slices().values()})
    assert all(torch.equal(w, c) for w, c, _ in merged.served_slices().values())
    assert worker.rollout_settle() == {"settled": True}
