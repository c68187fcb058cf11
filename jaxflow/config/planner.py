"""The machine plan: which layout, how many samples per micro-batch, JAX's share of each GPU and the engine's, and
the step time it predicts, from the model's sizes, the card and the per-phase cost table (`phase_costs.json`,
written by `python -m jaxflow_bench.phase_costs` from measured result files). Pure: no JAX, no device. The step
time comes only from rows measured on the job's own family (`costs_for`): a family never measured gets none; a job
whose algorithm or settings run other transformer passes per image than the row's config has its costs scaled to
them (`jaxflow.config.work`).

The memory model on one GPU: JAX holds the frozen transformer and the LoRA's train state (`resident`), and the
update needs `fixed + per_sample x micro-batch` beside it (`UpdateMemory`); the engine holds the weights it does
not share with the trainer plus a working reserve measured per engine. `UpdateMemory` comes from the compiled
step's memory analysis when the run has it (`from_analysis`), else from parameter counts (`from_counts`), scaled
from the measured recipe; the plan's `why` says which."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from jaxflow.config.work import Work, scaled_costs

GIB = 2 ** 30
TABLE = Path(__file__).with_name("phase_costs.json")
# per LoRA parameter resident before the update: its float32 value. Adam's two moments are the update's outputs, in
# its measured need (the micro-batch fit's memory in use is the bf16 transformer plus 4 bytes a LoRA parameter:
# BENCHMARKS.md, "Memory fit")
LORA_RESIDENT_BYTES = 4


class NoFit(ValueError):
    """The config cannot run on the machine; the message is one line naming what would."""


@dataclasses.dataclass(frozen=True)
class Card:
    name: str
    memory_gib: float


@dataclasses.dataclass(frozen=True)
class ModelSizes:
    """The model as the plan sees it: its weights' bytes as they run, its LoRA, its depth and a sample's tokens."""

    transformer_bytes: int
    text_encoder_bytes: int
    vae_bytes: int
    lora_params: int
    layers: int
    tokens: int  # one sample's image and prompt tokens

    @property
    def scale(self) -> float:
        """A sample's activations grow with tokens x width x depth; width x depth ~ sqrt(params x depth) for a
        transformer (params ~ 12 depth width^2), in bf16 parameters."""
        return self.tokens * math.sqrt(self.transformer_bytes / 2 * self.layers)


@dataclasses.dataclass(frozen=True)
class UpdateMemory:
    """Bytes on one GPU: `resident` before the update, and the update's need at `m` samples per micro-batch."""

    resident: float
    fixed: float
    per_sample: float
    source: str

    def need(self, m: int) -> float:
        return self.fixed + self.per_sample * m

    @classmethod
    def from_counts(cls, sizes: ModelSizes, table: dict) -> UpdateMemory:
        """From parameter counts, scaled from the recipe's measured update (the table's "memory")."""
        mem = table["memory"]
        return cls(resident=sizes.transformer_bytes + sizes.lora_params * LORA_RESIDENT_BYTES,
                   fixed=mem["fixed_per_transformer_byte"] * sizes.transformer_bytes,
                   per_sample=mem["per_sample_per_scale"] * sizes.scale,
                   source=f"parameter counts, scaled from {mem['file']} ({mem['card']})")

    @classmethod
    def from_analysis(cls, resident: int, need: int, micro_batch: int, counts: UpdateMemory) -> UpdateMemory:
        """The compiled step's memory analysis (`need` bytes at `micro_batch` samples, `resident` on the device),
        other micro-batches in the proportion of the counts model."""
        ratio = need / counts.need(micro_batch)
        return cls(resident, counts.fixed * ratio, counts.per_sample * ratio,
                   f"the compiled step's memory analysis at {micro_batch} sample(s) per micro-batch")


@dataclasses.dataclass(frozen=True)
class Job:
    """What the config asks of the machine."""

    family: str  # model.family: the cost rows the step time is predicted from
    images: int  # per step
    mini_batches: int
    micro_batches: int | None  # None: 'auto', the largest micro-batch that fits
    engine: str
    layout: str
    share_weights: bool
    work: Work | None = None  # its transformer passes per image (None: the measured row's, unscaled)
    steps: int = 0  # train.num_steps: the steps a run does at most (with max_minutes, `short_start`)
    max_minutes: float = 0.0  # train.max_minutes (0: no limit)
    auto_unroll: bool = False  # model.scan_unroll=0 with model.lora_gemm='auto': the plan may pick a short-run start
    scanned: bool = False  # model.scan_unroll=1 with XLA's linears, as set: the short-run start's program


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str  # rollout.layout
    engine: str
    share_weights: bool

    def overrides(self) -> str:
        return (f"--config.rollout.layout={self.name} --config.rollout.engine={self.engine} "
                f"--config.rollout.share_weights={self.share_weights}")


