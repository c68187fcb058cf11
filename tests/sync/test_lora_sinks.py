"""The engine-side LoRA sinks (jaxflow_bridge/sync/sinks.py): one payload (contract/lora_payload.py) served through
each apply mode of the tiny diffusers engine (CPU) leaves the same effective weights and the same images."""
import numpy as np
import pytest
import torch

from jaxflow_bridge.contract.lora import adapter_config
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.lora_shm import SharedAdapterFile
from jaxflow_bridge.engines.diffusers import DiffusersEngine

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
                assert e.pipeline.serve_lora(payload) == {"version": 1, "bound_modules": 2 * len(TARGETS)}
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
