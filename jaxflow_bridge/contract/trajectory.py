"""The Trajectory contract between the rollout and the trainer (docs/numerics.md §9).

Numpy only: importing this module pulls in neither JAX nor torch. A `TrajectoryBatch` holds samples on a
leading axis, the text right-padded (embeds or token ids with zeros, masks with False) to one length: the request's
longest prompt, or the train step's `text_tokens` where its producer pads it (`TrajectoryBatch.padded`), once, so that
`concat` joins batches of one text length and never pads. The text is either text-encoder embeds or the
context's token ids (a family whose model prefills its context), never both. Its fields are the schema's (`jaxflow_bridge.contract.batch`). It validates
shapes and dtypes on construction and raises ValueError naming the field, the expected and the actual value; that runs
once where a trajectory crosses into a process (`from_dict`, the vLLM-Omni codec): a producer's own arrays and
`concat`'s join of validated batches are `assembled`, not checked again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxflow_bridge.contract.batch import FIELDS, TEXT_FIELDS, dim_size, require

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


def _check_field(name: str, x, lead: Dims, sizes: dict | None = None, dtypes: Sequence[np.dtype] | None = None,
                 label: str | None = None) -> None:
    """`_check` of `x` against the schema's field `name`: its dtypes (or `dtypes`), `lead` then its dims, each sized
    from `sizes` where they give it (else any); reported as `label` (default `name`)."""
    field = FIELDS[name]
    _check(label or name, x, dtypes or field.dtypes, lead + [(d, dim_size(d, sizes or {})) for d in field.dims])


def _check_sigmas(sigmas) -> int:
    """Validate the (N+1,) schedule and return N."""
    _check_field("sigmas", sigmas, [])
    if len(sigmas) < 2 or not np.all(np.diff(sigmas) < 0) or sigmas[-1] != 0:
        raise ValueError(
            "sigmas: expected N+1 >= 2 strictly decreasing values ending in 0, "
            f"got {sigmas.tolist()}")
    return len(sigmas) - 1


def _check_seq_len(seq: int, height: int, width: int) -> None:
    """S must be (H/p)(W/p) for an integer patch p dividing H and W (p = 2 x the VAE factor, 16 for the released
    VAEs)."""
    patch = math.isqrt(height * width // seq) if seq > 0 and (height * width) % seq == 0 else 0
    if patch == 0 or patch * patch * seq != height * width or height % patch or width % patch:
        raise ValueError(
            f"latents: expected S = (H/p)(W/p) for an integer patch size p dividing H={height} and W={width}, "
            f"got S={seq}")


# a negative's text is checked against its prompt's field: the same dims and dtypes, its own length (L)
def _check_text(prefix: str, embeds, mask, lead: Dims, dtypes, width) -> None:
    _check_field("prompt_embeds", embeds, lead, {"D": width}, dtypes, label=f"{prefix}_embeds")
    _check_field("prompt_mask", mask, lead, {"L": embeds.shape[-2]}, label=f"{prefix}_mask")


def _check_ids(prefix: str, ids, mask, lead: Dims) -> None:
    _check_field("prompt_ids", ids, lead, label=f"{prefix}_ids")
    _check_field("prompt_mask", mask, lead, {"L": ids.shape[-1]}, label=f"{prefix}_mask")
    if ids.size and ids.min() < 0:
        raise ValueError(f"{prefix}_ids: expected token ids >= 0, got {ids.min()}")


def text_kind(rec) -> str:
    """"ids" if `rec` carries the context's token ids, "embeds" if text-encoder embeds;
    ValueError if both or neither."""
    embeds, ids = getattr(rec, "prompt_embeds", None), getattr(rec, "prompt_ids", None)
    if (embeds is None) == (ids is None):
        raise ValueError(f"prompt_embeds/prompt_ids: expected exactly one (text embeds or context token ids), "
                         f"got {'both' if ids is not None else 'neither'}")
    return "embeds" if ids is None else "ids"


def _check_all_text(rec, lead: Dims) -> None:
    kind = text_kind(rec)
    other = "ids" if kind == "embeds" else "embeds"
    if getattr(rec, f"negative_prompt_{other}", None) is not None:
        raise ValueError(f"negative_prompt_{other}: expected negative_prompt_{kind} with prompt_{kind} "
                         f"(one text kind per batch)")
    if kind == "ids":
        _check_ids("prompt", rec.prompt_ids, rec.prompt_mask, lead)
    else:
        _check_text("prompt", rec.prompt_embeds, rec.prompt_mask, lead, None, None)
    neg = (getattr(rec, f"negative_prompt_{kind}", None), rec.negative_prompt_mask)
    if (neg[0] is None) != (neg[1] is None):
        given = f"negative_prompt_{kind}" if neg[1] is None else "negative_prompt_mask"
        raise ValueError(
            f"negative_prompt_{kind}/negative_prompt_mask: expected both (true CFG) or neither, got only {given}")
    if neg[0] is None:
        return
    if kind == "ids":
        _check_ids("negative_prompt", *neg, lead)
    else:
        embeds = rec.prompt_embeds
        _check_text("negative_prompt", *neg, lead, (embeds.dtype,), embeds.shape[-1])


def validate_arrays(rec, image_field: str, lead: Dims) -> None:
    """Validate the array fields of a TrajectoryBatch (lead=[("B", b)]) or of one sample (lead=[]): each field's
    dtype and dims the schema's (`batch.FIELDS`), the sizes they share equal, and the checks of their values."""
    image = getattr(rec, image_field)
    _check_field("images", image, lead, label=image_field)
    height, width = image.shape[-3:-1]
    n = _check_sigmas(rec.sigmas)
    _check_field("log_probs", rec.log_probs, lead)
    window = rec.log_probs.shape[-1]
    if window < 1:
        raise ValueError(f"log_probs: expected a window of W >= 1 steps, got shape {rec.log_probs.shape}")
    _check_field("step_index", rec.step_index, lead, {"W": window})
    _check_field("latents", rec.latents, lead, {"W": window})
    _check_seq_len(rec.latents.shape[-2], height, width)
    steps = rec.step_index
    if np.any(steps < 0) or np.any(steps >= n - 1) or np.any(np.diff(steps, axis=-1) != 1):
        raise ValueError(
            f"step_index: expected contiguous increasing steps within [0, N-1) = [0, {n - 1}), "
            f"got {steps.tolist()}")
    for name in ("final_latents", "reference_latents"):
        value = getattr(rec, name, None)
        if value is not None:
            _check_field(name, value, lead, {"S": rec.latents.shape[-2], "C": rec.latents.shape[-1]})
    _check_all_text(rec, lead)