@dataclasses.dataclass(frozen=True)
class Plan:
    card: Card
    gpus: int
    layout: Layout
    micro_batch: int  # samples per micro-batch per GPU
    num_micro_batches: int
    jax_share: float  # of each GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION)
    engine_share: float
    step_s: float | None
    img_per_gpu_s: float | None
    why: tuple[str, ...]

    def summary(self) -> str:
        speed = (f"predicted {self.step_s:.1f} s a step, {self.img_per_gpu_s:.2f} img/GPU/s" if self.step_s
                 else "no prediction (why below)" if any(w.startswith("no prediction") for w in self.why)
            else "no costs measured for this family on this engine: no prediction")
        return "\n".join((
            f"machine: {self.gpus} x {self.card.name} ({self.card.memory_gib:.0f} GiB): layout {self.layout.name}, "
            f"{self.layout.engine} engine{' on the trainer weights' if self.layout.share_weights else ''}, "
            f"{self.micro_batch} sample(s) per micro-batch per GPU, {self.num_micro_batches} micro-batch(es) an update, JAX "
            f"{self.jax_share:.3f} of each GPU, the engine {self.engine_share:.3f}; {speed}",
            *(f"  why: {line}" for line in self.why)))


def short_start(job: Job, card: Card, gpus: int, table: dict) -> tuple[str, float] | None:
    """(why, the step's extra seconds) where the job's trainer runs its blocks in a scan with XLA's linears (the
    short-run start), else None. For a job that leaves both to the plan (`Job.auto_unroll`) on the card and family
    of the table's `short_start` row (README's command measured both ways): unrolled blocks compile that row's
    `compile_saving_s` longer and save `step_extra_s_per_image` a step per image, so they pay only for a run longer
    than that; its steps are train.num_steps, fewer where train.max_minutes ends it first (at the unrolled step's
    measured pace)."""
    row = _scan_row(job, card, table)
    if row is None or not job.auto_unroll or not job.steps:
        return None
    images = job.images / gpus
    steps = job.steps
    if job.max_minutes:
        steps = min(steps, math.ceil(job.max_minutes * 60 / (images * row["step_s_per_image"])))
    extra = images * row["step_extra_s_per_image"]
    if steps * extra >= row["compile_saving_s"]:
        return None
    return (f"auto: a short run ({steps} step(s) of {images:g} images a GPU): unrolled blocks would compile "
            f"{row['compile_saving_s']:.0f} s longer to save {steps * extra:.0f} s ({row['file']}); "
            f"--config.model.scan_unroll=60 keeps them unrolled"), extra


def _scan_row(job: Job, card: Card, table: dict) -> dict | None:
    """The table's `short_start` row for the job's family on the card: blocks in a scan against unrolled."""
    return next((r for r in table.get("short_start", ()) if r["family"] == job.family and r["card"] == card.name),
                None)


def _passes(work: Work) -> str:
    return (f"rollout {work.rollout:g}, trained {work.train:g}, forward-only {work.forward:g}, old log-probs "
            f"{work.recompute:g}")


def load_table(path: Path = TABLE) -> dict:
    return json.loads(Path(path).read_text())


def engine_bytes(sizes: ModelSizes, layout: Layout, reserve_gib: float) -> float:
    """The engine's bytes on a GPU: the weights it does not share with the trainer and its working reserve."""
    own = sizes.text_encoder_bytes + sizes.vae_bytes + (0 if layout.share_weights else sizes.transformer_bytes)
    return own + reserve_gib * GIB


def _nearest(rows: list[dict], engine: str, share_weights: bool, card: Card) -> dict | None:
    """The row of `rows` for the engine (and weight sharing) on the card of the nearest memory; None if none."""
    rows = [r for r in rows if r["engine"] == engine and r["share_weights"] == share_weights] or \
        [r for r in rows if r["engine"] == engine]
    return min(rows, key=lambda r: abs(r["card_gib"] - card.memory_gib)) if rows else None


def costs_for(table: dict, family: str, engine: str, share_weights: bool, card: Card) -> dict | None:
    """The step's costs: `family`'s measured row for the engine on the nearest card; None if never measured."""
    return _nearest([r for r in table["phases"] if r["family"] == family], engine, share_weights, card)


def engine_row(table: dict, engine: str, share_weights: bool, card: Card) -> dict | None:
    """The memory plan's row (the engine's working reserve, JAX's measured share): the engine's run on the nearest
    card of the family the memory model measured (the table's "memory"), whatever the job's family."""
    return _nearest([r for r in table["phases"] if r["family"] == table["memory"]["family"]], engine, share_weights,
                    card)


