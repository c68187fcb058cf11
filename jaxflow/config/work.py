"""The transformer passes a config's step runs per image: what the planner scales the costs measured on one config
(`jaxflow/config/phase_costs.json`, each row with its own) by, to predict another algorithm's or setting's step.

A rollout image takes sample.num_steps denoising forwards, two each with true CFG; an update trains the passes its
policy loss names (`Loss.passes`: FlowGRPO's window steps, DiffusionNFT's and AWM's noised timesteps, with or without
CFG, plus forward-only passes of an old or adapters-off policy) once per inner epoch; the old-log-prob pass runs the
window's guided forwards over the rows it scores. Not counted: CFG left out of some steps by sample.cfg_interval, and
rows the zero-advantage filter drops (data-dependent)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Work:
    """Transformer passes per image of one step."""

    rollout: float  # denoising forwards
    train: float  # forward-and-backward passes of the updates
    forward: float  # forward-only passes inside the updates (an old or adapters-off policy's velocity)
    recompute: float  # forwards of the old-log-prob pass, averaged over the step's rows


def work_of(cfg) -> Work:
    """The passes of `cfg` (a validated RunConfig or its ConfigDict), read off the train step's own config."""
    from jaxflow.config import derived  # the train step's config: imports its algorithms (JAX), never a device
    tc = derived.train_config(cfg, grid_hw=(1, 1), num_micro_batches=1)  # neither changes a pass count
    s, guided = cfg.sample, 2 if tc.guided else 1
    train, forward = tc.policy.loss.passes(tc, s.window_size)
    rows = (tc.num_mini_batches - 1) / tc.num_mini_batches if tc.pass_skips_first else 1.0
    return Work(rollout=s.num_steps * guided, train=train * tc.num_inner_epochs,
                forward=forward * tc.num_inner_epochs,
                recompute=s.window_size * guided * rows if tc.recompute_pass else 0.0)


def scaled_costs(costs: dict, work: Work, forward_share: float) -> dict:
    """`costs` (a phase_costs row, measured on its config's `costs["work"]`) per image for `work`: the rollout in
    proportion to its forwards; the update and the old-log-prob pass from one forward-and-backward pass's cost, a
    forward-only pass costing `forward_share` of it (the table's, from a row that measured both)."""
    measured = Work(**costs["work"])
    train = costs["update_s_per_image"] / (measured.train + forward_share * measured.forward)
    return {**costs, "rollout_s_per_image": costs["rollout_s_per_image"] * work.rollout / measured.rollout,
            "update_s_per_image": train * (work.train + forward_share * work.forward),
            "old_log_prob_s_per_image": train * forward_share * work.recompute}
