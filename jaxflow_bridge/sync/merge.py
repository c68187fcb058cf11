"""The rollout's LoRA merged into the engine's base weights, with the base restored exactly from a host copy.

With the adapter merged, `W <- round(W + scale * B @ A)` per adapted slice, the rollout's linears are plain GEMMs:
no shrink, expand or LoRA kernels at all (vLLM-Omni's `lora_apply="merged"`, docs/design.md "LoRA sync"). A merge
cannot be undone by subtracting (the bf16 rounding of W + dW loses bits), so the first merge copies every adapted
weight once to page-locked host memory, and every later merge starts from that pristine copy: the served weights
are always base + the current adapter, rounded once, never a sum of rounded steps. A first adapter that is all zero
(B = 0: a fresh LoRA, every run's first sync) leaves the weights as they are, so that copy, seconds of page-locking,
is taken in a thread of its own while the first rollout runs, and the next merge or restore waits for it. The copy
back to the GPU can start as soon as a step's rollout is over (`begin_restore`), on a stream of its own, so it runs
while the trainer trains; `merge` waits for it.

Numerics: each weight is rounded to bf16 once with its adapter term (fp32 product, `addmm_`), where the fused
LoRA op rounds the LoRA term of each output instead; an adapter term smaller than half a bf16 step of a weight
leaves that weight unchanged. The trainer's logp_diff metrics show the effect in the loop.

Between `begin_restore` and the next `merge` the engine holds the bare base: `serving` is False and the pipeline
refuses to sample. A refused adapter (non-finite values) leaves the previous one merged again. Torch only.
"""
from __future__ import annotations

import threading

import torch


def plan_targets(transformer: torch.nn.Module, plan: list, table: dict) -> list[tuple]:
    """[(module, weight, first row, rows, A offset, A shape, B offset, B shape)] of a slot plan
    (`jaxflow_bridge.sync.binding.slot_plan`: one [module, layer, slot, A offset, A shape, B offset, B shape] per adapter
    module): the base weight (out, in) of its engine layer (the wrapped layer's `base_layer` where vLLM-Omni wrapped
    it) and the rows of its slice. RuntimeError naming a layer without a weight of the table's shape."""
    out = []
    for module, layer, slot, a_off, a_shape, b_off, b_shape in plan:
        fan_in, outs = table["modules"][layer]
        try:
            linear = transformer.get_submodule(layer)
        except AttributeError:
            linear = None
        weight = getattr(getattr(linear, "base_layer", linear), "weight", None)
        if weight is None or tuple(weight.shape) != (sum(outs), fan_in) or tuple(a_shape)[1] != fan_in \
                or tuple(b_shape)[0] != outs[slot]:
            raise RuntimeError(f"{module}: engine layer {layer} holds no base weight of shape {(sum(outs), fan_in)}")
        out.append((module, weight, sum(outs[:slot]), outs[slot], a_off, tuple(a_shape), b_off, tuple(b_shape)))
    return out


