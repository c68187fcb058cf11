"""The machine plan of a config (jaxflow/config/planner.py) on this machine's GPUs: the model's sizes from its folder's
safetensors headers, the GPUs from nvidia-smi; `before_jax` sets JAX's share of each GPU from it before JAX starts,
`compilation_cache` points JAX's persistent cache at the cache folder. `python -m jaxflow.plan` prints it."""
from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

from jaxflow.config import planner
from jaxflow.config.work import work_of
from jaxflow.config.errors import UserError

COMPONENTS = ("transformer", "text_encoder", "vae")


def local_gpus() -> tuple[planner.Card, int] | None:
    """(the first visible GPU as a Card, how many are visible) as nvidia-smi reports them (`visible_gpus`), or None
    without one: a run given one GPU of a host plans for one."""
    gpus = visible_gpus()
    if not gpus:
        return None
    _, _, name, mib = gpus[0]
    return planner.Card(name, float(mib) / 1024), len(gpus)


def visible_gpus() -> list[list[str]]:
    """nvidia-smi's [index, uuid, name, MiB] rows of the GPUs this process sees (`visible`); [] without nvidia-smi."""
    try:
        lines = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,name,memory.total",
                                "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=60, check=True).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return []
    return visible([[f.strip() for f in line.split(",")] for line in lines if line.strip()])


def visible(gpus: list[list[str]], env: str | None = None) -> list[list[str]]:
    """The [index, uuid, name, MiB] rows of `gpus` that CUDA_VISIBLE_DEVICES (or `env`) lets a process see, in its
    order (indices or UUIDs, read as CUDA does: up to the first that names no GPU); all of them when it is unset."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES") if env is None else env
    if env is None:
        return gpus
    out = []
    for token in (t.strip() for t in env.split(",")):
        match = [g for g in gpus if token and (g[0] == token or g[1].startswith(token) and token.startswith("GPU-"))]
        if not match:
            break
        out.append(match[0])
    return out


def _weights(folder: Path) -> list[tuple[str, tuple[int, ...], int]]:
    """(key, shape, bytes) of every tensor in a component folder's safetensors files (their headers only)."""
    from jaxflow_bridge.contract.safetensors_io import SafetensorsFile
    out = []
    for path in sorted(folder.glob("*.safetensors")):
        f = SafetensorsFile(path)
        out += [(k, f.shape(k), int(f.dtype(k).itemsize * _count(f.shape(k)))) for k in f.keys()]
    return out


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def model_sizes(cfg, folder: Path) -> planner.ModelSizes:
    """The folder's weights as the plan sees them (bytes per component, the LoRA's parameters over the targeted
    linears, the depth) and a sample's tokens (the family's image tokens and the prompt's). With
    model.init=random a transformer/ without weights is sized from its config (`Family.random_weights`)."""
    from jaxflow import families
    from jaxflow.config import derived
    family = families.of(cfg)
    weights = {c: _weights(folder / c) for c in COMPONENTS}
    if not weights["transformer"] and cfg.model.init == "random":  # drawn on the devices: sized from its config
        weights["transformer"] = family.random_weights(folder)
    missing = [c for c in COMPONENTS if not weights[c]]
    if missing:
        raise UserError(f"model.path: {folder} has no safetensors weights in {', '.join(missing)}: the plan sizes "
                        f"the model from them; give a folder with its weights")
    targets = tuple(cfg.lora.targets)
    lora = sum(cfg.lora.rank * sum(shape) for key, shape, _ in weights["transformer"]
               if len(shape) == 2 and key.endswith(".weight") and key[:-len(".weight")].endswith(targets))
    try:
        image = family.image_tokens(folder, cfg)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    total = {c: sum(b for *_, b in weights[c]) for c in COMPONENTS}
    return planner.ModelSizes(transformer_bytes=total["transformer"], text_encoder_bytes=total["text_encoder"],
                              vae_bytes=total["vae"], lora_params=lora, layers=family.num_layers(folder),
                              tokens=image + derived.text_tokens(cfg)[0])


def job_of(cfg) -> planner.Job:
    s, t, r = cfg.sample, cfg.train, cfg.rollout
    micro = t.num_micro_batches
    return planner.Job(family=cfg.model.family, images=s.prompts_per_step * s.group_size,
                       mini_batches=t.num_mini_batches, micro_batches=None if micro == "auto" else micro,
                       engine=r.engine, layout=r.layout, share_weights=bool(r.share_weights), work=work_of(cfg),
                       steps=t.num_steps, max_minutes=t.max_minutes,
                       auto_unroll=cfg.model.scan_unroll == 0 and cfg.model.lora_gemm == "auto",
                       scanned=cfg.model.scan_unroll == 1 and cfg.model.lora_gemm != "pallas")


