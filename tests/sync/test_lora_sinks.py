"""The engine-side LoRA sinks (jaxflow_bridge/sync/sinks.py): one payload (contract/lora_payload.py) served through
each apply mode of the tiny diffusers engine (CPU) leaves the same effective weights and the same images."""
import numpy as np
import pytest
import torch

from jaxflow_bridge.contract.lora import adapter_config
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.lora_shm import SharedAdapterFile
from jaxflow_bridge.contract.served import ServedProbe, differing, probe_positions
from jaxflow_bridge.engines.diffusers import DiffusersEngine
from jaxflow_bridge.sync.sinks import make_sink
from tests.helpers import expected_served

TARGETS = ("attn.to_q", "attn.to_out.0", "img_mlp.net.2")
CONFIG = adapter_config(4, 8.0, ["to_q", "to_out.0", "img_mlp.net.2"])
SAMPLING = {"height": 64, "width": 64, "num_inference_steps": 3, "true_cfg_scale": 1.0}


def engine(tiny_path, mode):
    return DiffusersEngine({"model": str(tiny_path), "dtype": "float32", "device": "cpu", "lora_apply": mode})


def payload_tensors(model, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for block in range(2):
        for target in TARGETS:
            linear = model.get_submodule(f"transformer_blocks.{block}.{target}")
            key = f"transformer_blocks.{block}.{target}"
            out[f"{key}.lora_A.weight"] = rng.normal(0, 0.3, (4, linear.in_features)).astype(np.float32)
            out[f"{key}.lora_B.weight"] = rng.normal(0, 0.3, (linear.out_features, 4)).astype(np.float32)
    return out


@torch.no_grad()
def effective_weights(e) -> dict[str, torch.Tensor]:
    """What each adapted layer computes, as a matrix: layer(I) - layer(0), whatever wraps or merges it."""
    model, out = e.pipeline.transformer, {}
    for block in range(2):
        for target in TARGETS:
            layer = model.get_submodule(f"transformer_blocks.{block}.{target}")
            n = e.pipeline.lora.linears[f"transformer_blocks.{block}.{target}"].in_features
            out[f"{block}.{target}"] = (layer(torch.eye(n)) - layer(torch.zeros(1, n))).T
    return out


def test_each_sink_serves_the_same_weights_and_images_from_one_payload(tiny_path):
    base = engine(tiny_path, "layers")
    tensors = payload_tensors(base.pipeline.transformer)
    bare = effective_weights(base)
    file = SharedAdapterFile("float32")
    try:
        payloads = {"arrays": LoRAPayload(1, CONFIG, tensors=tensors),
                    "shared": LoRAPayload(1, CONFIG, shared=file.write_arrays(tensors))}
        served, images = {}, {}
        for mode in ("layers", "merged", "folder"):
            for carrier, payload in payloads.items():
                e = engine(tiny_path, mode)
                reply = e.pipeline.serve_lora(payload)
                assert (reply["version"], reply["bound_modules"]) == (1, 2 * len(TARGETS))
                assert e.info()["lora_apply"] == mode and e.info()["lora_modules"] == 2 * len(TARGETS)
                served[mode, carrier] = effective_weights(e)
                images[mode, carrier] = e.generate(["a red square"], 1, SAMPLING, [7])["images"]
    finally:
        file.close()
    want = served["layers", "arrays"]
    for key, weights in want.items():  # the adapter changed each layer by scale * B @ A
        a, b = (torch.from_numpy(tensors[f"transformer_blocks.{key}.lora_{p}.weight"]) for p in "AB")
        torch.testing.assert_close(weights - bare[key], 2.0 * (b @ a), atol=1e-4, rtol=1e-4)
    for case, weights in served.items():
        for key in want:
            torch.testing.assert_close(weights[key], want[key], atol=1e-5, rtol=1e-5, msg=f"{case} {key}")
        np.testing.assert_allclose(images[case], images["layers", "arrays"], atol=2)


def test_merged_sink_restores_the_base_and_refuses_to_sample_until_the_next_update(tiny_path):
    e = engine(tiny_path, "merged")
    bare = effective_weights(e)
    tensors = payload_tensors(e.pipeline.transformer)
    e.update_lora(tensors, 1, CONFIG)
    e.release_adapter()
    for key, weights in effective_weights(e).items():
        assert torch.equal(weights, bare[key])
    with pytest.raises(RuntimeError, match="being restored"):
        e.generate(["a"], 1, SAMPLING, [0])
    bad = dict(tensors, **{"transformer_blocks.0.attn.to_q.lora_A.weight": np.full_like(tensors["transformer_blocks.0.attn.to_q.lora_A.weight"], np.nan)})
    with pytest.raises(ValueError, match="finite"):
        e.update_lora(bad, 2, CONFIG)
    assert e.update_lora(tensors, 3, CONFIG)["version"] == 3 and e.info()["policy_version"] == 3


def test_an_unknown_apply_mode_is_refused(tiny_path):
    with pytest.raises(ValueError, match=r"lora_apply='fused'; choose one of \['folder', 'layers', 'merged'\]"):
        engine(tiny_path, "fused")


@pytest.mark.parametrize("mode", ["layers", "merged", "folder"])
def test_each_sink_reports_what_it_serves_and_a_stale_adapter_is_caught(tiny_path, mode):
    e = engine(tiny_path, mode)
    v1 = LoRAPayload(1, CONFIG, tensors=payload_tensors(e.pipeline.transformer, seed=0))
    v2 = LoRAPayload(2, CONFIG, tensors=payload_tensors(e.pipeline.transformer, seed=1))
    reply = e.pipeline.serve_lora(v1)
    probe = ServedProbe.from_dict(reply["served"])
    assert probe.version == 1 and probe.bound_modules == 2 * len(TARGETS) and len(probe.deltas) == 2 * len(TARGETS)
    assert differing(expected_served(v1), probe) == []
    stale = e.pipeline.lora.served(v2)  # fed version 2, still holding version 1's weights
    assert differing(expected_served(v2), stale) == sorted(expected_served(v2))
    assert differing(expected_served(v2), ServedProbe.from_dict(e.pipeline.serve_lora(v2)["served"])) == []


def test_a_module_the_sink_did_not_bind_reports_zeros(tiny_path):
    e = engine(tiny_path, "layers")
    tensors = payload_tensors(e.pipeline.transformer)
    e.pipeline.serve_lora(LoRAPayload(1, CONFIG, tensors={k: v for k, v in tensors.items() if "to_q" not in k}))
    probe = e.pipeline.lora.served(LoRAPayload(1, CONFIG, tensors=tensors))
    assert differing(expected_served(LoRAPayload(1, CONFIG, tensors=tensors)), probe) == [
        f"transformer_blocks.{i}.attn.to_q" for i in range(2)]
    assert not any(probe.deltas[f"transformer_blocks.{i}.attn.to_q"].any() for i in range(2))


def bf16_linear(seed: int) -> torch.nn.Sequential:
    """A bf16 Linear(96, 80) with N(0, 1) weights (magnitude 1: a merge rounds them)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(96, 80)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.normal_()
    return model


def factors(seed: int) -> dict[str, np.ndarray]:
    """A rank-4 float32 adapter of `bf16_linear`'s layer, under PEFT's names (A first)."""
    rng = np.random.default_rng(seed)
    return {"0.lora_A.weight": rng.normal(0, 0.1, (4, 96)).astype(np.float32),
            "0.lora_B.weight": rng.normal(0, 0.1, (80, 4)).astype(np.float32)}


def test_merged_in_bfloat16_is_predicted_for_a_real_bf16_linear():
    """A real bf16 Linear (weights of magnitude 1, so the merge rounds): the served W is the predicted rounding of
    W_base + delta; the same payload read as layers in bf16 within `product_tolerance`."""
    model, tensors = bf16_linear(0), factors(3)
    payload = LoRAPayload(5, CONFIG, tensors=tensors)
    for mode in ("merged", "layers"):
        sink = make_sink(mode, model)
        assert sink.apply(payload) == 1
        probe = sink.served(payload)
        assert differing(expected_served(payload), probe) == [], mode
        assert differing(expected_served(LoRAPayload(6, CONFIG, tensors={k: v * 1.5 for k, v in tensors.items()})), probe) \
            == ["0"], mode
        sink.release()
        if mode == "merged":
            assert not np.any(sink.served(payload).deltas["0"])  # the bare base while it is restored
            sink.apply(payload)


def test_merged_bf16_deltas_within_half_an_ulp_of_the_weight_still_tell_a_stale_or_no_adapter_apart():
    """The GPU case: bf16 weights and a young adapter whose deltas are all within |W| / 256 (half an ulp of W at
    most), below half an ulp at most positions, so merging it leaves most weights as they were. The right adapter
    passes; the previous version's (0.7 of this B) and one that changes nothing (B = 0) are caught, where they round
    W_base + delta to another neighbour than the right one does."""
    model = bf16_linear(1)
    with torch.no_grad():  # |W| in [1.5, 2): half an ulp is 2 ** -8, |W| / 256 at least 1.5 * 2 ** -8
        model[0].weight.copy_(torch.sign(torch.randn(80, 96)) * (1.5 + 0.5 * torch.rand(80, 96)))
    a, b = factors(7).values()

    def payload(version, b_scale):
        return LoRAPayload(version, CONFIG, tensors={"0.lora_A.weight": a, "0.lora_B.weight": b * b_scale})

    rows, cols = probe_positions("0", (80, 96))
    scale = 5.5e-3 / np.abs(expected_served(payload(1, 1.0))["0"]).max()  # the largest delta: 5.5e-3
    want = expected_served(payload(2, scale))
    weight = model[0].weight.detach().float().numpy()[rows, cols]
    assert np.all(np.abs(want["0"]) < np.abs(weight) / 256) and np.mean(np.abs(want["0"]) < 2.0 ** -8) > 0.8
    for b_scale, caught in ((scale, []), (0.7 * scale, ["0"]), (0.0, ["0"])):
        sink = make_sink("merged", model)
        sink.apply(payload(2, b_scale))
        assert differing(want, sink.served(payload(2, scale))) == caught, b_scale
        sink.release()


@pytest.mark.parametrize("mode", ["layers", "merged"])
def test_a_bf16_shared_file_of_the_trainers_float32_lora_is_checked_against_the_float32_deltas(mode):
    """The trainer casts its float32 LoRA to the engine's bf16 in the shared file and expects the float32 factors'
    deltas: the bound counts that cast although the engine keeps the payload's dtype; a stale adapter is caught."""
    model, tensors = bf16_linear(2), factors(5)
    file = SharedAdapterFile("bfloat16")
    try:
        payload = LoRAPayload(1, CONFIG, shared=file.write_arrays(tensors))
        sink = make_sink(mode, model)
        sink.apply(payload)
        probe = sink.served(payload)
        assert differing(expected_served(LoRAPayload(1, CONFIG, tensors=tensors)), probe) == []
        stale = {k: v * (1.5 if "lora_B" in k else 1.0) for k, v in tensors.items()}
        assert differing(expected_served(LoRAPayload(1, CONFIG, tensors=stale)), probe) == ["0"]
    finally:
        file.close()
