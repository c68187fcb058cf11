"""The batch schema: every field a step's data carries from the rollout to the loss, declared once (docs/design.md §2).

Numpy only. Each `Field` names its dtypes and its dims per sample, symbolic in the step's sizes (H, W image; W window
steps, W+1 latents; S image tokens, C channels; N+1 schedule; L, L' text tokens, D text width), and whether every
sample has its own (a leading B axis) or the batch shares one. The rollout's `TrajectoryBatch`
(`jaxflow_bridge.contract.trajectory`) is made of the trajectory fields, the learner's `TrainBatch`
(`jaxflow.trainer.train_batch`) of the train fields, the vLLM-Omni codec carries the payload fields and an
algorithm's `batch_fields` are names from here. `require` is the one check that a crossing's arrays hold every field
the batch needs, each with its number of dims; `nonfinite_rows` names the float fields the learner reads that hold a
value that is not finite; `shapes` resolves the fields' shapes at a step's sizes (the learner's compile-time memory
plan) and `dim_size` one dim (the trajectory's shape checks).
"""
from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

F32 = np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)
EMBED_DTYPES = (BF16, F32)
INT32 = np.dtype(np.int32)
INT64 = np.dtype(np.int64)
UINT8 = np.dtype(np.uint8)
BOOL = np.dtype(np.bool_)


@dataclasses.dataclass(frozen=True)
class Field:
    """name; dtypes it may have; dims per sample (symbols); shared: one array for the whole batch (no B axis);
    required: a trajectory without it is refused (the others are one text kind's, CFG's or DiffusionNFT's);
    trajectory / train: whether the rollout's TrajectoryBatch / the learner's TrainBatch carries it."""

    name: str
    dtypes: tuple[np.dtype, ...]
    dims: tuple[str, ...]
    shared: bool = False
    required: bool = True
    trajectory: bool = True
    train: bool = True


FIELDS = {f.name: f for f in (
    Field("images", (UINT8,), ("H", "W", "3"), train=False),
    Field("latents", (F32,), ("W+1", "S", "C")),
    Field("log_probs", (F32,), ("W",)),
    Field("sigmas", (F32,), ("N+1",), shared=True),
    Field("step_index", (INT32,), ("W",)),
    Field("prompt_embeds", EMBED_DTYPES, ("L", "D"), required=False),
    Field("prompt_ids", (INT32,), ("L",), required=False),
    Field("prompt_mask", (BOOL,), ("L",)),
    Field("negative_prompt_embeds", EMBED_DTYPES, ("L'", "D"), required=False),
    Field("negative_prompt_ids", (INT32,), ("L'",), required=False),
    Field("negative_prompt_mask", (BOOL,), ("L'",), required=False),
    Field("prompts", (np.dtype(np.str_),), (), train=False),
    Field("group_ids", (INT64,), (), train=False),
    Field("seeds", (INT64,), (), train=False),
    Field("policy_versions", (INT64,), (), train=False),
    Field("final_latents", (F32,), ("S", "C"), required=False),
    # an edit model's reference images (R of them, each packed on the target's S tokens): its VAE latents, made once
    # per prompt group and carried per sample; the model reads them beside the text at every window step
    Field("reference_latents", (F32,), ("R", "S", "C"), required=False),
    Field("advantages", (F32,), (), trajectory=False),
    Field("noise_level", (F32,), (), shared=True, trajectory=False),
)}

TRAJECTORY_FIELDS = tuple(n for n, f in FIELDS.items() if f.trajectory)
TRAIN_FIELDS = tuple(n for n, f in FIELDS.items() if f.train)
# the text: embeds or token ids, each with its mask; a token-id family carries
# the ids in place of the embeds (`TEXT_IDS`)
TEXT_FIELDS = ("prompt_embeds", "prompt_ids", "prompt_mask", "negative_prompt_embeds", "negative_prompt_ids",
               "negative_prompt_mask")
