"""The rollout's LoRA merged into the base weights (jaxflow_bridge/sync/merge.py, vLLM-Omni's
lora_apply="merged"): the merge is base + scale * B @ A rounded once, every merge starts from the pristine base
(bit for bit), a refused adapter leaves the previous one served, and a rollout on merged weights equals one with the
adapter applied as LoRA layers; the driver releases the adapter while the learner trains."""
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch

from jaxflow_bridge.contract import lora_shm
from jaxflow_bridge.sync import vllm_omni_slots as vol
from jaxflow_bridge.engines.vllm_omni import codec
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
from jaxflow_bridge.sync.binding import slot_plan
from jaxflow_bridge.sync.merge import MergedLoRA, plan_targets
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from tests.helpers import RANK, make_adapter, random_peft
from tests.helpers_vllm_omni import SAMPLING, SEEDS, FakeFusedTransformer, FakeOmniQwenImagePipeline, omni_params

BF16 = np.dtype(ml_dtypes.bfloat16)
SCALE = 2.0


def shared(tensors: dict, tmp_path, dtype="bfloat16"):
    """`tensors` (PEFT keys) in a shared file, lora_A first (as jaxflow.sync.lora_sync.SharedLoRA lays it out); the
    manifest and its payload as a torch tensor."""
    f = lora_shm.SharedAdapterFile(dtype, root=tmp_path)
    manifest = f.write_arrays(tensors)
    return f, manifest, vol.MappedPayload().to(manifest, "cpu")


def fused_setup(tmp_path, seed=0):
    transformer = FakeFusedTransformer()
    table = vol.lora_module_table(transformer)
    f, manifest, payload = shared(random_peft(seed=seed), tmp_path)
    plan, _ = slot_plan(manifest, RANK, table)
    return transformer, table, plan, payload, f


def weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_merge_adds_the_scaled_product_to_each_slice_once(tmp_path):
    transformer, table, plan, payload, f = fused_setup(tmp_path)
    base = weights(transformer)
    targets = plan_targets(transformer, plan, table)
    assert len(plan) == 36 and MergedLoRA().merge(payload, targets, SCALE) == {"written": 36}
    after = weights(transformer)
    changed = set()
    for module, weight, row, rows, a_off, a_shape, b_off, b_shape in targets:
        name = next(n for n, p in transformer.named_parameters() if p is weight)
        a = payload[a_off:a_off + a_shape[0] * a_shape[1]].view(a_shape).double()
        b = payload[b_off:b_off + b_shape[0] * b_shape[1]].view(b_shape).double()
        want = base[name][row:row + rows].double() + SCALE * b @ a  # exact in float64
        got = after[name][row:row + rows].double()
        ulp = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(2 ** -126))) - 7)  # a bf16 step at |want|
        assert bool(((got - want).abs() <= ulp).all()), module  # rounded to bf16 once (within one step)
        assert not torch.equal(got, base[name][row:row + rows].double()), module
        changed.add(name)
    for name in set(base) - changed:  # the modulation linears, img_in, ...: not adapted, not touched
        assert torch.equal(after[name], base[name]), name
    f.close()


def test_every_merge_starts_from_the_pristine_base(tmp_path):
    """Merging v2 over v1 gives the bits of v2 merged into the base; a restore gives the base back bit for bit."""
    transformer, table, plan, payload, f = fused_setup(tmp_path)
    base = weights(transformer)
    targets = plan_targets(transformer, plan, table)
    merged = MergedLoRA()
    merged.merge(payload, targets, SCALE)
    _, manifest2, payload2 = shared(random_peft(seed=1), tmp_path)
    merged.merge(payload2, targets, SCALE)
    over_v1 = weights(transformer)
    merged.begin_restore()
    assert not merged.serving and all(torch.equal(p, base[n]) for n, p in weights(transformer).items())
    fresh = MergedLoRA()
    fresh.merge(payload2, targets, SCALE)
    assert all(torch.equal(p, over_v1[n]) for n, p in weights(transformer).items())
    f.close()


def test_a_non_finite_adapter_is_refused_and_the_previous_one_serves(tmp_path):
    transformer, table, plan, payload, f = fused_setup(tmp_path)
    targets = plan_targets(transformer, plan, table)
    merged = MergedLoRA()
    merged.merge(payload, targets, SCALE)
    served = weights(transformer)
    bad = random_peft(seed=2)
    bad["transformer_blocks.1.attn.to_k.lora_B.weight"][0, 0] = np.nan
    _, _, bad_payload = shared(bad, tmp_path)
    for restoring in (False, True):  # refused while merged, and after the release began the restore
        if restoring:
            merged.begin_restore()
        reply = merged.merge(bad_payload, targets, SCALE)
        assert reply == {"refused": ["transformer_blocks.1.attn.to_k: expected finite values"]}
        assert merged.serving and all(torch.equal(p, served[n]) for n, p in weights(transformer).items())
    f.close()


def test_a_layer_without_the_tables_weight_is_named(tmp_path):
    transformer, table, plan, payload, f = fused_setup(tmp_path)
    transformer.transformer_blocks[1].attn.to_out.weight = torch.nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(RuntimeError, match=r"transformer_blocks.1.attn.to_out: engine layer .* no base weight"):
        plan_targets(transformer, plan, table)
    f.close()


