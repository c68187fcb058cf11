"""The plan stage: every `auto` of the validated config resolved once, after JAX starts, into a frozen `RunPlan`
that the learner and the driver read (they resolve nothing themselves), logged once at start as one block.

Resolved here: model.lora_gemm (a hardware policy: `lora_gemm`; a short run's start, `_short_start`, takes XLA's),
model.scan_unroll=0 and the train step's XLA options (both follow the resolved linears), model.unroll_upgrade (a start
on the scanned program and the unrolled one to swap to, `unroll_upgrade`), rollout.lora_apply (how the rollout
serves the LoRA), the engines' warm-up request (`warm_up`), train.num_micro_batches ('auto': the largest
micro-batch that fits, `num_micro_batches`) and the placement (backend, devices, engines, samples per micro-batch
per device)."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from jaxflow.config import derived
from jaxflow import families
from jaxflow.config.errors import UserError
from jaxflow.config.sections import RunConfig
from jaxflow.nn.config import ModelOptions


def engine_per_device(rollout, backend: str) -> bool:
    """Whether the rollout runs one engine on each trainer device: the colocated layout's engines on GPUs."""
    return rollout.layout == "colocated" and backend == "gpu" and rollout.num_gpus > 0


def engines(cfg, backend: str, devices: int) -> int:
    """rollout.num_servers as the run takes it: 'auto' is one engine on each of JAX's `devices` (all processes')
    where `engine_per_device` (validation.check_layout refuses another count there), else one."""
    r = cfg.rollout
    if r.num_servers != "auto":
        return r.num_servers
    return devices if engine_per_device(r, backend) else 1


def lora_apply(cfg) -> str:
    """How the rollout serves the LoRA, the engines' `lora_apply`: rollout.lora_apply, 'auto' resolved to the family's
    mode on its engine (`Family.auto_lora_apply`: 'layers', 'merged' or 'folder', each family's per engine), 'layers'
    for 'merged' with a quantized rollout (rollout.quantization: FP8 weights take no merge)."""
    mode = cfg.rollout.lora_apply
    if mode != "auto":
        return mode
    mode = families.of(cfg).auto_lora_apply[cfg.rollout.engine]
    return "layers" if mode == "merged" and cfg.rollout.quantization != "none" else mode


def merged_lora(cfg) -> bool:
    """Whether the rollout serves the LoRA merged into its base weights (`lora_apply`)."""
    return lora_apply(cfg) == "merged"


def warm_up(cfg, start: ModelOptions, num_layers: int) -> bool:
    """Whether each rollout engine runs one request of a rollout call's shape as it starts (`Driver.warmup_request`):
    where it loads in a process of its own (not rollout.layout='in_process', which would wait for it) while the
    trainer starts on unrolled blocks (`start`, the plan's starting program: minutes of compile cold, tens of seconds
    of loading warm, which hide the warm-up; beside a scan's seconds it would only move the first rollout's compile
    from step 1 into the start-up), and does not serve the LoRA as layers (swapped in at the first sync, they would
    redo the compile it warms)."""
    return (cfg.rollout.layout != "in_process" and lora_apply(cfg) != "layers"
            and start.scan_unroll >= num_layers)


