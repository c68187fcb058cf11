"""What the FlowGRPO train step asks of a model kind (`jaxflow.train_step`), chosen once from the model by `for_model`:
the inputs a micro-batch's window steps share (`context`, run once per micro-batch) and one window step's log-prob
(`log_prob`). Qwen-Image reads its text embeds at every step (`jaxflow.algorithms.flowgrpo`); BAGEL prefills its two
contexts from the token ids once and reuses their K/V at every window step (`jaxflow.families.bagel.objective`, docs/bagel.md
§4)."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from jaxflow.families.bagel import objective as bagel_flowgrpo
from jaxflow.algorithms import flowgrpo
from jaxflow.families.bagel.model import BagelModel

if TYPE_CHECKING:  # step_config resolves the algorithms, which reach this module
    from jaxflow.step_config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Objective:
    """context(model, shared, config) -> shared with what every window step reuses; log_prob(model, tr, config, **kw)
    -> (mean, logp (B,), std) of one window step (`flowgrpo.window_log_prob`'s contract; kw: lora_scale, 0 for the
    KL reference)."""

    context: Callable
    log_prob: Callable


def _qwen_image_log_prob(model, tr: dict, config: TrainConfig, lora_scale: float = 1.0):
    return flowgrpo.window_log_prob(model, tr, grid_hw=config.grid_hw, sde_type=config.sde_type,
                                    guidance=config.guidance, lora_scale=lora_scale)


def bagel_guidance(config: TrainConfig) -> bagel_flowgrpo.BagelGuidance:
    """BAGEL's text CFG from the config: scale `guidance`, `cfg_interval`, `cfg_renorm_min`."""
    return bagel_flowgrpo.BagelGuidance(config.guidance, config.cfg_interval, config.cfg_renorm_min)


def _bagel_context(model, shared: dict, config: TrainConfig) -> dict:
    return {**shared, "contexts": bagel_flowgrpo.contexts(model, shared, bagel_guidance(config))}


def _bagel_log_prob(model, tr: dict, config: TrainConfig, lora_scale: float = 1.0):
    return bagel_flowgrpo.window_log_prob(model, tr, *tr["contexts"], grid_hw=config.grid_hw,
                                          sde_type=config.sde_type, guidance=bagel_guidance(config),
                                          lora_scale=lora_scale)


QWEN_IMAGE = Objective(lambda model, shared, config: shared, _qwen_image_log_prob)
BAGEL = Objective(_bagel_context, _bagel_log_prob)


def for_model(model, config: TrainConfig) -> Objective:
    """The model kind's objective; BAGEL refuses what it cannot train yet: DiffusionNFT. (Both kinds' KL reference
    is the model with its adapters off, lora_scale 0; BAGEL's contexts need none: the adapters are on the
    generation expert only.)"""
    if not isinstance(model, BagelModel):
        return QWEN_IMAGE
    if not config.policy.loss.log_probs:
        raise ValueError(f"train.algorithm={config.algorithm!r}: BAGEL trains with 'flowgrpo' only")
    return BAGEL