GUIDANCE_FIELDS = ("negative_prompt_embeds", "negative_prompt_mask")
TEXT_IDS = {"prompt_embeds": "prompt_ids", "negative_prompt_embeds": "negative_prompt_ids"}
# what a family's model reads beside the text, the same at every window step (a field the rollout may send)
CONDITION_FIELDS = ("reference_latents",)
# fields the batch shares, with their number of dims (a train batch may also hold them per sample)
SHARED_FIELDS = {n: len(f.dims) for n, f in FIELDS.items() if f.shared}
# the trajectory fields the vLLM-Omni codec carries in its own payload: latents and log-probs ride in vLLM-Omni's
# own output fields, prompts and group ids are the request's
PAYLOAD_FIELDS = tuple(n for n in TRAJECTORY_FIELDS if n not in ("latents", "log_probs", "prompts", "group_ids"))


def require(arrays: dict, where: str) -> None:
    """ValueError naming the first trajectory field that `arrays` (name -> array, as it crossed into this process
    at `where`) lacks, or that has the wrong number of dims, or a name the schema does not know."""
    unknown = sorted(set(arrays) - set(TRAJECTORY_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown trajectory field {unknown[0]!r}; the fields are {list(TRAJECTORY_FIELDS)}")
    for name in TRAJECTORY_FIELDS:
        field, value = FIELDS[name], arrays.get(name)
        if value is None:
            if field.required:
                raise ValueError(f"{where}: the trajectory is missing {name} ({field_doc(name)})")
            continue
        ndim = len(field.dims) + (not field.shared)
        if np.ndim(value) != ndim:
            raise ValueError(f"{where}: {name} expected {ndim} dims {field_doc(name)}, got shape {np.shape(value)}")


def nonfinite_rows(batch) -> dict[str, int]:
    """Field name -> rows holding a NaN or an infinity, for the float fields (float32, bfloat16) of `batch` that the
    learner reads (the schema's train fields; `batch` is a TrajectoryBatch or a TrainBatch, per-sample fields on a
    leading axis); a shared field that is not finite counts every row. Only the fields with such rows are named."""
    rows, out = len(batch), {}
    for name, field in FIELDS.items():
        value = getattr(batch, name, None)
        if not field.train or value is None or value.dtype.kind in "biu":
            continue
        finite = np.isfinite(value)
        if np.ndim(value) == len(field.dims):  # shared: one array for every row
            bad = 0 if finite.all() else rows
        else:
            bad = int(np.count_nonzero(~finite.reshape(rows, -1).all(axis=1)))
        if bad:
            out[name] = bad
    return out


def field_doc(name: str) -> str:
    """A field's shape and dtypes as text, e.g. "(B, W+1, S, C) float32"."""
    field = FIELDS[name]
    dims = field.dims if field.shared else ("B", *field.dims)
    return f"({', '.join(dims)}) {' or '.join(str(d) for d in field.dtypes)}"


def dim_size(dim: str, sizes: dict) -> int | None:
    """A symbolic dim's size at `sizes` (symbol -> size or None): a number is itself, "X+1" is X's plus one, a symbol
    its own; None where `sizes` does not give it."""
    if dim.isdigit():
        return int(dim)
    base, plus = (dim[:-2], 1) if dim.endswith("+1") else (dim, 0)
    size = sizes.get(base)
    return None if size is None else size + plus


def shapes(names, sizes: dict, dtypes: dict | None = None, per_sample: bool = False) -> dict[str, tuple]:
    """name -> (shape, dtype) of each of the fields `names` at a step's `sizes` (B samples and the dims' symbols: W
    window steps, N schedule steps, S, C, L, L', D; the images' W is their width, so not theirs): a leading B axis
    unless the field is shared (with `per_sample` every field has one, as the learner's step takes them); the dtype
    `dtypes`' for the name, else the field's first. ValueError naming a dim that `sizes` does not give."""
    out = {}
    for name in names:
        field = FIELDS[name]
        dims = field.dims if field.shared and not per_sample else ("B", *field.dims)
        shape = tuple(dim_size(d, sizes) for d in dims)
        if None in shape:
            raise ValueError(f"{name}: no size for its dim {dims[shape.index(None)]!r} in {sorted(sizes)}")
        out[name] = (shape, np.dtype((dtypes or {}).get(name, field.dtypes[0])))
    return out
