"""What the FlowGRPO train step asks of a model family (`jaxflow.trainer.train_step`; the family's `objective`): the inputs a
micro-batch's window steps share (`context`, run once per micro-batch) and one window step's log-prob (`log_prob`).
`WINDOW` reads the batch's text embeds at every step (`flowgrpo.window_log_prob`); a family whose batch carries token
ids brings its own (its folder under `jaxflow/families/`). The forward-process algorithms (DiffusionNFT, AWM) call
the model on noised final latents through `velocity`: the family's conditioning beside the text (an edit model's
reference latents) from the micro-batch."""
from __future__ import annotations

import dataclasses
from typing import Callable

from jaxflow.algorithms import flowgrpo

@dataclasses.dataclass(frozen=True)
class Objective:
    """context(model, shared, config) -> shared with what every window step reuses; log_prob(model, tr, config, **kw)
    -> (mean, logp (B,), std) of one window step (`flowgrpo.window_log_prob`'s contract; kw: lora_scale, 0 for the
    KL reference); velocity(model, step) -> the model as `flowgrpo.guided_velocity` calls it, (x, sigma, txt,
    txt_mask, *, grid_hw, lora_scale), conditioned on what `step` (a micro-batch's fields) carries beside the text."""

    context: Callable
    log_prob: Callable
    velocity: Callable = lambda model, step: model


def _window_log_prob(model, tr: dict, config, lora_scale: float = 1.0):
    """`config`: the step's TrainConfig (grid_hw, sde_type, guidance)."""
    return flowgrpo.window_log_prob(model, tr, grid_hw=config.grid_hw, sde_type=config.sde_type,
                                    guidance=config.guidance, lora_scale=lora_scale)


WINDOW = Objective(lambda model, shared, config: shared, _window_log_prob)
