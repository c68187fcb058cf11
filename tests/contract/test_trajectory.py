"""jaxflow_bridge.contract.trajectory: validation, concat with right-padded text, transport; per-sample records built here (the
rollout builds batches directly) are stacked into batches and back."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from jaxflow_bridge.contract.batch import TEXT_FIELDS
from jaxflow_bridge.contract.trajectory import TextLengthError, TrajectoryBatch, validate_arrays

ROOT = Path(__file__).resolve().parents[2]
BF16 = ml_dtypes.bfloat16
H, W, N, C, D = 32, 48, 6, 64, 8
S = (H // 16) * (W // 16)
SIGMAS = np.array([1.0, 0.9, 0.75, 0.55, 0.3, 0.1, 0.0], np.float32)


@dataclasses.dataclass(frozen=True, eq=False, kw_only=True)
class Trajectory:
    """One sample as docs/numerics.md §9 states the contract, validated like a batch row."""

    image: np.ndarray
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
    prompt: str
    group_id: int
    seed: int
    policy_version: int

    def __post_init__(self):
        validate_arrays(self, "image", [])
        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt: expected a str, got {type(self.prompt).__name__}")
        for field in ("group_id", "seed", "policy_version"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{field}: expected an int, got {type(value).__name__}")
            object.__setattr__(self, field, int(value))


def stack(trajectories) -> TrajectoryBatch:
    """A batch of the samples (through TrajectoryBatch.concat of batches of one, each padded to the longest text)."""
    def one(x):
        return None if x is None else x[None]

    def longest(field):
        return max((len(getattr(t, field)) for t in trajectories if getattr(t, field) is not None), default=0)

    text_tokens = (longest("prompt_mask"), longest("negative_prompt_mask"))
    return TrajectoryBatch.concat([TrajectoryBatch(
        images=one(t.image), latents=one(t.latents), log_probs=one(t.log_probs), sigmas=t.sigmas,
        step_index=one(t.step_index), **{f: one(getattr(t, f)) for f in TEXT_FIELDS},
        prompts=(t.prompt,), group_ids=np.array([t.group_id], np.int64), seeds=np.array([t.seed], np.int64),
        policy_versions=np.array([t.policy_version], np.int64)).padded(text_tokens) for t in trajectories])


def select(batch: TrajectoryBatch, indices) -> TrajectoryBatch:
    """Rows picked by anything numpy can index a (B,) axis with: ints, a slice or a bool mask."""
    rows = np.arange(len(batch))[indices]
    if rows.ndim != 1:
        raise ValueError(f"indices: expected a 1-D selection, got shape {rows.shape}")
    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    picked = {k: None if v is None else v[rows] for k, v in fields.items() if k not in ("sigmas", "prompts")}
    return TrajectoryBatch(**picked, sigmas=batch.sigmas, prompts=[batch.prompts[i] for i in rows])


def _trim(embeds: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Drop trailing masked-out tokens (padding)."""
    valid = np.flatnonzero(mask)
    length = int(valid[-1]) + 1 if valid.size else 0
    return embeds[:length], mask[:length]


def unstack(batch: TrajectoryBatch) -> list[Trajectory]:
    """Per-sample records with trailing masked-out text dropped: inverts `stack` for masks ending in a valid token."""
    out = []
    kind = batch.text_kind
    for i in range(len(batch)):
        text = {}
        for prefix in ("prompt", "negative_prompt") if batch.guided else ("prompt",):
            text[f"{prefix}_{kind}"], text[f"{prefix}_mask"] = _trim(getattr(batch, f"{prefix}_{kind}")[i],
                                                                    getattr(batch, f"{prefix}_mask")[i])
        out.append(Trajectory(
            image=batch.images[i], latents=batch.latents[i], log_probs=batch.log_probs[i], sigmas=batch.sigmas,
            step_index=batch.step_index[i], **text, prompt=batch.prompts[i], group_id=batch.group_ids[i], seed=batch.seeds[i],
            policy_version=batch.policy_versions[i]))
    return out