def linear_table(transformer: torch.nn.Module) -> dict:
    """`lora_module_table` for a diffusers transformer (torch Linear layers, nothing fused)."""
    return {"modules": {n: [m.in_features, [m.out_features]] for n, m in transformer.named_modules()
                        if isinstance(m, torch.nn.Linear)}, "packed": {}}


@pytest.mark.slow
def test_rollout_on_merged_weights_equals_the_lora_layers(tiny_path, tmp_path):
    """Our vLLM-Omni pipeline class with lora_apply="merged" (float32, the tiny components) samples what the
    diffusers engine samples with the same adapter as LoRA layers, to float32 rounding, for two adapters in turn;
    between a release and the next merge it refuses to sample."""
    cls = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    ours = cls(od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"lora_apply": "merged"}))
    ref = RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu")
    table = linear_table(ours.transformer)
    prompt, kwargs = vop.encode_request("a red fox jumping", SAMPLING, SEEDS, policy_version=1)
    request = SimpleNamespace(prompts=[prompt], sampling_params=omni_params(kwargs))
    modules = ("attn.to_q", "attn.to_k", "attn.add_v_proj", "img_mlp.net.2")
    for version, seed in ((1, 0), (2, 1)):
        tensors, config = make_adapter(ref, modules=modules, seed=seed)
        ref.update_lora(tensors, version, config)
        f, manifest, payload = shared(tensors, tmp_path, dtype="float32")
        plan, _ = slot_plan(manifest, config["r"], table)
        targets = plan_targets(ours.transformer, plan, table)
        assert ours.merged_lora.merge(payload, targets, config["lora_alpha"] / config["r"])["written"] == 8
        with torch.inference_mode():
            got = codec.unpack_trajectories(ours.forward(request), "a red fox jumping", group_id=0)
        want = ref.generate(["a red fox jumping"], 2, SAMPLING, SEEDS)
        np.testing.assert_allclose(got.latents, want.latents, rtol=0, atol=2e-5)
        np.testing.assert_allclose(got.log_probs, want.log_probs, rtol=0, atol=2e-4)
        ours.merged_lora.begin_restore()
        with pytest.raises(RuntimeError, match="being restored"):
            ours.forward(request)
        f.close()


def zero_b(payload: torch.Tensor, targets: list) -> torch.Tensor:
    """The payload with every B tensor (they follow the A tensors) zero: a fresh LoRA."""
    out = payload.clone()
    out[min(t[6] for t in targets):] = 0
    return out


def test_a_zero_first_adapter_writes_nothing_and_copies_the_base_in_the_background(tmp_path, monkeypatch):
    """Every run's first sync serves B = 0: the weights stay the base bit for bit, the served probe reads zero deltas
    at once, and the host copies are taken in a thread the next merge waits for; that merge equals a merge with no
    zero adapter before it, bit for bit."""
    transformer, table, plan, payload, f = fused_setup(tmp_path)
    base = weights(transformer)
    targets = plan_targets(transformer, plan, table)
    merged, started = MergedLoRA(), []
    real = merged._keep_later
    monkeypatch.setattr(merged, "_keep_later", lambda t: (started.append(len(t)), real(t)))
    assert merged.merge(zero_b(payload, targets), targets, SCALE) == {"written": 36}
    assert started == [36] and merged.serving
    assert all(torch.equal(p, base[n]) for n, p in weights(transformer).items())
    assert all(torch.equal(w, b) for w, b, _ in merged.served_slices().values())
    merged.merge(payload, targets, SCALE)
    assert merged._copying is None and len(merged.copies) == len({id(t[1]) for t in targets})
    after = weights(transformer)
    reference = FakeFusedTransformer()
    with torch.no_grad():
        for n, p in reference.named_parameters():
            p.copy_(base[n])
    MergedLoRA().merge(payload, plan_targets(reference, plan, table), SCALE)
    assert all(torch.equal(after[n], p) for n, p in weights(reference).items())
    merged.begin_restore()
    assert all(torch.equal(p, base[n]) for n, p in weights(transformer).items())
    f.close()


def test_a_failed_background_copy_is_raised_by_the_next_restore(tmp_path, monkeypatch):
    transformer, table, plan, payload, f = fused_setup(tmp_path)
    targets = plan_targets(transformer, plan, table)
    merged = MergedLoRA()

    def fail(targets):
        raise RuntimeError("page-locking the host copy failed")

    monkeypatch.setattr(merged, "_copy", fail)
    merged.merge(zero_b(payload, targets), targets, SCALE)
    with pytest.raises(RuntimeError, match="page-locking"):
        merged.begin_restore()
    f.close()


def test_a_nonzero_first_adapter_copies_before_it_merges(tmp_path, monkeypatch):
    transformer, table, plan, payload, f = fused_setup(tmp_path)
    targets = plan_targets(transformer, plan, table)
    merged = MergedLoRA()
    monkeypatch.setattr(merged, "_keep_later", lambda t: pytest.fail("a nonzero adapter's copies are taken first"))
    merged.merge(payload, targets, SCALE)
    assert merged._copying is None and len(merged.copies) == len({id(t[1]) for t in targets})
    f.close()
