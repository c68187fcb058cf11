"""A rollout transformer whose base weights are another framework's tensors, shared rather than copied.

With the engine in the trainer's process (`rollout.layout="in_process"`) the trainer can hand its frozen base
weights over as torch views (DLPack, jaxflow/sync/base_share.py): the 20B weights then sit on the device once instead of
twice. `empty_transformer` builds the diffusers transformer with parameters that hold no memory (the meta device),
`share_parameters` makes the given tensors its parameters. The engine only reads them (LoRA stays in PEFT's own
layers, never merged), and the sharing side must never write them either.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered in the body lands on the meta device (its allocation freed at once); buffers
    and other state are built as usual."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_transformer(config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """`QwenImageTransformer2DModel(**config)` in `dtype` with its parameters on the meta device (no memory) until
    `share_parameters` gives them tensors."""
    from diffusers import QwenImageTransformer2DModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with _parameters_on_meta():
            return QwenImageTransformer2DModel.from_config(config)
    finally:
        torch.set_default_dtype(previous)


def waiting_for_weights(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is still on the meta device."""
    return any(p.is_meta for p in model.parameters())


def share_parameters(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make `tensors` (parameter name -> tensor, one device) `model`'s parameters, without a copy. Every name, shape
    and dtype is checked first: on a mismatch ValueError lists the problems and nothing changes."""
    params = dict(model.named_parameters())
    problems = [f"missing {k}" for k in sorted(params.keys() - tensors.keys())]
    problems += [f"unexpected {k}" for k in sorted(tensors.keys() - params.keys())]
    for name, p in params.items():
        t = tensors.get(name)
        if t is not None and (tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype):
            problems.append(f"{name}: {t.dtype} {tuple(t.shape)}, the model has {p.dtype} {tuple(p.shape)}")
    devices = sorted({str(t.device) for t in tensors.values()})
    if len(devices) > 1:
        problems.append(f"tensors on several devices {devices}")
    if problems:
        raise ValueError(f"shared base weights do not match the transformer: {len(problems)} problem(s); first "
                         f"{min(10, len(problems))}: {problems[:10]}")
    for name in params:
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, torch.nn.Parameter(tensors[name], requires_grad=False))
