"""The order in which our pipelines hand weights to vLLM-Omni's loader: every bias after every other tensor.

vLLM 0.20's online FP8 (`quantization="fp8"` on a bf16 checkpoint) creates each quantized linear's weight on the meta
device and buffers its loads until every element arrived (`vllm/model_executor/model_loader/reload/layerwise.py`,
`online_process_loader`); then `materialize_layer` (`reload/meta.py`) re-allocates *every* tensor of the layer with
`torch.empty_strided`, its bias included, and replays only the buffered weight loads. The bias is created after the
weight (`layers/linear.py`, `ColumnParallelLinear.__init__`), so its loader is not buffered: a bias loaded before its
layer's weight is complete is lost, left as uninitialized memory. Safetensors names come sorted (".bias" before
".weight"), the random spec's in module order (a fused q/k/v layer's q and k biases before its v weight); with every
bias last, each lands in the layer's final tensor. Any other loader takes the tensors in any order.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator


def biases_last(weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """`weights` (name, tensor) with the names ending in ".bias" held back and yielded after all others, each group
    in its own order."""
    biases = []
    for name, tensor in weights:
        if name.endswith(".bias"):
            biases.append((name, tensor))
        else:
            yield name, tensor
    yield from biases
