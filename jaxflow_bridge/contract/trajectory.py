"""The Trajectory contract between the rollout and the trainer (docs/numerics.md §9).

Numpy only: importing this module pulls in neither JAX nor torch. A `TrajectoryBatch` holds samples on a
leading axis, the text right-padded (embeds with zeros, masks with False) to the longest prompt in the batch.
It validates shapes and dtypes on construction and raises ValueError naming the field, the expected and the
actual value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import ml_dtypes
import numpy as np

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
EMBED_DTYPES = (BF16, F32)
_INT32 = np.dtype(np.int32)
_INT64 = np.dtype(np.int64)
_UINT8 = np.dtype(np.uint8)
_BOOL = np.dtype(np.bool_)

Dims = list[tuple[str, "int | None"]]  # (symbol, required size or None for any)


def _check(field: str, x, dtypes: Sequence[np.dtype], dims: Dims) -> None:
    """Raise ValueError unless `x` is an ndarray of one of `dtypes` with the shape `dims` describes."""
    if not isinstance(x, np.ndarray):
        raise ValueError(f"{field}: expected a numpy array, got {type(x).__name__}")
    if x.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{field}: expected dtype {want}, got dtype {x.dtype}")
    sizes = [size for _, size in dims]
    if x.ndim != len(dims) or any(s is not None and s != a for s, a in zip(sizes, x.shape)):
        symbols = ", ".join(sym for sym, _ in dims)
        want = ", ".join("*" if s is None else str(s) for s in sizes)
        raise ValueError(f"{field}: expected shape ({symbols}) = ({want}), got shape {x.shape}")


def _check_sigmas(sigmas) -> int:
    """Validate the (N+1,) schedule and return N."""
    _check("sigmas", sigmas, (F32,), [("N+1", None)])
    if len(sigmas) < 2 or not np.all(np.diff(sigmas) < 0) or sigmas[-1] != 0:
        raise ValueError(
            "sigmas: expected N+1 >= 2 strictly decreasing values ending in 0, "
            f"got {sigmas.tolist()}")
    return len(sigmas) - 1


def _check_seq_len(seq: int, height: int, width: int) -> None:
    """S must be (H/p)(W/p) for an integer patch p dividing H and W (p = 2 x the VAE factor, 16 for Qwen-Image)."""
    patch = math.isqrt(height * width // seq) if seq > 0 and (height * width) % seq == 0 else 0
    if patch == 0 or patch * patch * seq != height * width or height % patch or width % patch:
        raise ValueError(
            f"latents: expected S = (H/p)(W/p) for an integer patch size p dividing H={height} and W={width}, "
            f"got S={seq}")


def _check_text(prefix: str, embeds, mask, lead: Dims, dtypes, width) -> None:
    _check(f"{prefix}_embeds", embeds, dtypes, lead + [("L", None), ("D", width)])
    _check(f"{prefix}_mask", mask, (_BOOL,), lead + [("L", embeds.shape[-2])])


def validate_arrays(rec, image_field: str, lead: Dims) -> None:
    """Validate the array fields of a TrajectoryBatch (lead=[("B", b)]) or of one sample (lead=[])."""
    image = getattr(rec, image_field)
    _check(image_field, image, (_UINT8,), lead + [("H", None), ("W", None), ("3", 3)])
    height, width = image.shape[-3:-1]
    n = _check_sigmas(rec.sigmas)
    _check("log_probs", rec.log_probs, (F32,), lead + [("W", None)])
    window = rec.log_probs.shape[-1]
    if window < 1:
        raise ValueError(f"log_probs: expected a window of W >= 1 steps, got shape {rec.log_probs.shape}")
    _check("step_index", rec.step_index, (_INT32,), lead + [("W", window)])
    _check("latents", rec.latents, (F32,), lead + [("W+1", window + 1), ("S", None), ("C", None)])
    _check_seq_len(rec.latents.shape[-2], height, width)
    steps = rec.step_index
    if np.any(steps < 0) or np.any(steps >= n - 1) or np.any(np.diff(steps, axis=-1) != 1):
        raise ValueError(
            f"step_index: expected contiguous increasing steps within [0, N-1) = [0, {n - 1}), "
            f"got {steps.tolist()}")
    final = getattr(rec, "final_latents", None)
    if final is not None:
        _check("final_latents", final, (F32,), lead + [("S", rec.latents.shape[-2]), ("C", rec.latents.shape[-1])])
    _check_text("prompt", rec.prompt_embeds, rec.prompt_mask, lead, EMBED_DTYPES, None)
    neg = (rec.negative_prompt_embeds, rec.negative_prompt_mask)
    if (neg[0] is None) != (neg[1] is None):
        given = "negative_prompt_embeds" if neg[1] is None else "negative_prompt_mask"
        raise ValueError(
            "negative_prompt_embeds/negative_prompt_mask: expected both (true CFG) or neither, "
            f"got only {given}")
    if neg[0] is not None:
        embeds = rec.prompt_embeds
        _check_text("negative_prompt", *neg, lead, (embeds.dtype,), embeds.shape[-1])


class TextLengthError(ValueError):
    """A batch's text is longer than the length `TrajectoryBatch.concat` pads it to."""

    def __init__(self, field: str, tokens: int, length: int):
        super().__init__(f"{field} has {tokens} tokens > {length}, the length the batch pads it to")
        self.field, self.tokens, self.length = field, tokens, length