def candidates(job: Job, gpus: int) -> list[Layout]:
    """The config's layout first, then the in-process diffusers engine on the trainer's weights (one GPU)."""
    own = Layout(job.layout, job.engine, job.share_weights)
    shared = Layout("in_process", "diffusers", True)
    return [own] + ([shared] if gpus == 1 and own != shared else [])


def _micro_batches(job: Job, gpus: int) -> list[int]:
    """Samples per micro-batch per GPU the job allows, largest first: divisors of a GPU's share of a mini-batch."""
    per_gpu = job.images // job.mini_batches // gpus
    if job.micro_batches is not None:
        return [max(1, per_gpu // job.micro_batches)]
    return [m for m in range(per_gpu, 0, -1) if per_gpu % m == 0]


def _fit(job: Job, sizes: ModelSizes, card: Card, gpus: int, update: UpdateMemory, layout: Layout,
         table: dict) -> tuple[Plan | None, float]:
    """The layout's plan, or (None, the GiB a GPU would need at the smallest micro-batch)."""
    row = engine_row(table, layout.engine, layout.share_weights, card)
    reserve = row["engine_reserve_gib"] if row else table["default_engine_reserve_gib"]
    engine = engine_bytes(sizes, layout, reserve)
    total = card.memory_gib * GIB
    # JAX's share: the measured run's on its card and model (the engine fitting the rest), else all but the engine's
    shares = [row["jax_share"]] if row and abs(row["card_gib"] - card.memory_gib) < 1 and \
        _measured_model(sizes, table) and total * (1 - row["jax_share"]) >= engine else []
    shares.append(math.floor((total - engine) / total * 1000) / 1000)
    for share in shares:
        sizes_ok = [m for m in _micro_batches(job, gpus) if update.resident + update.need(m) <= share * total]
        if sizes_ok:
            break
    smallest = _micro_batches(job, gpus)[-1]
    if not sizes_ok:
        return None, (engine + update.resident + update.need(smallest)) / GIB
    m, measured = sizes_ok[0], share != shares[-1]
    per_gpu = job.images // job.mini_batches // gpus
    why = [f"memory from {update.source}: {update.resident / GIB:.1f} GiB resident, the update "
           f"{update.need(m) / GIB:.1f} GiB at {m} sample(s) ({update.per_sample / GIB:.2f} GiB a sample); "
           f"the engine {engine / GIB:.1f} GiB ({reserve:.1f} GiB working reserve); JAX "
           + (f"{share} of the GPU as the measured run on this card ({row['file']})" if measured
              else "the rest of the GPU"),
           f"{m} sample(s) per micro-batch: the largest that fits" if job.micro_batches is None
           else f"{m} sample(s) per micro-batch: train.num_micro_batches={job.micro_batches}"]
    step = speed = None
    costs = costs_for(table, job.family, layout.engine, layout.share_weights, card)
    measured_families = sorted({r["family"] for r in table["phases"]})
    if job.family not in measured_families:
        why.append(f"no prediction: no costs were measured on the {job.family} family (the table has "
                   f"{', '.join(measured_families)}; python -m jaxflow_bench.phase_costs adds a family's e2e result)")
    elif costs and not _measured_model(sizes, table):
        why.append(f"no prediction: the costs were measured on a {table['memory']['transformer_bytes'] / 1e9:.0f} GB "
                   f"transformer, this one is {sizes.transformer_bytes / 1e9:.2g} GB")
        costs = None
    if costs:
        measured = Work(**costs["work"])
        if job.work is not None and measured != job.work:
            costs = scaled_costs(costs, job.work, table["forward_share"])
            why.append(f"costs scaled to this config's transformer passes per image ({_passes(job.work)}; measured "
                       f"{_passes(measured)})")
        images = job.images / gpus
        step = images * (costs["rollout_s_per_image"] + costs["old_log_prob_s_per_image"]
                         + costs["update_s_per_image"]) + costs["sync_s"] + costs["reward_s"]
        short = short_start(job, card, gpus, table)
        if short:
            step += short[1]
            why.append(f"blocks in a scan, XLA's linears: {short[0]}")
        elif job.scanned and (scan := _scan_row(job, card, table)):
            step += images * scan["step_extra_s_per_image"]
            why.append(f"blocks in a scan, XLA's linears (model.scan_unroll=1, as set): "
                       f"{images * scan['step_extra_s_per_image']:.1f} s a step more than unrolled ({scan['file']})")
        speed = job.images / (step * gpus)
        why.append(f"costs per image measured on {costs['card']} ({costs['file']}: the {costs['family']} family, "
                   f"{costs['micro_batch']} sample(s) per micro-batch)")
    return Plan(card, gpus, layout, m, per_gpu // m, share, round(1 - share, 3), step, speed, tuple(why)), 0.0


def _search(job: Job, sizes: ModelSizes, card: Card, gpus: int, table: dict, update: UpdateMemory,
            layouts: list[Layout]) -> tuple[Plan | None, bool, float, float]:
    """The first plan that fits, in the order a refusal names them: `layouts[0]` at the job's micro-batch, at a
    smaller one (train.num_micro_batches set), then the other layouts at the job's micro-batch, then at a smaller one.
    Returns (that plan or None, whether it takes a smaller micro-batch than the job's, the GiB a GPU needs for
    `layouts[0]` at its smallest micro-batch, the least GiB of any layout)."""
    fits = [_fit(job, sizes, card, gpus, update, layout, table) for layout in layouts]
    (own, short), least = fits[0], min(s for _, s in fits)
    if own:
        return own, False, short, least
    auto = dataclasses.replace(job, micro_batches=None)
    if job.micro_batches is not None:  # a smaller micro-batch of the same layout
        smaller, _ = _fit(auto, sizes, card, gpus, update, layouts[0], table)
        if smaller:
            return smaller, True, short, least
    other = next((p for p, _ in fits[1:] if p), None)
    if other is None and job.micro_batches is not None:  # another layout at a smaller micro-batch
        other = next((p for p in (_fit(auto, sizes, card, gpus, update, layout, table)[0] for layout in layouts[1:])
                      if p), None)
        return other, other is not None, short, least
    return other, False, short, least


def _split(job: Job, gpus: int) -> None:
    if job.images % (job.mini_batches * gpus):
        raise NoFit(f"the batch of {job.images} images does not split into {job.mini_batches} mini-batch(es) over "
                    f"{gpus} GPU(s); use a GPU count that divides {job.images // job.mini_batches}")


def _nothing_fits(card: Card, gpus: int, least: float) -> NoFit:
    return NoFit(f"the model does not fit {gpus} x {card.name} ({card.memory_gib:.0f} GiB) in any layout: at its "
                 f"smallest micro-batch a GPU needs {least:.0f} GiB; a card with that much memory would fit")


def _measured_model(sizes: ModelSizes, table: dict) -> bool:
    """Whether the model is the size the table measured (its transformer within 10%; the measured families'
    transformers are one size)."""
    return abs(sizes.transformer_bytes / table["memory"]["transformer_bytes"] - 1) <= 0.1


def plan_machine(job: Job, sizes: ModelSizes, card: Card, gpus: int, table: dict,
                 update: UpdateMemory | None = None) -> Plan:
    """The plan for `job` on `gpus` x `card`: the config's layout if it fits, else NoFit naming the layout that
    would (its overrides) or the memory a GPU would need."""
    _split(job, gpus)
    layouts = candidates(job, gpus)
    plan, resized, short, least = _search(job, sizes, card, gpus, table,
                                          update or UpdateMemory.from_counts(sizes, table), layouts)
    if plan is None:
        raise _nothing_fits(card, gpus, least)
    if plan.layout == layouts[0] and not resized:
        return plan
    what = f"{gpus} x {card.name} ({card.memory_gib:.0f} GiB)"
    if plan.layout == layouts[0]:
        raise NoFit(f"train.num_micro_batches={job.micro_batches} does not fit {what}: a GPU would need "
                    f"{short:.0f} GiB; what fits: --config.train.num_micro_batches={plan.num_micro_batches} "
                    f"({plan.micro_batch} sample(s) per micro-batch)")
    count = f" --config.train.num_micro_batches={plan.num_micro_batches}" if resized else ""
    raise NoFit(f"layout {layouts[0].name} with the {layouts[0].engine} engine does not fit {what}: a GPU would "
                f"need {short:.0f} GiB; what fits: {plan.layout.overrides()}{count} ({plan.micro_batch} "
                f"sample(s) per micro-batch)")


def plan_first_fit(job: Job, sizes: ModelSizes, card: Card, gpus: int, table: dict, layouts: list[Layout],
                   update: UpdateMemory | None = None) -> tuple[Plan, bool]:
    """rollout.layout='auto': the plan of the first of `layouts` that fits, in the order `plan_machine`'s refusal
    names them, and whether it takes a smaller micro-batch than train.num_micro_batches; NoFit when none fits."""
    _split(job, gpus)
    plan, resized, _, least = _search(job, sizes, card, gpus, table,
                                      update or UpdateMemory.from_counts(sizes, table), layouts)
    if plan is None:
        raise _nothing_fits(card, gpus, least)
    return plan, resized