class TextLengthError(ValueError):
    """A batch's text is longer than the length `TrajectoryBatch.padded` pads it to. Pickles with its fields: raised
    in a Ray actor, it reaches the trainer as itself (the driver's one line), not as Ray's UnserializableException."""

    def __init__(self, field: str, tokens: int, length: int):
        super().__init__(f"{field} has {tokens} tokens > {length}, the length the batch pads it to")
        self.field, self.tokens, self.length = field, tokens, length

    def __reduce__(self):
        return type(self), (self.field, self.tokens, self.length)


def _pad(field: str, text: np.ndarray, mask: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, L, D) embeds or (B, L) ids and their (B, L) mask right-padded with zeros / False to `length` tokens;
    TextLengthError if L is longer."""
    if text.shape[1] > length:
        raise TextLengthError(field, text.shape[1], length)
    out = np.zeros((len(text), length, *text.shape[2:]), text.dtype)
    out_mask = np.zeros(out.shape[:2], mask.dtype)
    out[:, :text.shape[1]], out_mask[:, :text.shape[1]] = text, mask
    return out, out_mask


def _text_lengths(batch: TrajectoryBatch) -> dict:
    """Each text field's length L (L'), keyed by the field."""
    kind = batch.text_kind
    prefixes = ("prompt", "negative_prompt") if batch.guided else ("prompt",)
    return {f"{p}_{kind}": getattr(batch, f"{p}_mask").shape[1] for p in prefixes}


def _concat_key(batch: TrajectoryBatch) -> dict:
    """What every batch joined by concat must share, keyed by the field that reports a mismatch (the text kind
    first: the keys after it depend on it)."""
    kind = batch.text_kind
    key = {
        "images": batch.images.shape[1:],
        "latents": batch.latents.shape[1:],
        "sigmas": tuple(batch.sigmas.tolist()),
        "prompt_ids": "present" if kind == "ids" else "absent",
    }
    if kind == "embeds":
        key["prompt_embeds"] = (batch.prompt_embeds.dtype, batch.prompt_embeds.shape[-1])
    key[f"negative_prompt_{kind}"] = "present" if batch.guided else "absent"
    key["final_latents"] = "absent" if batch.final_latents is None else "present"
    return key


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class TrajectoryBatch:
    """Trajectories stacked on a leading batch axis B; text right-padded (to the longest prompt, or to the train
    step's `text_tokens`: `padded`).

    images (B, H, W, 3); latents (B, W+1, S, C); log_probs (B, W); sigmas (N+1,) shared by all samples;
    step_index (B, W) (windows may differ per sample); the text, one kind per batch: prompt_embeds (B, L, D) bf16 or
    float32 (encoder embeds) or prompt_ids (B, L) int32 (the context's token ids), and prompt_mask (B, L);
    negative_prompt_embeds (B, L', D) or negative_prompt_ids (B, L') with negative_prompt_mask (B, L'), or None
    (no CFG; L' = 0: an empty unconditional context); prompts (B strings);
    group_ids, seeds, policy_versions (B,) int64; final_latents (B, S, C), the samples' last latents (sigma 0),
    or None (SamplingParams.keep_final; DiffusionNFT trains on them); reference_latents (B, R, S, C), an edit model's
    reference images' latents, or None.
    """

    images: np.ndarray
    latents: np.ndarray
    log_probs: np.ndarray
    sigmas: np.ndarray
    step_index: np.ndarray
    prompt_embeds: np.ndarray | None = None
    prompt_ids: np.ndarray | None = None
    prompt_mask: np.ndarray
    negative_prompt_embeds: np.ndarray | None = None
    negative_prompt_ids: np.ndarray | None = None
    negative_prompt_mask: np.ndarray | None = None
    prompts: tuple[str, ...]
    group_ids: np.ndarray
    seeds: np.ndarray
    policy_versions: np.ndarray
    final_latents: np.ndarray | None = None
    reference_latents: np.ndarray | None = None

    def __post_init__(self):
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if not all(isinstance(p, str) for p in self.prompts):
            raise ValueError("prompts: expected a sequence of str")
        lead = [("B", len(self.prompts))]
        validate_arrays(self, "images", lead)
        for field in ("group_ids", "seeds", "policy_versions"):
            _check_field(field, getattr(self, field), lead)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def guided(self) -> bool:
        """True when the batch carries a negative prompt (embeds or ids: true CFG)."""
        return self.negative_prompt_mask is not None

    @property
    def text_kind(self) -> str:
        """"embeds" (prompt_embeds) or "ids" (prompt_ids)."""
        return text_kind(self)

    @property
    def policy_version(self) -> int:
        """The single policy version that produced every sample; ValueError if the batch mixes versions."""
        versions = np.unique(self.policy_versions)
        if len(versions) != 1:
            raise ValueError(f"policy_versions: expected one version, got {versions.tolist()}")
        return int(versions[0])

    @classmethod
    def concat(cls, batches: Sequence[TrajectoryBatch]) -> TrajectoryBatch:
        """Join batches along B. Their text has one length already (padded at its source, `padded`): concat never
        pads; ValueError naming the field if the batches differ in it or in anything else they share."""
        if not batches:
            raise ValueError("concat: expected at least one batch, got none")
        first = _concat_key(batches[0])
        for i, batch in enumerate(batches[1:], 1):
            for field, value in _concat_key(batch).items():
                if value != first[field]:
                    raise ValueError(f"{field}: item {i} has {value}, item 0 has {first[field]}")
        lengths = _text_lengths(batches[0])
        for i, batch in enumerate(batches[1:], 1):
            for field, length in _text_lengths(batch).items():
                if length != lengths[field]:
                    raise ValueError(f"{field}: item {i} has {length} tokens, item 0 has {lengths[field]}: concat "
                                     f"joins text of one length (pad it where it is made: TrajectoryBatch.padded, "
                                     f"SamplingParams.text_tokens)")

        def cat(field):
            values = [getattr(b, field) for b in batches]
            return None if values[0] is None else np.concatenate(values)

        return cls.assembled(
            images=cat("images"), latents=cat("latents"), log_probs=cat("log_probs"), sigmas=batches[0].sigmas,
            step_index=cat("step_index"), **{f: cat(f) for f in TEXT_FIELDS},
            prompts=[p for b in batches for p in b.prompts], group_ids=cat("group_ids"),
            seeds=cat("seeds"), policy_versions=cat("policy_versions"), final_latents=cat("final_latents"),
            reference_latents=cat("reference_latents"))

    def padded(self, text_tokens: tuple[int, int] | None) -> TrajectoryBatch:
        """This batch with its text right-padded (zeros, masks False) to `text_tokens` (prompt, negative prompt
        tokens; the negative's ignored without CFG): the one text shape of every batch a train step joins, made
        where the trajectory is made. None: as it is. TextLengthError if a text is longer."""
        if text_tokens is None:
            return self
        if (len(text_tokens) != 2 or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool)
                                             and n >= 0 for n in text_tokens)):
            raise ValueError(f"text_tokens: expected (prompt, negative prompt) token counts >= 0, got {text_tokens!r}")
        kind, fields = self.text_kind, {}
        for prefix, length in zip(("prompt", "negative_prompt"), text_tokens):
            if prefix == "negative_prompt" and not self.guided:
                continue
            text, mask = getattr(self, f"{prefix}_{kind}"), getattr(self, f"{prefix}_mask")
            if text.shape[1] != length:
                fields[f"{prefix}_{kind}"], fields[f"{prefix}_mask"] = _pad(f"{prefix}_{kind}", text, mask, int(length))
        if not fields:
            return self
        return self.assembled(**{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **fields})

    def to_dict(self) -> dict[str, np.ndarray]:
        """Plain numpy arrays (prompts as a str array; absent negatives omitted), for Ray or checkpoints."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["prompts"] = np.asarray(self.prompts, dtype=np.str_)
        return {k: v for k, v in out.items() if v is not None}

    @classmethod
    def from_dict(cls, arrays: dict[str, np.ndarray]) -> TrajectoryBatch:
        """Inverse of to_dict, validated (a trajectory crossing into this process): ValueError naming the first
        field missing, of the wrong dims (`batch.require`), shape or dtype."""
        require(arrays, "rollout trajectory")
        return cls(**{**arrays, "prompts": [str(p) for p in arrays["prompts"]]})

    @classmethod
    def assembled(cls, **fields) -> TrajectoryBatch:
        """A batch of arrays that are valid already (a producer's own, or `concat`'s of validated batches), made
        without validating them again; the trajectory is validated where it crosses into a process."""
        batch = object.__new__(cls)
        for f in dataclasses.fields(cls):
            value = fields.pop(f.name, f.default)
            if value is dataclasses.MISSING:
                raise TypeError(f"TrajectoryBatch.assembled: missing {f.name}")
            object.__setattr__(batch, f.name, value)
        if fields:
            raise TypeError(f"TrajectoryBatch.assembled: unknown fields {sorted(fields)}")
        object.__setattr__(batch, "prompts", tuple(batch.prompts))
        return batch