def _machine(gpus: int | None = None, gpu_memory: float | None = None) -> tuple[planner.Card, int] | None:
    """The card and GPU count to plan for: this machine's (nvidia-smi), or `gpus` x a `gpu_memory` GiB card; None
    without a GPU and without `gpu_memory`."""
    found = local_gpus()
    if gpu_memory is not None:
        card = planner.Card(found[0].name if found and abs(found[0].memory_gib - gpu_memory) < 1
                            else f"a {gpu_memory:g} GiB card", gpu_memory)
    elif found:
        card = found[0]
    else:
        return None
    return card, gpus or (found[1] if found else 1)


def machine_plan(cfg, gpus: int | None = None, gpu_memory: float | None = None) -> planner.Plan | None:
    """The validated config's plan on this machine's GPUs (or `gpus` x a `gpu_memory` GiB card); None without a
    GPU and without `gpu_memory`. NoFit (a UserError line) when it cannot fit."""
    from jaxflow.config import validation
    machine = _machine(gpus, gpu_memory)
    if machine is None:
        return None
    sizes = model_sizes(cfg, validation.model_folder(cfg))
    return planner.plan_machine(job_of(cfg), sizes, *machine, planner.load_table())


def resolve_layout(cfg, gpus: int | None = None, gpu_memory: float | None = None,
                   resume: bool = False) -> tuple[object, str | None]:
    """rollout.layout='auto' resolved once, before the validated config is used: the config with the layout chosen
    (rollout.layout, rollout.engine, rollout.share_weights, and train.num_micro_batches where that layout needs a
    smaller micro-batch than the one set; rollout.compile on where it switches a GPU rollout to the diffusers
    engine, as that engine was measured), validated again, and the plan block's line saying what was chosen and why.
    A pinned layout comes back as it is (and None).

    The choice: a resumed run's layout as its newest checkpoint saved it (a smaller micro-batch of it where this card
    needs one); else on a GPU rollout the first layout that fits the card (`planner.plan_first_fit`): the config's
    engine colocated, else (one GPU, a family the diffusers engine serves) the diffusers engine in the trainer's
    process on its weights. Without a card to plan for (a CPU rollout, no GPU found) or where none fits (the plan
    block then says what would), the first of them."""
    from jaxflow import families
    from jaxflow.config import validation
    from jaxflow.run.run_dir import saved_config
    r = cfg.rollout
    if r.layout != "auto":
        return cfg, None
    saved = saved_config(Path(cfg.run_dir)) if resume else None
    old = saved[1].get("rollout", {}) if saved else {}
    resumed = old.get("layout") in validation.PLACED
    if resumed:
        first = planner.Layout(old["layout"], old.get("engine", r.engine), bool(old.get("share_weights")))
        why = f"the layout of checkpoint {saved[0]}, which --resume continues"
    else:
        first, why = planner.Layout("colocated", r.engine, False), ""
    on_gpu = str(r.device).startswith("cuda")
    machine = _machine(gpus, gpu_memory) if on_gpu else None
    chosen, micro = first, None
    if machine is None:
        why = why or f"no card to plan for ({'nvidia-smi found no GPU' if on_gpu else f'rollout.device={r.device!r}'})"
    else:
        card, count = machine
        job = dataclasses.replace(job_of(cfg), engine=first.engine, layout=first.name,
                                  share_weights=first.share_weights)
        engines = families.of(cfg).engines  # the planner's candidates that the family's engines serve
        layouts = [first] if resumed else [c for c in planner.candidates(job, count) if c.engine in engines]
        what = f"{count} x {card.name} ({card.memory_gib:.0f} GiB)"
        try:
            plan, resized = planner.plan_first_fit(job, model_sizes(cfg, validation.model_folder(cfg)), card, count,
                                                   planner.load_table(), layouts)
        except (UserError, planner.NoFit) as exc:
            why = why or f"none fits {what} ({exc})"
        else:
            chosen, micro = plan.layout, plan.num_micro_batches if resized else None
            why = why or (f"the first layout that fits {what}" + (
                f"; {first.name} with the {first.engine} engine does not" if chosen != first else ""))
    return _with_layout(cfg, chosen, micro, why)


