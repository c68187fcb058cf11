"""jaxflow_bridge/engines/vllm_omni/fa_version.py: vLLM-Omni's FlashAttention fallback routed to FA3 where it runs, on a
stand-in of its fa module (vLLM-Omni is not installed here)."""
from types import SimpleNamespace

from jaxflow_bridge.engines.vllm_omni.fa_version import prefer_fa_version


def varlen(q, *, fa_version=2, **kw):
    """vLLM's flash_attn_varlen_func's version argument (default 2)."""
    return fa_version, q, kw


def test_fallback_runs_the_preferred_version_where_supported():
    module = SimpleNamespace(flash_attn_func=None, flash_attn_varlen_func=varlen)
    assert prefer_fa_version(module, 3, lambda v: v == 3) == 3
    assert module.flash_attn_varlen_func("q", causal=False) == (3, "q", {"causal": False})
    assert prefer_fa_version(module, 3, lambda v: v == 3) == 3  # again: no second wrapper
    assert module.flash_attn_varlen_func.func is varlen


def test_unsupported_version_or_own_package_leaves_the_module_alone():
    module = SimpleNamespace(flash_attn_func=None, flash_attn_varlen_func=varlen)
    assert prefer_fa_version(module, 3, lambda v: False) is None
    assert module.flash_attn_varlen_func is varlen and varlen("q")[0] == 2
    own = SimpleNamespace(flash_attn_func=object(), flash_attn_varlen_func=varlen)
    assert prefer_fa_version(own, 3, lambda v: True) is None and own.flash_attn_varlen_func is varlen
    assert prefer_fa_version(SimpleNamespace(flash_attn_func=None), 3, lambda v: True) is None