def lora_gemm(cfg, num_layers: int, devices: int, on_hopper: bool, micro_batch: int,
              tokens: tuple[int, ...]) -> tuple[str, str]:
    """model.lora_gemm as it runs, and why: "auto" is "pallas" where the fused kernel runs and pays, else "xla".

    It pays with unrolled blocks (model.scan_unroll >= the blocks, or 0, which unrolls them for it); inside a scan it
    is slower (BENCHMARKS.md, the fused LoRA GEMM). It runs on H100/H200s with bf16 compute where the rank tiles its
    16; on several devices under data parallelism, each device on its own rows (micro_batch is per device). A
    linear's rows (micro_batch x `tokens`, the image and the padded text) short of its 128-row tiles are padded
    (`lora_gemm.lora_matmul`); "auto" pads where that adds at most 1/16 of the rows (BENCHMARKS.md, "Two GPUs")."""
    m = cfg.model
    if m.lora_gemm != "auto":
        return m.lora_gemm, "set in the config"
    rows = [micro_batch * t for t in tokens]
    padding = sum(-r % 128 for r in rows) / (sum(rows) or 1)  # no tokens given: no rows to pad
    why = [reason for reason, fails in (
        (f"blocks in a scan (model.scan_unroll={m.scan_unroll} < {num_layers})", 0 < m.scan_unroll < num_layers),
        ("not an H100/H200", not on_hopper), (f"{m.dtype} compute, not bfloat16", m.dtype != "bfloat16"),
        (f"{devices} devices with the weights sharded (sharding.fsdp / sharding.tensor > 1: the kernel takes whole "
         f"weights)", devices > 1 and (cfg.sharding.fsdp != 1 or cfg.sharding.tensor != 1)),
        (f"rows {rows} padded to 128-row tiles would add {padding:.0%} (over 1/16; model.lora_gemm=pallas pads "
         f"them)", padding > 1 / 16),
        (f"LoRA rank {cfg.lora.rank} not a multiple of 16", cfg.lora.rank % 16)) if fails]
    return ("xla", "auto: " + "; ".join(why)) if why else ("pallas", "auto: unrolled blocks, bf16 on H100/H200s")


UNROLL_UPGRADES = ("off", "auto", "on")


def unroll_upgrade(mode: str, planned: ModelOptions, num_layers: int, *, auto_unroll: bool, processes: int,
                   family: str, upgrades: bool, shared: bool = False) -> tuple[bool, str]:
    """model.unroll_upgrade as it runs: whether the run starts on the blocks in a scan with XLA's linears and swaps
    to the `planned` program (its unrolled blocks) once that compiled beside the first steps, and why ("" for "off",
    and for "auto" where the planned blocks scan).
    "auto" upgrades where the plan unrolled the blocks for the fused kernel (`auto_unroll`: model.scan_unroll=0 with
    model.lora_gemm='auto', resolved "pallas" on a long run), "on" wherever the planned blocks are unrolled; a
    family whose model cannot swap (`Family.upgrades`), a run of several processes (all would have to swap at the
    same step) and an engine serving the trainer's own weights (`shared`, rollout.share_weights: it would keep the
    stacks alive beside the unstacked blocks) keep the planned program."""
    if mode == "off" or (mode == "auto" and planned.scan_unroll < num_layers):  # the default says nothing where
        return False, ""  # the blocks scan (short runs, scanned configs)
    if planned.scan_unroll < num_layers:
        return False, (f"{mode}: the planned blocks run in a scan (model.scan_unroll={planned.scan_unroll}): nothing "
                       f"to swap to")
    if mode == "auto" and not (auto_unroll and planned.lora_gemm == "pallas"):
        return False, ("auto: the blocks are unrolled as the config sets them, not by the plan for the fused kernel; "
                       "model.unroll_upgrade='on' upgrades them too")
    if not upgrades:
        return False, f"{mode}: {family}'s model cannot swap to unrolled blocks mid-run; it runs them from the start"
    if processes > 1:
        return False, (f"{mode}: {processes} processes would all have to swap at the same step; the unrolled blocks "
                       f"run from the start")
    if shared:
        return False, (f"{mode}: the engine serves the trainer's stacked weights (rollout.share_weights): unstacked, "
                       f"they would be held twice; the unrolled blocks run from the start")
    return True, (f"{mode}: the blocks start in a scan with XLA's linears (the short-run program, seconds to compile); "
                  f"the unrolled ones compile beside the first steps and take over at the next step boundary")


@dataclasses.dataclass(frozen=True)
class Upgrade:
    """The program the run swaps to once it compiled beside the first steps (model.unroll_upgrade)."""

    model: ModelOptions  # unrolled blocks, the planned linears
    xla_options: Mapping  # their train step's


def per_update(cfg) -> int:
    """Samples in one update (a mini-batch), all devices'."""
    return cfg.sample.prompts_per_step * cfg.sample.group_size // cfg.train.num_mini_batches


