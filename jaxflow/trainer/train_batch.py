"""The learner's batch: one step's trajectories with their advantages and SDE noise level, host arrays on a leading
sample axis B. The driver makes it once from the rollout's `TrajectoryBatch` (`TrainBatch.of`), the mini-batch layout
(`jaxflow.trainer.minibatches`) reorders its rows (`TrainBatch.reordered`) and `train_step.prepare_batch` reads it. Its fields,
which are per sample and which the batch shares, are the schema's (`jaxflow_bridge.contract.batch.TRAIN_FIELDS`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from jaxflow_bridge.contract.batch import SHARED_FIELDS, TEXT_IDS
from jaxflow_bridge.contract.trajectory import TrajectoryBatch


def with_text_ids(fields: tuple[str, ...]) -> tuple[str, ...]:
    """`fields` with the text embeds replaced by the token ids (`TEXT_IDS`)."""
    return tuple(TEXT_IDS.get(f, f) for f in fields)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TrainBatch:
    """advantages (B,) float32, the rows' count; the Trajectory fields the step reads (docs/numerics.md §9):
    latents (B, W+1, S, C), log_probs (B, W), step_index (B, W), the text (prompt_embeds (B, L, D) or a token-id
    family's prompt_ids (B, L), prompt_mask (B, L), their negatives for true CFG), final_latents (B, S, C) for
    DiffusionNFT, reference_latents (B, R, S, C) for an edit model (`CONDITION_FIELDS`); sigmas (N+1,) and noise_level (scalar) shared (`SHARED_FIELDS`). A field the rollout did not send is
    None; which ones a step needs is its config's (`train_step.prepare_batch`). ValueError, naming the field, for one
    without B rows."""

    advantages: np.ndarray
    latents: np.ndarray | None = None
    log_probs: np.ndarray | None = None
    step_index: np.ndarray | None = None
    sigmas: np.ndarray | None = None
    noise_level: np.ndarray | None = None
    prompt_embeds: np.ndarray | None = None
    prompt_ids: np.ndarray | None = None
    prompt_mask: np.ndarray | None = None
    negative_prompt_embeds: np.ndarray | None = None
    negative_prompt_ids: np.ndarray | None = None
    negative_prompt_mask: np.ndarray | None = None
    final_latents: np.ndarray | None = None
    reference_latents: np.ndarray | None = None

    def __post_init__(self):
        for name, value in self.arrays().items():
            object.__setattr__(self, name, np.asarray(value))
        b = np.shape(self.advantages)[:1]
        if len(b) == 0:
            raise ValueError(f"advantages: expected shape (B,), got shape {np.shape(self.advantages)}")
        for name, value in self.arrays().items():
            if (name in SHARED_FIELDS and value.ndim == SHARED_FIELDS[name]) or value.shape[:1] == b:
                continue
            shared = f" or {SHARED_FIELDS[name]} dims (shared)" if name in SHARED_FIELDS else ""
            raise ValueError(f"{name}: expected a leading sample axis of B={b[0]} (advantages'){shared}, "
                             f"got shape {value.shape}")

    @classmethod
    def of(cls, trajectory: TrajectoryBatch, advantages, noise_level: float) -> TrainBatch:
        """The rollout's `trajectory` with its `advantages` (B,) and the SDE's `noise_level`; the fields the learner
        does not read (images, prompts, ids, seeds, versions) are left out."""
        names = {f.name for f in dataclasses.fields(cls)} - {"advantages", "noise_level"}
        return cls(advantages=advantages, noise_level=np.float32(noise_level),
                   **{k: getattr(trajectory, k) for k in names})

    def __len__(self) -> int:
        return len(self.advantages)

    def arrays(self) -> dict[str, np.ndarray]:
        """The fields that are set, as they are held."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    def _per_row(self, name: str, value) -> bool:
        return value.ndim > SHARED_FIELDS.get(name, 0)

    def reordered(self, order: np.ndarray) -> TrainBatch:
        """The batch with every per-sample field's rows taken in `order` (B,); the shared ones kept as they are."""
        return dataclasses.replace(self, **{k: v[order] for k, v in self.arrays().items() if self._per_row(k, v)})

    def per_sample(self, fields: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
        """The set `fields` (default: all) with a leading sample axis: the shared ones broadcast to every sample."""
        arrays = self.arrays()
        out = {k: arrays[k] for k in (arrays if fields is None else dict.fromkeys(fields)) if k in arrays}
        return {k: v if self._per_row(k, v) else np.broadcast_to(v, (len(self), *v.shape)) for k, v in out.items()}
