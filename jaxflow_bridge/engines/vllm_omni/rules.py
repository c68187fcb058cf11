"""The vllm_omni engine's rules on a run's settings, in one copy for both sides and in the config's terms: the
validation stage (`jaxflow/config/validation.py`) checks the user's config with them before Ray or torch start, and
`VllmOmniEngine` checks the engine config it is handed with the same functions (`settings` reads it in the config's
terms). A problem is (config key, message naming the fix). Plain Python: imports neither torch nor jax."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from jaxflow_bridge.engines import families

Problem = tuple[str, str]
DTYPE = "bfloat16"  # vLLM-Omni 0.20's warm-up fails on float32 folders
DEVICE = "cuda"  # the GPU Ray gives the engine's actor
# the DiT's linears: bf16 as the trainer's, or "fp8": vLLM-Omni 0.20's `quantization="fp8"` (vLLM's Fp8Config, online:
# the bf16 weights quantized at load to float8_e4m3fn with a scale per tensor, activations quantized per call); the
# modulation, timestep and time-embedding linears, the text encoder and the VAE stay bf16
QUANTIZATIONS = ("none", "fp8")


def problems(family: str, *, dtype: str, device: str | None, init: str, deploy: str | None,
             think: bool = False) -> Iterator[Problem]:
    """What the vllm_omni engine refuses for model family `family`: `engine_problems`, then `family_problems`."""
    yield from engine_problems(dtype, device, family)
    yield from family_problems(family, init=init, deploy=deploy, think=think)


def engine_problems(dtype: str, device: str | None, family: str | None = None) -> Iterator[Problem]:
    """The engine's dtype and device, for `family` (None: any family, before the engine knows its model's)."""
    specs = [families.spec(name) for name in ([family] if family else families.FAMILIES)]
    label = specs[0].LABEL if family else "every model"
    if dtype != DTYPE:
        other = " or ".join(dict.fromkeys(repr(e) for s in specs for e in s.ENGINES if e != "vllm_omni"))
        yield "rollout.dtype", (f"{dtype!r}: {label} runs with 'bfloat16' on the vllm_omni engine (vLLM-Omni 0.20 "
                                f"runs bfloat16 only: its warm-up fails on float32 folders); use rollout.engine={other} "
                                f"for {dtype}")
    if device not in (None, DEVICE):
        yield "rollout.device", (f"{device!r}: {label} runs with 'cuda' on the vllm_omni engine (the actor's CUDA "
                                 f"GPU, which Ray gives it)")


def family_problems(family: str, *, init: str, deploy: str | None,
                    think: bool = False) -> Iterator[Problem]:
    """The family's own rules (its spec's `vllm_omni_problems`): `init` is model.init, `deploy` the engine's deployment (None: the family's default)."""
    yield from families.spec(family).vllm_omni_problems(init=init, deploy=deploy, think=think)


def quantization_problems(quantization: str, lora_apply: str) -> Iterator[Problem]:
    """`quantization` (rollout.quantization) with the LoRA apply mode `lora_apply` (the engines' resolved one)."""
    if quantization not in QUANTIZATIONS:
        yield "rollout.quantization", f"{quantization!r}; choose one of {QUANTIZATIONS}"
    elif quantization != "none" and lora_apply == "merged":
        yield "rollout.lora_apply", (f"'merged' with rollout.quantization={quantization!r}: the merge adds the adapter "
                                     f"to bf16 base weights, and vLLM-Omni 0.20's FP8 linears hold float8 weights "
                                     f"quantized once at load (one scale per tensor), which take no merge; use "
                                     f"rollout.lora_apply='layers' (or 'auto')")


def settings(config: dict) -> dict:
    """The engine config's settings in `family_problems`' terms (random_seed: model.init='random')."""
    return dict(init="checkpoint" if config.get("random_seed") is None else "random", deploy=config.get("deploy"))


def refuse(found: Iterable[Problem]) -> None:
    """The engine side: the first problem as a one-line ValueError, "vllm_omni engine: KEY=VALUE: ..."."""
    for key, message in found:
        raise ValueError(f"vllm_omni engine: {key}={message}")
