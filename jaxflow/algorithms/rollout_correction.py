"""Rollout correction (train.old_log_prob="rollout_corrected"; verl's rollout-correction bypass mode with rejection):
logp_old is the rollout's, and a sample's window step is rejected (no gradient, not counted) where
exp(logp - logp_rollout) leaves [1/t, t], t = train.rejection_threshold (`flowgrpo.window_step_terms`' `keep`)."""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxflow.algorithms.old_log_prob import Source


@dataclasses.dataclass(frozen=True)
class Corrected(Source):
    def reject_log_ratio(self, config) -> float:
        return float(np.log(config.rejection_threshold))


ROLLOUT_CORRECTED = Corrected("rollout_corrected", "the engine's, rejecting samples beyond rejection_threshold",
                              fields=("log_probs",), config_keys=("old_log_prob", "rejection_threshold"))