def _pad_concat(field: str, embeds: list[np.ndarray], masks: list[np.ndarray], length: int | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (b_i, L_i, D) embeds and (b_i, L_i) masks, right-padding L with zeros / False to `length`
    (default: the longest L_i) in one copy; TextLengthError if an L_i is longer."""
    longest = max(e.shape[1] for e in embeds)
    if length is None:
        length = longest
    elif longest > length:
        raise TextLengthError(field, longest, length)
    out = np.zeros((sum(len(e) for e in embeds), length, embeds[0].shape[2]), embeds[0].dtype)
    out_mask = np.zeros(out.shape[:2], masks[0].dtype)
    row = 0
    for e, m in zip(embeds, masks):
        out[row:row + len(e), :e.shape[1]], out_mask[row:row + len(e), :e.shape[1]] = e, m
        row += len(e)
    return out, out_mask


def _concat_key(batch: TrajectoryBatch) -> dict:
    """What every batch joined by concat must share, keyed by the field that reports a mismatch."""
    return {
        "images": batch.images.shape[1:],
        "latents": batch.latents.shape[1:],
        "sigmas": tuple(batch.sigmas.tolist()),
        "prompt_embeds": (batch.prompt_embeds.dtype, batch.prompt_embeds.shape[-1]),
        "negative_prompt_embeds": "present" if batch.guided else "absent",
        "final_latents": "absent" if batch.final_latents is None else "present",
    }


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TrajectoryBatch:
    """Trajectories stacked on a leading batch axis B; text right-padded (to the longest prompt, or as `concat`
    was asked).

    images (B, H, W, 3); latents (B, W+1, S, C); log_probs (B, W); sigmas (N+1,) shared by all samples;
    step_index (B, W) (windows may differ per sample); prompt_embeds (B, L, D) / prompt_mask (B, L);
    negative_* (B, L', D) / (B, L') or None; prompts (B strings);
    group_ids, seeds, policy_versions (B,) int64; final_latents (B, S, C), the samples' last latents (sigma 0),
    or None (SamplingParams.keep_final; DiffusionNFT trains on them).
    """

    images: np.ndarray
    latents: np.ndarray
    log_probs: np.ndarray
    sigmas: np.ndarray
    step_index: np.ndarray
    prompt_embeds: np.ndarray
    prompt_mask: np.ndarray
    negative_prompt_embeds: np.ndarray | None = None
    negative_prompt_mask: np.ndarray | None = None
    prompts: tuple[str, ...]
    group_ids: np.ndarray
    seeds: np.ndarray
    policy_versions: np.ndarray
    final_latents: np.ndarray | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if not all(isinstance(p, str) for p in self.prompts):
            raise ValueError("prompts: expected a sequence of str")
        lead = [("B", len(self.prompts))]
        validate_arrays(self, "images", lead)
        for field in ("group_ids", "seeds", "policy_versions"):
            _check(field, getattr(self, field), (_INT64,), lead)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def guided(self) -> bool:
        """True when the batch carries negative prompt embeds (true CFG)."""
        return self.negative_prompt_embeds is not None

    @property
    def policy_version(self) -> int:
        """The single policy version that produced every sample; ValueError if the batch mixes versions."""
        versions = np.unique(self.policy_versions)
        if len(versions) != 1:
            raise ValueError(f"policy_versions: expected one version, got {versions.tolist()}")
        return int(versions[0])

    @classmethod
    def concat(cls, batches: Sequence[TrajectoryBatch], text_tokens: tuple[int, int] | None = None
               ) -> TrajectoryBatch:
        """Join batches along B, padding text to the longest prompt among them, or to `text_tokens` (prompt,
        negative prompt tokens: one text shape for every batch; TextLengthError if a text is longer)."""
        if not batches:
            raise ValueError("concat: expected at least one batch, got none")
        first = _concat_key(batches[0])
        for i, batch in enumerate(batches[1:], 1):
            for field, value in _concat_key(batch).items():
                if value != first[field]:
                    raise ValueError(f"{field}: item {i} has {value}, item 0 has {first[field]}")

        def cat(field):
            return np.concatenate([getattr(b, field) for b in batches])

        def pad(prefix, length):
            if not batches[0].guided and prefix == "negative_prompt":
                return None, None
            return _pad_concat(f"{prefix}_embeds", [getattr(b, f"{prefix}_embeds") for b in batches],
                               [getattr(b, f"{prefix}_mask") for b in batches], length)

        lengths = (None, None) if text_tokens is None else text_tokens
        embeds, mask = pad("prompt", lengths[0])
        neg_embeds, neg_mask = pad("negative_prompt", lengths[1])
        return cls(
            images=cat("images"), latents=cat("latents"), log_probs=cat("log_probs"),
            sigmas=batches[0].sigmas, step_index=cat("step_index"), prompt_embeds=embeds,
            prompt_mask=mask, negative_prompt_embeds=neg_embeds, negative_prompt_mask=neg_mask,
            prompts=[p for b in batches for p in b.prompts], group_ids=cat("group_ids"),
            seeds=cat("seeds"), policy_versions=cat("policy_versions"),
            final_latents=None if batches[0].final_latents is None else cat("final_latents"))

    def to_dict(self) -> dict[str, np.ndarray]:
        """Plain numpy arrays (prompts as a str array; absent negatives omitted), for Ray or checkpoints."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["prompts"] = np.asarray(self.prompts, dtype=np.str_)
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, arrays: dict[str, np.ndarray]) -> TrajectoryBatch:
        """Inverse of to_dict."""
        return cls(**{**arrays, "prompts": [str(p) for p in arrays["prompts"]]})
