"""What every registered piece of the training algorithm declares (`jaxflow.algorithms.registry` composes one of each
role into the run's `Policy`): the config value that selects it, the per-sample batch fields it reads, the
TrainConfig fields it reads, whether it needs the old-log-prob recompute pass, and the rules it puts on the config.

Four roles, one config key each: the policy loss (`train.algorithm`: flowgrpo, nft), FlowGRPO's ratio
(`train.ratio_norm`: none, guard), the source of logp_old (`train.old_log_prob`: rollout, recompute,
rollout_corrected) and the row filter (`train.drop_zero_advantage`: False, True). Each role's hooks are
named in its Protocol below; the train step calls them and never names a component."""
from __future__ import annotations

import dataclasses
from typing import Protocol


@dataclasses.dataclass(frozen=True)
class Component:
    """name: what the component is; summary: one line for the config's list of choices; fields: the per-sample
    batch fields it reads; config_keys: the TrainConfig fields it reads; recompute: whether it needs the
    old-log-prob pass."""

    name: str
    summary: str
    fields: tuple[str, ...] = ()
    config_keys: tuple[str, ...] = ()
    recompute: bool = False

    def rules(self, config, policy) -> tuple:
        """(field, fails, why) for each rule it puts on `config` when `policy` holds it (`TrainConfig._rules`)."""
        return ()


class Loss(Protocol):
    """The policy loss. log_probs: it trains on the rollout's SDE log-probs (through the model family's
    window log-prob, `jaxflow.algorithms.objective`); keeps_old: the train state keeps an old policy that the rollout
    samples with, moved by `advanced` after each step."""

    log_probs: bool
    keeps_old: bool

    def batch_fields(self, config) -> tuple[str, ...]: ...

    def missing_hint(self, missing: list[str]) -> str: ...

    def prepare(self, out: dict, batch, config) -> dict: ...

    def update(self, state, frozen, mb: dict, old, index, *, graphdef, config, layout, objective): ...

    def passes(self, config, window: int) -> tuple[int, int]:
        """(forward-and-backward, forward-only) transformer passes a sample takes in one update, `window` the
        rollout's SDE window steps (the planner scales measured costs by them: `jaxflow.config.work`)."""
        ...


class Ratio(Protocol):
    """FlowGRPO's ratio: `normalized` gives (new, old, divisor): the clipped objective runs on exp(new - old) and
    its policy term is divided by divisor (None: not divided); `clip_range` the clip it is run with; old_means: the
    recompute pass keeps the SDE means."""

    old_means: bool

    def clip_range(self, config) -> float: ...

    def normalized(self, tr: dict, mean, logp, std, old, log_ratio, sde_type: str, stats: str = "sample"): ...


class OldLogProb(Protocol):
    """The source of logp_old: `with_old` puts it into the batch where it is the rollout's; `rejection` rollout
    correction's keep mask, log_ratio (B,) -> bool (B,) (None: no rejection); `weigh` adds the window steps' weights
    computed before the update (decoupled rollout correction); every_row: the recompute pass scores every row."""

    every_row: bool

    def with_old(self, batch: dict) -> dict: ...

    def rejection(self, config): ...

    def weigh(self, batch: dict, config) -> dict: ...


class Filter(Protocol):
    """Which rows train and what each weighs in the loss (`jaxflow.algorithms.flowgrpo_step.accumulate_gradients`):
    `active` (m, b) advantages -> (m,) the micro-batches that run, `weights` -> (m, b) each row's loss weight (they
    sum to 1 / W); compacts: the driver dealt the rows it keeps into the first micro-batches (the epochs' shuffles
    keep them so)."""

    compacts: bool

    def active(self, advantages): ...

    def weights(self, advantages, w: int): ...

    def run(self, train, grads, run): ...

    def marked(self, terms: dict, advantages) -> dict: ...

    def runs(self, terms: dict, metrics: dict): ...

    def forward(self, forward, mb: dict): ...

    def logp_rows(self, diff, advantages): ...