def _with_layout(cfg, layout: planner.Layout, micro: int | None, why: str) -> tuple[object, str]:
    """`cfg` with `layout` (and `micro` micro-batches an update), validated again; the line saying so."""
    from ml_collections import ConfigDict

    from jaxflow.config import validation
    user = ConfigDict(cfg.to_dict())
    user.rollout.update(layout=layout.name, engine=layout.engine, share_weights=layout.share_weights)
    if micro is not None:
        user.train.num_micro_batches = micro
    switched = f" (in place of rollout.engine={cfg.rollout.engine!r})" if layout.engine != cfg.rollout.engine else ""
    if switched and layout.engine == "diffusers" and str(cfg.rollout.device).startswith("cuda"):
        user.rollout.compile = True  # as the diffusers engine ran where it was measured (the planner's costs)
        switched += ", rollout.compile=True"
    shared = " on the trainer weights" if layout.share_weights else ""
    count = f", train.num_micro_batches={micro}" if micro else ""
    line = f"layout auto: {layout.name}, the {layout.engine} engine{shared}{switched}{count}: {why}"
    try:
        return validation.validate(user), line
    except UserError as exc:
        raise UserError(f"{exc} ({line}; pin rollout.layout to choose another)") from None


@dataclasses.dataclass(frozen=True)
class JaxShare:
    """The share of each GPU that `before_jax` gave JAX itself (XLA_PYTHON_CLIENT_MEM_FRACTION), of a card of
    `card_bytes` (nvidia-smi's total): what the trainer checks JAX's pool against once JAX has started."""

    fraction: float
    card_bytes: int


_share: JaxShare | None = None  # what before_jax set in this process (`share_set`)


def share_set() -> JaxShare | None:
    """The share the last `before_jax` of this process set from the plan; None where it set none (no GPU, a CPU
    rollout, no plan, or the user's own XLA_PYTHON_CLIENT_MEM_FRACTION / XLA_CLIENT_MEM_FRACTION)."""
    return _share


def before_jax(cfg, chosen: str | None = None) -> str | None:
    """At a run's start, before JAX initialises: the plan block for this machine's GPUs (None without one, or on a
    CPU rollout), after `chosen` (`resolve_layout`'s line, when rollout.layout was 'auto'), and JAX's share of each
    GPU from it (XLA_PYTHON_CLIENT_MEM_FRACTION, a fixed pool) where the user set neither fraction variable (setting
    both makes jax >= 0.11 ignore the GPU); the share it set is kept (`share_set`). A plan that cannot be made or
    does not fit is one `plan:` line; the compiled step's memory check then decides."""
    global _share
    block, _share = _plan_block(cfg)
    return "\n".join(line for line in (chosen, block) if line) or None


def _plan_block(cfg) -> tuple[str | None, JaxShare | None]:
    """The plan block and the share of each GPU set from it (None where none was set)."""
    if not str(cfg.rollout.device).startswith("cuda"):
        return None, None
    try:
        plan = machine_plan(cfg)
    except (UserError, planner.NoFit) as exc:
        return f"plan: none ({exc}); JAX's memory share is left to the environment", None
    if plan is None:
        return None, None
    if {"XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"} & set(os.environ):
        return plan.summary(), None  # the user's share
    os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{plan.jax_share}"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    return plan.summary(), JaxShare(plan.jax_share, round(plan.card.memory_gib * planner.GIB))


def cache_root() -> Path:
    """`$JAXFLOW_CACHE`, default ~/.cache/jaxflow: JAX's compiles go under it (`compilation_cache`) and the
    vllm_omni engine's torch compile caches (the engine config's `compile_cache`)."""
    return Path(os.environ.get("JAXFLOW_CACHE") or Path.home() / ".cache" / "jaxflow")


MIN_COMPILE_SECS = 0.0  # the persistent cache keeps every compile: a warm start then compiles nothing again


def compilation_cache(enabled: bool) -> Path | None:
    """JAX's persistent compilation cache in `$JAXFLOW_CACHE/xla` (default ~/.cache/jaxflow/xla), keyed by JAX on
    the compiled program and its options, so a changed config recompiles; JAX_COMPILATION_CACHE_DIR, when set, wins.
    Beside it the executable cache (`jaxflow.trainer.executable_cache`: the train step's executables, keyed without
    tracing) in `$JAXFLOW_CACHE/executables`, or `executables/` in JAX_COMPILATION_CACHE_DIR when that is set.
    Every compile is stored, however short (`MIN_COMPILE_SECS`; JAX's default keeps those over 1 s, so a warm start
    compiled again the start's many small programs); JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS, when set, wins.
    Returns the persistent cache's folder in use (None: both off)."""

    import jax

    from jaxflow.trainer import executable_cache
    if not enabled:
        executable_cache.use(None)
        return None
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        folder = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
        executable_cache.use(folder / "executables")
        return folder
    root = cache_root()
    jax.config.update("jax_compilation_cache_dir", str(root / "xla"))
    executable_cache.use(root / "executables")
    return root / "xla"
