"""Which FlashAttention vLLM-Omni's diffusion attention runs: FA3 on Hopper where it would fall back to FA2.

vLLM-Omni 0.20's FLASH_ATTN diffusion backend (vllm_omni/diffusion/attention/backends/utils/fa.py) looks for a
FlashAttention package (fa3-fwd, a flash-attention build, flash-attn); where none is installed, as on a machine
with vLLM's wheel alone, it calls `vllm.vllm_flash_attn.flash_attn_varlen_func` without `fa_version`, whose default
is 2, although the same wheel ships FA3 kernels for Hopper and vLLM's own attention picks them there.
`prefer_fa_version(module, 3, supported)` makes that fallback pass fa_version=3 where `supported(3)` says FA3 runs;
it never touches a module that found a package of its own (`flash_attn_func` set).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

FA_VERSIONS = ("auto", "2")  # engine option `fa_version`: FA3 where it runs, else vLLM-Omni's choice; or as it is


def prefer_fa_version(module, version: int, supported: Callable[[int], bool]) -> int | None:
    """Route `module.flash_attn_varlen_func` (vLLM's, fa_version defaulting to 2) to `version` where `module`
    has no FlashAttention package of its own and `supported(version)`; returns the version it now runs (None: the
    module's own choice, untouched). Calling it again changes nothing."""
    varlen = getattr(module, "flash_attn_varlen_func", None)
    if getattr(module, "flash_attn_func", None) is not None or varlen is None:
        return None
    if getattr(varlen, "fa_version", None) is not None:
        return varlen.fa_version
    if not supported(version):
        return None
    routed = functools.wraps(varlen)(functools.partial(varlen, fa_version=version))
    routed.fa_version = version
    module.flash_attn_varlen_func = routed
    return version


def use_fa3() -> int | None:
    """`prefer_fa_version` on vLLM-Omni 0.20's fa module with vLLM's own support check (needs both installed)."""
    from vllm.vllm_flash_attn import is_fa_version_supported
    from vllm_omni.diffusion.attention.backends.utils import fa

    return prefer_fa_version(fa, 3, is_fa_version_supported)