def micro_batch_size(cfg, batch_devices: int, num_micro_batches: int) -> int:
    """Samples in one micro-batch on one device with `num_micro_batches` an update."""
    return max(1, per_update(cfg) // num_micro_batches // batch_devices)


def num_micro_batches(cfg, folder: Path, backend: str, batch_devices: int) -> tuple[int, str]:
    """train.num_micro_batches as the run takes it, and why. 'auto' keeps the mini-batch and takes the largest
    micro-batch that fits: on the CPU (no device memory to fit) the whole mini-batch; on a GPU the largest that the
    planner's memory model admits for the card (jaxflow/config/planner.py: nvidia-smi's card, the folder's
    sizes), which the compiled step's memory analysis then corrects (`Learner.check_memory`)."""
    micro = cfg.train.num_micro_batches
    if micro != "auto":
        return micro, "as set"
    if backend == "cpu":
        return 1, "auto: the whole mini-batch, the CPU has no device memory to fit"
    from jaxflow.config import machine
    from jaxflow.config import planner
    found = machine.local_gpus()
    if found is None:
        return 1, (f"auto: no card to size it for (nvidia-smi found no GPU on {backend}): the whole mini-batch, "
                   f"then the compiled step's memory check")
    try:
        plan = planner.plan_machine(machine.job_of(cfg), machine.model_sizes(cfg, folder), found[0], batch_devices,
                                    planner.load_table())
    except (UserError, planner.NoFit) as exc:
        return per_update(cfg) // batch_devices, f"auto: 1 sample, the memory model fits no micro-batch ({exc})"
    return plan.num_micro_batches, f"auto: the largest that the memory model admits on a {found[0].name}"


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """What the run does where the config says `auto`, resolved once (`make_plan`)."""

    backend: str  # JAX's
    devices: int  # JAX's, all processes'
    batch_devices: int  # the ways the batch is split (the mesh's batch axes)
    micro_batch: int  # samples in one micro-batch on one device
    num_micro_batches: int  # micro-batches of one update: train.num_micro_batches, 'auto' resolved
    micro_batch_why: str  # why num_micro_batches is what it is
    layout: str  # rollout.layout
    engines: int  # rollout engines (rollout.num_servers)
    lora_apply: str  # how the rollout serves the LoRA (the engines' lora_apply): "layers", "merged" or "folder"
    quantization: str  # the rollout DiT's linears (rollout.quantization): "none" (bf16) or "fp8"
    warmup: bool  # each engine runs one request of a rollout call's shape as it starts (`warm_up`)
    lora_gemm_why: str  # why model.lora_gemm (model.lora_gemm below) resolved as it did
    model: ModelOptions  # the trainer model's options: lora_gemm and scan_unroll resolved
    xla_options: Mapping  # the train step's XLA options: for the linears the model runs and, on a GPU, a quick start
    upgrade: Upgrade | None = None  # the unrolled program the run swaps to (model.unroll_upgrade), or None
    upgrade_why: str = ""  # why it does or does not ("" with model.unroll_upgrade='off')

    def resized(self, num_micro_batches: int, micro_batch: int, why: str) -> RunPlan:
        """The plan with another micro-batch (train.num_micro_batches='auto' after the compiled step's memory check);
        the trainer's linears stay as planned."""
        return dataclasses.replace(self, num_micro_batches=num_micro_batches, micro_batch=micro_batch,
                                   micro_batch_why=why)

    def summary(self) -> str:
        """The plan as one compact block, logged once at start."""
        m = self.model
        return "\n".join((
            f"plan: {self.devices} {self.backend} device(s), batch over {self.batch_devices}, {self.micro_batch} "
            f"sample(s) per micro-batch per device, {self.num_micro_batches} micro-batch(es) an update "
            f"(train.num_micro_batches: {self.micro_batch_why})",
            f"  trainer linears: model.lora_gemm={m.lora_gemm} ({self.lora_gemm_why}); model.scan_unroll="
            f"{m.scan_unroll}; XLA options {dict(self.xla_options) or '{}'}",
            f"  rollout: layout {self.layout}, {self.engines} engine(s), LoRA served as {self.lora_apply} "
            f"(rollout.lora_apply), quantization {self.quantization} (rollout.quantization)"
            f"{', a warm-up request as each engine starts' if self.warmup else ''}",
            *self._upgrade_lines()))

    def _upgrade_lines(self) -> tuple[str, ...]:
        if not self.upgrade_why:
            return ()
        u = self.upgrade
        to = (f"; then model.lora_gemm={u.model.lora_gemm}, model.scan_unroll={u.model.scan_unroll}, XLA options "
              f"{dict(u.xla_options) or '{}'}") if u else ""
        return (f"  unroll upgrade (model.unroll_upgrade): {self.upgrade_why}{to}",)


def _tokens(cfg, family, folder: Path) -> tuple[int, int, int]:
    """(image, prompt, negative prompt) tokens of a sample: the family's image tokens (its latent grid and any
    conditioning images'), the text's."""
    try:
        image = family.image_tokens(folder, cfg)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return (image, *derived.text_tokens(cfg))


def _short_start(cfg: RunConfig, batch_devices: int) -> str | None:
    """The planner's short-run start (`planner.short_start`) on this machine's card, with the batch over
    `batch_devices` GPUs: why the blocks go in a scan with XLA's linears, or None."""
    from jaxflow.config import machine
    from jaxflow.config import planner
    found = machine.local_gpus()
    short = found and planner.short_start(machine.job_of(cfg), found[0], batch_devices, planner.load_table())
    return short[0] if short else None


def make_plan(cfg: RunConfig, folder: Path, *, backend: str, devices: int, batch_devices: int, on_hopper: bool,
              processes: int = 1) -> RunPlan:
    """The validated config's plan on this machine (`backend`, `devices`, `on_hopper`, `processes`: JAX's, after it
    starts) for the model in `folder` (its depth and latent grid: the family's) with the batch split `batch_devices`
    ways."""
    family = families.of(cfg)
    num_layers = family.num_layers(folder)
    count, count_why = num_micro_batches(cfg, folder, backend, batch_devices)
    micro = micro_batch_size(cfg, batch_devices, count)
    tokens = _tokens(cfg, family, folder) if cfg.model.lora_gemm == "auto" and on_hopper else ()  # else "xla"
    gemm, why = lora_gemm(cfg, num_layers, devices, on_hopper, micro, tokens)
    if gemm != "xla" and not family.fused_gemm:
        gemm, why = "xla", f"{family.name}'s layers have no fused-kernel path"
    short = _short_start(cfg, batch_devices) if gemm == "pallas" else None
    if short:  # model.scan_unroll=0 then scans the blocks: "xla" runs them in a scan
        gemm, why = "xla", short
    from jaxflow.trainer.start_options import with_start_options  # JAX's backend is up: it probes XLA's options
    model = derived.model_options(cfg, gemm, num_layers)
    swaps, upgrade_why = unroll_upgrade(cfg.model.unroll_upgrade, model, num_layers, processes=processes,
                                        auto_unroll=cfg.model.scan_unroll == 0 and cfg.model.lora_gemm == "auto",
                                        family=family.name, upgrades=family.upgrades,
                                        shared=cfg.rollout.share_weights)
    upgrade = None
    if swaps:  # the start: the short run's program
        upgrade = Upgrade(model, MappingProxyType(with_start_options(derived.xla_options(cfg, gemm))))
        gemm, why = "xla", f"until the unroll upgrade, then {model.lora_gemm} ({why})"
        model = dataclasses.replace(model, scan_unroll=1, lora_gemm=gemm)
    return RunPlan(backend=backend, devices=devices, batch_devices=batch_devices, micro_batch=micro,
                   num_micro_batches=count, micro_batch_why=count_why,
                   layout=cfg.rollout.layout, engines=engines(cfg, backend, devices),
                   lora_apply=lora_apply(cfg), quantization=cfg.rollout.quantization,
                   warmup=warm_up(cfg, model, num_layers),
                   lora_gemm_why=why,
                   model=model, xla_options=MappingProxyType(with_start_options(derived.xla_options(cfg, gemm))),
                   upgrade=upgrade, upgrade_why=upgrade_why)
