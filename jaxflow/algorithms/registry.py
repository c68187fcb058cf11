"""The registry: each algorithm config key's choices (`TABLES`: the TrainConfig field -> {value: component}) and the
run's `Policy`, one component per role resolved from the config (`resolve`). The train step calls the policy's
components and never names one."""
from __future__ import annotations

from typing import NamedTuple

from jaxflow.algorithms import awm, flowgrpo, mixgrpo, nft, old_log_prob, rollout_correction, zero_advantage
from jaxflow.algorithms.base import Filter, Loss, OldLogProb, Ratio
from jaxflow.algorithms.flowgrpo_step import FLOWGRPO

TABLES = {
    "algorithm": {c.name: c for c in (FLOWGRPO, nft.NFT, mixgrpo.MIXGRPO, awm.AWM)},
    "ratio_norm": flowgrpo.RATIOS,
    "old_log_prob": {c.name: c for c in (old_log_prob.ROLLOUT, old_log_prob.RECOMPUTE,
                                         rollout_correction.ROLLOUT_CORRECTED,
                                         rollout_correction.RECOMPUTE_CORRECTED)},
    "drop_zero_advantage": {False: zero_advantage.KEEP_ALL, True: zero_advantage.DROP_ZERO},
}


class Policy(NamedTuple):
    """One component per role, in `TABLES`' order."""

    loss: Loss
    ratio: Ratio
    old_log_prob: OldLogProb
    filter: Filter

    @property
    def recompute(self) -> bool:
        """Whether the step needs the old-log-prob pass: a component asks for it and the loss reads log-probs."""
        return self.loss.log_probs and any(c.recompute for c in self)

    def rules(self, config) -> tuple:
        """Every component's rules on `config`, in role order."""
        return tuple(rule for c in self for rule in c.rules(config, self))


def choice_rules(config) -> tuple:
    """(field, fails, why) for each algorithm key: its value must be one of its table's."""
    rules = []
    for key, table in TABLES.items():
        named = [f"{v!r} ({c.summary})" for v, c in table.items()]
        choices = ", ".join(named[:-1]) + f" or {named[-1]}"
        rules.append((key, _value(config, key) not in table, f"choose {choices}"))
    return tuple(rules)


def _value(config, key):
    value = getattr(config, key)
    try:
        hash(value)
    except TypeError:
        return None
    return value


def final_latents(algorithm: str) -> bool:
    """Whether the rollout keeps the final latents for train.algorithm `algorithm` (a loss without log-probs trains
    on them)."""
    loss = TABLES["algorithm"].get(algorithm)
    return loss is not None and not loss.log_probs


def dpm2_after_window(algorithm: str) -> bool:
    """Whether train.algorithm `algorithm` samples with sample.solver 'dpm2' and an SDE (sde_type 'sde' or 'cps'):
    the window's SDE steps, DPM-Solver++(2M) after them (MixGRPO-Flash; docs/numerics.md §12)."""
    return getattr(TABLES["algorithm"].get(algorithm), "dpm2_after_window", False)


def rollout_sampling(params: dict, cfg, step: int) -> dict:
    """The rollout's sampling params for training step `step`, as train.algorithm's loss schedules them (MixGRPO's
    sliding window; the others leave them as they are)."""
    loss = TABLES["algorithm"].get(cfg.train.algorithm)
    schedule = getattr(loss, "rollout_sampling", None)
    return params if schedule is None else schedule(params, cfg, step)


def resolve(config) -> Policy:
    """The config's policy (its values checked by `choice_rules` first)."""
    return Policy(*(table[getattr(config, key)] for key, table in TABLES.items()))
