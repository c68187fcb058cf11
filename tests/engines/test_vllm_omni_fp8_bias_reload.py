"""Our vLLM-Omni pipeline's weight loading under vLLM 0.20's online FP8 (no vLLM here): a stand-in loader with its
hazard (`jaxflow_bridge/engines/vllm_omni/bias_reload.py`) must end with every tensor the folder or the random spec
holds, from disk and drawn alike."""
import math
import re
from types import SimpleNamespace

import torch
from safetensors import safe_open

from jaxflow_bridge.engines.vllm_omni.bias_reload import load_with_biases_again
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from tests.helpers_vllm_omni import FakeOmniQwenImagePipeline

# the block linears vLLM-Omni 0.20 builds with the quantization config (qwen_image_transformer.py), in diffusers
# names; q/k/v (and the added ones) are slices of one fused layer
QUANTIZED = re.compile(r"^(transformer_blocks\.\d+\.)(attn\.(?:to_[qkv]|add_[qkv]_proj|to_out\.0|to_add_out)"
                       r"|(?:img|txt)_mlp\.net\.(?:0\.proj|2))\.(weight|bias)$")
FUSED = {"to_q": "to_qkv", "to_k": "to_qkv", "to_v": "to_qkv", "add_q_proj": "add_kv", "add_k_proj": "add_kv",
         "add_v_proj": "add_kv"}


def fp8_layer(name: str) -> str | None:
    """The quantized (fused) layer a diffusers parameter belongs to, None for one that stays bf16."""
    match = QUANTIZED.match(name)
    if match is None:
        return None
    leaf = match.group(2).split(".")
    return match.group(1) + ".".join(leaf[:1] + [FUSED.get(leaf[1], leaf[1])] + leaf[2:])


class OnlineFp8Pipeline(FakeOmniQwenImagePipeline):
    """vLLM 0.20's online FP8 load of the quantized linears under vLLM-Omni's transformer loader: each call looks the
    parameters up in a dict built at its start (`QwenImageTransformer2DModel.load_weights`); a layer's weight loads
    are buffered until every slice arrived, then the layer's Parameters, its bias too, are replaced by new
    uninitialized ones (NaN here; `reload/meta.py`'s `materialize_layer`) and only the buffered weight loads are
    replayed (`reload/layerwise.py`); a bias, or a weight of a layer already replaced, loads at once. Any other
    parameter loads at once."""

    def load_weights(self, weights):
        if not hasattr(self, "missing"):
            self.missing, self.buffered = {}, {}
            for name, _ in self.transformer.named_parameters():
                if fp8_layer(name) and name.endswith(".weight"):
                    self.missing.setdefault(fp8_layer(name), set()).add(name)
        params, loaded = dict(self.transformer.named_parameters()), set()
        with torch.no_grad():
            for full, tensor in weights:
                name, layer = full.removeprefix("transformer."), fp8_layer(full.removeprefix("transformer."))
                loaded.add(full)
                if layer is None or name.endswith(".bias") or not self.missing[layer]:
                    params[name].copy_(tensor)
                    continue
                self.buffered.setdefault(layer, []).append((name, tensor))
                self.missing[layer].discard(name)
                if not self.missing[layer]:
                    self.materialize(layer)
        return loaded

    def materialize(self, layer: str):
        for member, old in list(self.transformer.named_parameters()):
            if fp8_layer(member) == layer:
                module, leaf = self.transformer.get_submodule(member.rpartition(".")[0]), member.rpartition(".")[2]
                setattr(module, leaf, torch.nn.Parameter(torch.full_like(old, math.nan), requires_grad=False))
        current = dict(self.transformer.named_parameters())
        for member, weight in self.buffered.pop(layer):
            current[member].copy_(weight)


def folder_stream(tiny_path):
    """The transformer folder's tensors in vLLM's safetensors iterator order (`safe_open(...).keys()`: sorted)."""
    for path in sorted((tiny_path / "transformer").glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                yield f"transformer.{key}", f.get_tensor(key)


def assert_same_weights(model, reference: dict):
    assert set(model) == set(reference)
    for name, ref in reference.items():
        assert torch.isfinite(model[name]).all() and torch.equal(model[name], ref), name


def biases_last(stream):
    items = list(stream)
    return [i for i in items if not i[0].endswith(".bias")] + [i for i in items if i[0].endswith(".bias")]


def test_the_stand_in_loses_every_quantized_bias_in_any_order(tiny_path):
    """The hazard as vLLM 0.20 with vLLM-Omni's loader has it: in one call every quantized linear's bias is lost,
    whether it comes before its weight (the folder's sorted names) or after all weights; the bf16 linears' are kept.
    A second call with the biases fills them."""
    expected = None
    for order in (lambda s: s, biases_last):
        pipe = OnlineFp8Pipeline(od_config=SimpleNamespace(model=str(tiny_path)))
        pipe.load_weights(iter(order(folder_stream(tiny_path))))
        lost = {n for n, p in pipe.transformer.named_parameters() if not torch.isfinite(p).all()}
        expected = {n for n, _ in pipe.transformer.named_parameters() if fp8_layer(n) and n.endswith(".bias")}
        assert lost == expected
        assert "transformer_blocks.0.attn.to_q.bias" in lost and "transformer_blocks.0.img_mod.1.bias" not in lost
        pipe.load_weights(iter([i for i in folder_stream(tiny_path) if i[0].endswith(".bias")]))
        assert all(torch.isfinite(p).all() for p in pipe.transformer.parameters())


def test_biases_are_loaded_again_in_a_call_of_their_own():
    calls = []
    loaded = load_with_biases_again(lambda w: calls.append(list(w)) or {n for n, _ in calls[-1]},
                                    iter([("a.bias", 0), ("a.weight", 1), ("b.weight", 2), ("b.bias", 3)]))
    assert calls == [[("a.bias", 0), ("a.weight", 1), ("b.weight", 2), ("b.bias", 3)], [("a.bias", 0), ("b.bias", 3)]]
    assert loaded == {"a.bias", "a.weight", "b.weight", "b.bias"}


def test_folder_weights_survive_online_fp8_loading(tiny_path):
    ours = vop.build_pipeline_class(OnlineFp8Pipeline, SimpleNamespace)(
        od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={}))
    ours.load_weights(folder_stream(tiny_path))
    assert_same_weights(ours.transformer.state_dict(), {k[len("transformer."):]: t for k, t in folder_stream(tiny_path)})


def test_drawn_weights_survive_online_fp8_loading(tiny_path):
    """model.init=random: the engine-drawn stream (every bias zero) ends as the diffusers engine's drawn model."""
    ours = vop.build_pipeline_class(OnlineFp8Pipeline, SimpleNamespace)(
        od_config=SimpleNamespace(model=str(tiny_path), custom_pipeline_args={"random_seed": 3}))
    ours.load_weights(iter([]))
    ref = RolloutPipeline.from_pretrained(tiny_path, dtype="float32", device="cpu", random_seed=3)
    assert_same_weights(ours.transformer.state_dict(), ref.transformer.state_dict())
    assert ours.random_fingerprint == ref.fingerprint
