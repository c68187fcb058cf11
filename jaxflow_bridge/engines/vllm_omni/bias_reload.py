"""Our pipelines' weight loading under vLLM's online FP8: every bias is loaded a second time, in a call of its own.

vLLM 0.20's online FP8 (`quantization="fp8"` on a bf16 checkpoint) creates each quantized linear's weight on the meta
device and buffers its loads until every element arrived (`vllm/model_executor/model_loader/reload/layerwise.py`);
then `materialize_layer` (`reload/meta.py`) replaces *every* tensor of the layer, its bias included, by a new
uninitialized Parameter and replays only the buffered weight loads. vLLM-Omni's DiT loaders look their parameters up
in a dict built once at the start of `load_weights`, so within that call a quantized linear's bias is lost whatever
the order: loaded before the layer completes, it is replaced; after, it goes to the replaced object.
When the first call returns every quantized layer is materialized; a second call, with only the biases, finds the
layers' current Parameters and fills them. For any other loader the second call rewrites the same values.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable


def load_with_biases_again(load: Callable[[Iterable], set], weights: Iterable[tuple[str, object]]) -> set:
    """`load(weights)`, then `load` of the biases among them (names ending in ".bias") in a call of their own; the
    union of both calls' loaded names."""
    biases = []

    def kept():
        for name, tensor in weights:
            if name.endswith(".bias"):
                biases.append((name, tensor))
            yield name, tensor

    loaded = set(load(kept()) or ())
    return loaded | set(load(iter(biases)) or ())
