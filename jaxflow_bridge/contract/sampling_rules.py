"""The rules a rollout request's sampling parameters keep, defined once: the engines check each request with them
(`SamplingLoop.validate` and each family's own loop's) and the config's validation stage checks the requests the config will
make (jaxflow/config/validation.py maps each field to its config key). Imports neither JAX nor torch."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from jaxflow_bridge.contract.schedule import SDE_TYPES, window_problem
from jaxflow_bridge.contract.solver import SOLVERS

MAX_SEQUENCE_LENGTH = 1024  # diffusers' QwenImagePipeline.tokenizer_max_length

INT_FIELDS = ("height", "width", "num_inference_steps")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def problems(params, size_multiple: int, why: str = "") -> Iterator[tuple[str, str]]:
    """(field, message) for each rule `params` breaks, in the fields' names of the sampling params
    (`SamplingParams`, `BagelSamplingParams`: any object with those attributes): ints, image sizes that are
    positive multiples of `size_multiple` (`why`: where that number comes from), the step kind and solver, noise, same_latent,
    the prompt token limit (params that have one) and the SDE window."""
    ints = {k: getattr(params, k) for k in INT_FIELDS}
    bad = [k for k, v in ints.items() if not _is_int(v)]
    if bad:
        yield bad[0], f"height, width and num_inference_steps must be ints, got {ints}"
        return
    h, w, m = params.height, params.width, size_multiple
    if min(h, w) < m or h % m or w % m:
        yield ("height" if h < m or h % m else "width",
               f"height and width must be positive multiples of {m}{f' ({why})' if why else ''}, got {h}x{w}")
    if params.sde_type not in SDE_TYPES:
        yield "sde_type", f"sde_type must be one of {SDE_TYPES}, got {params.sde_type!r}"
    solver = getattr(params, "solver", "euler")
    if solver not in SOLVERS:
        yield "solver", f"solver={solver!r}; choose one of {SOLVERS}"
    if not isinstance(params.same_latent, bool):
        yield "same_latent", f"same_latent must be a bool (True or False), got {params.same_latent!r}"
    if params.noise_level < 0:
        yield "noise_level", f"noise_level must be >= 0, got {params.noise_level}"
    length = getattr(params, "max_sequence_length", None)
    if length is not None and not 1 <= length <= MAX_SEQUENCE_LENGTH:
        yield "max_sequence_length", f"max_sequence_length must be in [1, {MAX_SEQUENCE_LENGTH}], got {length}"
    window = window_problem(params.sde_window_size, params.sde_window_range, params.num_inference_steps)
    if window:
        yield "sde_window_size", window


def check(params, size_multiple: int, why: str = "") -> None:
    """ValueError with the first of `problems` (an engine's check of a request, before any model runs)."""
    for _, message in problems(params, size_multiple, why):
        raise ValueError(message)