class MergedLoRA:
    """The merged adapter of one engine: the adapted base weights, their host copies and the adapter served.

    `merge(payload, targets, scale)` serves a new adapter (payload: the shared file's flat tensors on the weights'
    device, B unscaled as PEFT stores it; targets: `plan_targets`); `begin_restore()`
    starts putting the bare base back; `serving` says whether an adapter is merged."""

    def __init__(self):
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, pristine host copy)
        self.previous = None  # (payload, targets, scale) of the adapter merged last
        self.serving = False
        self._restore = None  # (stream, event) of a restore in flight
        self._copying = None  # (thread, errors) of the host copies a zero first adapter left to the background

    def served_slices(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
        """{module: (its merged weight, that weight's pristine host copy, its slice's first row)} of the adapter
        served now; empty while none is (the base being restored)."""
        if not self.serving:
            return {}
        if self._copying is not None:  # a zero first adapter: nothing written, each weight is its own base
            return {t[0]: (t[1], t[1], t[2]) for t in self.previous[1]}
        return {t[0]: (t[1], self.copies[id(t[1])][1], t[2]) for t in self.previous[1]}

    def _keep(self, targets: list) -> None:
        """Copy each weight not seen yet to host memory, once, while it is the pristine base."""
        self.settle()
        new = [t[0] for t in targets if id(t[1]) not in self.copies]
        if self.serving and new:
            raise RuntimeError(f"{new[0]}: a new layer to merge into while an adapter is merged")
        self._copy(targets)

    def _keep_later(self, targets: list) -> None:
        """`_copy(targets)` in a thread of its own (on a GPU on a stream of its own, its device's, after the work
        queued so far); `settle` waits for it."""
        weight = targets[0][1]
        stream = torch.cuda.Stream(weight.device) if weight.is_cuda else None  # None: `torch.cuda.stream` does nothing
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(weight.device))
        errors = []

        def run():
            try:
                with torch.cuda.stream(stream):
                    self._copy(targets)
            except Exception as exc:  # raised by `settle`
                errors.append(exc)

        thread = threading.Thread(target=run, name="merged-lora-host-copy", daemon=True)
        thread.start()
        self._copying = (thread, errors)

    def settle(self) -> None:
        """Wait for the host copies `_keep_later` started (before the weights move: an engine's sleep); their error,
        if any, raised here."""
        if self._copying is None:
            return
        thread, errors = self._copying
        thread.join()
        self._copying = None
        if errors:
            raise errors[0]

    @torch.no_grad()
    def _copy(self, targets: list) -> None:
        for t in targets:
            weight = t[1]
            if id(weight) in self.copies:
                continue
            copy = torch.empty(weight.shape, dtype=weight.dtype)
            if weight.is_cuda:  # page-locked at its exact size (torch's pinned allocator rounds up to powers of 2)
                err = int(torch.cuda.cudart().cudaHostRegister(copy.data_ptr(), copy.numel() * copy.element_size(), 0))
                if err:
                    total = sum(w.numel() * w.element_size() for w in {id(t[1]): t[1] for t in targets}.values()) / 2 ** 30
                    raise RuntimeError(f"page-locking the host copy of the merged LoRA's base weights failed (CUDA "
                                       f"error {err}; {total:.1f} GiB in all): free host memory, or set "
                                       f"--config.rollout.lora_apply=layers")
            copy.copy_(weight)
            self.copies[id(weight)] = (weight, copy)

    @torch.no_grad()
    def begin_restore(self) -> None:
        """Start writing the pristine base back into every merged weight (on a GPU asynchronously, on a stream of
        its own after the work queued so far); no adapter is served from here until `merge`."""
        self.settle()
        if not self.serving:
            return
        self.serving = False
        weights = [w for w, _ in self.copies.values()]
        if not weights or not weights[0].is_cuda:
            for weight, copy in self.copies.values():
                weight.copy_(copy)
            return
        stream = torch.cuda.Stream(weights[0].device)
        stream.wait_stream(torch.cuda.current_stream(weights[0].device))
        with torch.cuda.stream(stream):
            for weight, copy in self.copies.values():
                weight.copy_(copy, non_blocking=True)
        self._restore = (stream, stream.record_event())

    def _restored(self) -> None:
        """The bare base in place, on the current stream's timeline."""
        self.begin_restore()
        if self._restore is not None:
            stream, event = self._restore
            torch.cuda.current_stream(stream.device).wait_event(event)
            self._restore = None

    @torch.no_grad()
    def merge(self, payload: torch.Tensor, targets: list, scale: float) -> dict:
        """Serve the payload's adapter merged into the base: {"written": modules}, or {"refused": [...]} with the
        previous adapter served again (values are checked before any weight changes)."""
        views = [(t[0], t[1], t[2], t[3], payload[t[4]:t[4] + t[5][0] * t[5][1]].view(t[5]),
                  payload[t[6]:t[6] + t[7][0] * t[7][1]].view(t[7])) for t in targets]
        bad = [] if bool(torch.isfinite(payload).all()) else [  # one check (a host sync) unless a value is bad
            m for m, _, _, _, a, b in views if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all()))]
        if bad:
            if self.previous is not None and not self.serving:
                self.merge(*self.previous)
            return {"refused": [f"{m}: expected finite values" for m in bad]}
        if self.previous is None and targets and not bool(payload[min(t[6] for t in targets):].any()):
            self._keep_later(targets)  # all B tensors (they follow the A tensors) zero: base + 0 is the base
            self.previous, self.serving = (payload, targets, scale), True
            return {"written": len(targets)}
        self._keep(targets)
        self._restored()
        for _, weight, row, rows, a, b in views:
            weight[row:row + rows].addmm_(b, a, alpha=scale)
        self.previous, self.serving = (payload, targets, scale), True
        if payload.is_cuda:
            torch.cuda.synchronize(payload.device)
        return {"written": len(targets)}