def make(start=1, window=3, length=5, neg_length=None, seed=0, version=3, dtype=BF16, ids=False) -> Trajectory:
    """A sample with text embeds of `dtype`, or with `ids` BAGEL's context token ids (int32, from 1: no padding id)."""
    rng = np.random.default_rng(seed)
    text = {}
    for prefix, n in (("prompt", length), ("negative_prompt", neg_length)):
        if n is not None:
            text[f"{prefix}_mask"] = np.ones(n, bool)
            if ids:
                text[f"{prefix}_ids"] = rng.integers(1, 1000, n).astype(np.int32)
            else:
                text[f"{prefix}_embeds"] = rng.standard_normal((n, D)).astype(dtype)
    return Trajectory(
        image=rng.integers(0, 256, (H, W, 3), dtype=np.uint8),
        latents=rng.standard_normal((window + 1, S, C), dtype=np.float32),
        log_probs=rng.standard_normal(window, dtype=np.float32),
        sigmas=SIGMAS.copy(),
        step_index=np.arange(start, start + window, dtype=np.int32),
        **text, prompt=f"prompt {seed}", group_id=seed // 2, seed=seed, policy_version=version)


def assert_same(a, b):
    """Field-by-field equality: same dtypes, shapes and bits (dataclass eq is off for arrays)."""
    assert type(a) is type(b)
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype and x.shape == y.shape, field.name
            np.testing.assert_array_equal(x, y, err_msg=field.name)
        else:
            assert x == y, field.name


def test_valid_construction():
    t = make(neg_length=4, seed=np.int64(5))
    assert t.latents.shape == (4, S, C) and t.negative_prompt_mask.shape == (4,)
    assert type(t.seed) is int and t.seed == 5
    make(start=0, window=N - 1, dtype=np.float32)  # the widest window: steps 0..N-2


@pytest.mark.parametrize("height, width, seq", [(32, 48, 6), (32, 48, 24), (40, 72, 45), (32, 48, 96)])
def test_latent_tokens_follow_any_vae_factor(height, width, seq):
    """S = (H/p)(W/p) for any patch p = 2 x VAE factor: 16 (real Qwen-Image), 8 (tiny VAE, factor 4), 4."""
    rng = np.random.default_rng(0)
    t = dataclasses.replace(make(), image=np.zeros((height, width, 3), np.uint8),
                            latents=rng.standard_normal((4, seq, C), dtype=np.float32))
    assert t.latents.shape[1] == seq


def replaced(**changes):
    return lambda: dataclasses.replace(make(neg_length=4), **changes)


@pytest.mark.parametrize("build, message", [
    (replaced(latents=np.zeros((3, S, C), np.float32)),
     r"latents: expected shape \(W\+1, S, C\) = \(4, \*, \*\), got shape \(3, 6, 64\)"),
    (replaced(latents=np.zeros((4, S + 1, C), np.float32)),
     r"latents: expected S = \(H/p\)\(W/p\) .* dividing H=32 and W=48, got S=7"),
    (replaced(latents=np.zeros((4, 24 * 3, C), np.float32)), r"latents: expected S = .*got S=72"),
    (replaced(latents=np.zeros((4, 0, C), np.float32)), "latents: expected S = .*got S=0"),
    (replaced(latents=np.zeros((4, S, C), np.float64)), "latents: expected dtype float32, got dtype float64"),
    (replaced(log_probs=np.zeros(3, np.float16)), "log_probs: expected dtype float32, got dtype float16"),
    (replaced(log_probs=np.zeros(0, np.float32)), "log_probs: expected a window of W >= 1"),
    (replaced(step_index=np.arange(3, dtype=np.int64)), "step_index: expected dtype int32, got dtype int64"),
    (replaced(step_index=np.array([1, 3, 4], np.int32)), r"step_index: .*\[0, 5\), got \[1, 3, 4\]"),
    (replaced(step_index=np.array([3, 4, 5], np.int32)), r"step_index: .*\[0, 5\), got \[3, 4, 5\]"),
    (replaced(sigmas=SIGMAS[:-1]), "sigmas: expected .* ending in 0"),
    (replaced(sigmas=SIGMAS[::-1].copy()), "sigmas: expected .* strictly decreasing"),
    (replaced(image=np.zeros((H, W, 4), np.uint8)), r"image: expected shape \(H, W, 3\) = \(\*, \*, 3\)"),
    (replaced(image=np.zeros((H, W, 3), np.float32)), "image: expected dtype uint8, got dtype float32"),
    (replaced(prompt_mask=np.ones(4, bool)),
     r"prompt_mask: expected shape \(L\) = \(5\), got shape \(4,\)"),
    (replaced(prompt_mask=np.ones(5, np.int64)), "prompt_mask: expected dtype bool, got dtype int64"),
    (replaced(prompt_embeds=np.zeros((5, D), np.float16)), "prompt_embeds: expected dtype bfloat16 or float32"),
    (replaced(negative_prompt_mask=None),
     "negative_prompt_embeds/negative_prompt_mask: .* only negative_prompt_embeds"),
    (lambda: dataclasses.replace(make(), negative_prompt_mask=np.ones(2, bool)),
     "negative_prompt_embeds/negative_prompt_mask: .* only negative_prompt_mask"),
    (replaced(negative_prompt_mask=np.ones(5, bool)), r"negative_prompt_mask: expected shape \(L\) = \(4\)"),
    (replaced(negative_prompt_embeds=np.zeros((4, D), np.float32)),
     "negative_prompt_embeds: expected dtype bfloat16"),
    (replaced(negative_prompt_embeds=np.zeros((4, D + 1), BF16)), r"negative_prompt_embeds: .*= \(\*, 8\)"),
    (replaced(latents=[[0.0]]), "latents: expected a numpy array, got list"),
    (replaced(prompt=b"bytes"), "prompt: expected a str"),
    (replaced(policy_version=True), "policy_version: expected an int, got bool"),
])
def test_validation_errors_name_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_stack_pads_text_right_and_masks_padding():
    samples = [make(length=5, neg_length=2, seed=0), make(start=2, length=7, neg_length=4, seed=1)]
    batch = stack(samples)
    assert len(batch) == 2 and batch.prompts == ("prompt 0", "prompt 1")
    assert batch.latents.shape == (2, 4, S, C) and batch.sigmas.shape == (N + 1,)
    assert batch.step_index.tolist() == [[1, 2, 3], [2, 3, 4]]  # windows differ per sample
    assert batch.prompt_embeds.shape == (2, 7, D) and batch.prompt_embeds.dtype == BF16
    assert batch.prompt_mask.tolist() == [[True] * 5 + [False] * 2, [True] * 7]
    assert not batch.prompt_embeds[0, 5:].astype(np.float32).any()
    assert batch.negative_prompt_embeds.shape == (2, 4, D)  # padded separately from the positive
    assert batch.negative_prompt_mask.sum(axis=1).tolist() == [2, 4]
    assert batch.group_ids.dtype == batch.seeds.dtype == batch.policy_versions.dtype == np.int64
    assert stack([make()]).negative_prompt_embeds is None


@pytest.mark.parametrize("other, field", [
    (dataclasses.replace(make(seed=1), sigmas=np.linspace(1, 0, N + 1, dtype=np.float32)), "sigmas"),
    (make(window=2, seed=1), "latents"),
    (make(neg_length=3, seed=1), "negative_prompt_embeds"),
    (make(dtype=np.float32, seed=1), "prompt_embeds"),
])
def test_stack_rejects_incompatible_samples(other, field):
    with pytest.raises(ValueError, match=f"^{field}: item 1 has"):
        stack([make(), other])


def test_stack_rejects_different_image_sizes_and_empty():
    rng = np.random.default_rng(0)
    big = dataclasses.replace(make(), image=np.zeros((H, W + 16, 3), np.uint8),
                              latents=rng.standard_normal((4, S + 2, C), dtype=np.float32))
    with pytest.raises(ValueError, match="^images: item 1 has"):
        stack([make(), big])
    with pytest.raises(ValueError, match="at least one"):
        stack([])


@pytest.mark.parametrize("neg, ids", [(None, False), (3, False), (None, True), (3, True)])
def test_unstack_inverts_stack(neg, ids):
    samples = [make(length=3 + i, neg_length=neg and neg + i, start=i % 3, seed=i, ids=ids) for i in range(4)]
    for got, want in zip(unstack(stack(samples)), samples, strict=True):
        assert_same(got, want)


def test_select_and_concat():
    samples = [make(length=2 + i, seed=i) for i in range(5)]
    batch = stack(samples)
    picked = select(batch, [3, -5])
    assert picked.prompt_embeds.shape == (2, 6, D)  # select keeps the batch's padding
    for got, want in zip(unstack(picked), [samples[3], samples[0]], strict=True):
        assert_same(got, want)
    assert select(batch, slice(1, 3)).prompts == ("prompt 1", "prompt 2")
    assert select(batch, batch.seeds % 2 == 0).seeds.tolist() == [0, 2, 4]
    assert len(select(batch, [])) == 0
    short, long = stack(samples[:2]), stack(samples[2:])
    joined = TrajectoryBatch.concat([short.padded((6, 0)), long])  # short's text (L=3) is padded to 6
    assert joined.prompt_embeds.shape == (5, 6, D)
    assert_same(joined, batch)
    with pytest.raises(ValueError, match="1-D"):
        select(batch, np.zeros((2, 2), int))


def test_padded_pads_text_to_given_lengths_once():
    short = stack([make(length=2, neg_length=3, seed=0)])
    long = stack([make(length=5, neg_length=4, seed=1)])
    joined = TrajectoryBatch.concat([short.padded((8, 4)), long.padded((8, 4))])
    assert joined.prompt_embeds.shape == (2, 8, D) and joined.negative_prompt_embeds.shape == (2, 4, D)
    assert joined.prompt_mask.sum(axis=1).tolist() == [2, 5]
    assert joined.negative_prompt_mask.sum(axis=1).tolist() == [3, 4]
    assert np.array_equal(joined.prompt_embeds[1, :5], long.prompt_embeds[0])
    assert np.array_equal(joined.negative_prompt_embeds[0, :3], short.negative_prompt_embeds[0])
    assert not joined.prompt_embeds[0, 2:].astype(np.float32).any()  # padding: zeros, masks False
    with pytest.raises(TextLengthError, match="negative_prompt_embeds has 4 tokens > 3") as err:
        long.padded((8, 3))
    assert (err.value.field, err.value.tokens, err.value.length) == ("negative_prompt_embeds", 4, 3)


@pytest.mark.parametrize("ids", [False, True])
def test_concat_of_different_text_lengths_is_one_error_naming_the_field(ids):
    """concat joins text of one length (padded where it was made): it never pads, and different lengths are refused
    by name."""
    short = stack([make(length=2, neg_length=3, ids=ids, seed=0)])
    long = stack([make(length=5, neg_length=3, ids=ids, seed=1)])
    kind = "ids" if ids else "embeds"
    with pytest.raises(ValueError, match=rf"^prompt_{kind}: item 1 has 5 tokens, item 0 has 2: concat joins text of "
                                         r"one length \(pad it where it is made"):
        TrajectoryBatch.concat([short, long])
    with pytest.raises(ValueError, match=rf"^negative_prompt_{kind}: item 1 has 4 tokens, item 0 has 3"):
        TrajectoryBatch.concat([short.padded((5, 3)), long.padded((5, 4))])
    joined = TrajectoryBatch.concat([short.padded((5, 3)), long])
    assert joined.prompt_mask.shape == (2, 5) and joined.prompt_mask.sum(axis=1).tolist() == [2, 5]
    assert short.padded(None) is short and long.padded((5, 3)) is long  # at its length already: no copy


def test_to_dict_from_dict_round_trip():
    batch = stack([make(neg_length=2, seed=i) for i in range(3)])
    arrays = batch.to_dict()
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    assert_same(TrajectoryBatch.from_dict(arrays), batch)
    plain = stack([make()]).to_dict()
    assert "negative_prompt_embeds" not in plain
    assert TrajectoryBatch.from_dict(plain).negative_prompt_embeds is None
    with pytest.raises(ValueError, match=r"seeds: expected shape \(B\) = \(3\), got shape \(2,\)"):
        TrajectoryBatch.from_dict({**arrays, "seeds": arrays["seeds"][:2]})


# ---------------------------------------------------------------------------- BAGEL: context token ids (docs/bagel.md §4)


def ids_replaced(**changes):
    return lambda: dataclasses.replace(make(neg_length=0, ids=True), **changes)


def test_ids_in_place_of_embeds_with_an_empty_negative_context():
    """BAGEL's sample: (L,) int32 ids, the unconditional context empty (L' = 0), S = (H/16)(W/16) tokens of C = 64."""
    t = make(neg_length=0, ids=True)
    assert t.prompt_embeds is None and t.prompt_ids.dtype == np.int32 and t.latents.shape[1:] == (S, 64)
    batch = stack([t, make(length=3, neg_length=0, ids=True, seed=1)])
    assert batch.text_kind == "ids" and batch.guided and batch.prompt_embeds is None
    assert batch.negative_prompt_ids.shape == batch.negative_prompt_mask.shape == (2, 0)
    assert batch.negative_prompt_ids.dtype == np.int32 and batch.negative_prompt_mask.dtype == np.bool_
    assert stack([make(ids=True)]).guided is False and stack([make()]).text_kind == "embeds"


@pytest.mark.parametrize("build, message", [
    (ids_replaced(prompt_embeds=np.zeros((5, D), BF16)),
     r"^prompt_embeds/prompt_ids: expected exactly one \(text embeds or context token ids\), got both$"),
    (ids_replaced(prompt_ids=None), r"^prompt_embeds/prompt_ids: expected exactly one .*, got neither$"),
    (ids_replaced(prompt_ids=np.arange(5, dtype=np.int64)), "^prompt_ids: expected dtype int32, got dtype int64$"),
    (ids_replaced(prompt_ids=np.zeros((5, D), np.int32)),
     r"^prompt_ids: expected shape \(L\) = \(\*\), got shape \(5, 8\)$"),
    (ids_replaced(prompt_mask=np.ones(4, bool)), r"^prompt_mask: expected shape \(L\) = \(5\), got shape \(4,\)$"),
    (ids_replaced(prompt_ids=np.array([3, -1, 2, 2, 2], np.int32)), "^prompt_ids: expected token ids >= 0, got -1$"),
    (ids_replaced(negative_prompt_mask=np.ones(2, bool)),
     r"^negative_prompt_mask: expected shape \(L\) = \(0\), got shape \(2,\)$"),
    (ids_replaced(negative_prompt_ids=np.zeros(0, np.uint32)),
     "^negative_prompt_ids: expected dtype int32, got dtype uint32$"),
    (ids_replaced(negative_prompt_mask=None),
     "^negative_prompt_ids/negative_prompt_mask: expected both .* got only negative_prompt_ids$"),
    (ids_replaced(negative_prompt_embeds=np.zeros((0, D), BF16)),
     r"^negative_prompt_embeds: expected negative_prompt_ids with prompt_ids \(one text kind per batch\)$"),
    (replaced(negative_prompt_ids=np.zeros(4, np.int32)),
     "^negative_prompt_ids: expected negative_prompt_embeds with prompt_embeds"),
])
def test_ids_refusals_name_the_fields(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_padded_pads_ids_to_text_tokens():
    short = stack([make(length=2, neg_length=0, ids=True, seed=0)])
    long = stack([make(length=5, neg_length=0, ids=True, seed=1)])
    joined = TrajectoryBatch.concat([short.padded((8, 3)), long.padded((8, 3))])
    assert joined.prompt_ids.shape == joined.prompt_mask.shape == (2, 8) and joined.prompt_ids.dtype == np.int32
    assert joined.prompt_mask.dtype == np.bool_ and joined.prompt_mask.sum(axis=1).tolist() == [2, 5]
    np.testing.assert_array_equal(joined.prompt_ids[0], np.r_[short.prompt_ids[0], np.zeros(6, np.int32)])
    np.testing.assert_array_equal(joined.prompt_ids[1, :5], long.prompt_ids[0])
    assert not joined.prompt_ids[1, 5:].any()
    # the empty unconditional context pads to L' = 3 all-False (masked) tokens
    assert joined.negative_prompt_ids.shape == (2, 3) and not joined.negative_prompt_ids.any()
    assert not joined.negative_prompt_mask.any() and joined.prompt_embeds is None
    with pytest.raises(TextLengthError, match="^prompt_ids has 5 tokens > 4, the length the batch pads it to$") as err:
        long.padded((4, 3))
    assert (err.value.field, err.value.tokens, err.value.length) == ("prompt_ids", 5, 4)
    guided = stack([make(length=2, neg_length=3, ids=True)])
    with pytest.raises(TextLengthError, match="^negative_prompt_ids has 3 tokens > 2"):
        guided.padded((8, 2))


@pytest.mark.parametrize("other, field", [
    (make(seed=1), "prompt_ids"),
    (make(neg_length=2, ids=True, seed=1), "negative_prompt_ids"),
])
def test_concat_rejects_mixed_text(other, field):
    with pytest.raises(ValueError, match=f"^{field}: item 1 has"):
        stack([make(ids=True), other])


@pytest.mark.parametrize("neg", [None, 0, 2])
def test_ids_to_dict_from_dict_round_trip(neg):
    batch = stack([make(length=3 + i, neg_length=neg, ids=True, seed=i) for i in range(3)])
    arrays = batch.to_dict()
    assert "prompt_embeds" not in arrays and arrays["prompt_ids"].dtype == np.int32
    assert ("negative_prompt_ids" in arrays) == (neg is not None)
    assert_same(TrajectoryBatch.from_dict(arrays), batch)


def test_policy_version_single_or_raises():
    assert stack([make(seed=0), make(seed=1)]).policy_version == 3
    mixed = stack([make(version=3), make(version=4)])
    with pytest.raises(ValueError, match=r"policy_versions: expected one version, got \[3, 4\]"):
        mixed.policy_version


@pytest.mark.parametrize("module", ["jaxflow_bridge.contract.trajectory", "jaxflow_bridge.rollout.tensors", "jaxflow_bridge.contract.safetensors_io"])
def test_import_pulls_in_neither_jax_nor_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('jax', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    assert out.stdout.strip() == "[]"
