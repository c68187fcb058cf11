"""The run directory before any heavy work: a new run never writes into an old one; a resume checks its config.

A run writes `OUTPUTS` under `config.run_dir`. A new run refuses a run_dir holding any of them, unless told to
`overwrite` (then they are deleted first). A resume compares the config saved with the newest checkpoint to the
current one and refuses differences in keys that change the training, unless told to allow them. The keys in
`NOT_TRAINING` may differ: where and how often outputs are written, evaluation, the step budget, and how the work
is placed on machines (rollout servers and their resources, sharding, micro-batches, rematerialization, the
attention kernel), none of which changes what an update computes. A multi-process run checks first that every
process sees the same run_dir (`check_shared`).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import socket
import tempfile
from pathlib import Path

from jaxflow.run import run_lock, wandb_log
from jaxflow.trainer.checkpoint import config_json
from jaxflow.config.errors import UserError
from jaxflow.config.sections import RunConfig

log = logging.getLogger("jaxflow.run.run_dir")

OUTPUTS = ("metrics.jsonl", "checkpoints", "eval", "tb", "lora_final", "wandb", wandb_log.ID_FILE)
NOT_TRAINING = ("run_dir", "train.num_steps", "log", "eval", "checkpoint", "rollout.address", "rollout.num_servers",
                "rollout.num_cpus", "rollout.num_gpus", "rollout.max_retries", "rollout.layout",
                "rollout.in_process",  # runs before rollout.layout named it
                "rollout.sleep_while_training", "rollout.compile", "rollout.cfg_forward", "rollout.bagel_deploy",
                "reward.workers", "sharding",
                "train.num_micro_batches", "model.remat", "model.attention", "model.scan_unroll", "model.lora_gemm",
                "model.unroll_upgrade",
                "train.xla_options", "profile",
                # when a diverged or mismatched run stops, not what an update computes
                "train.max_skipped_steps", "train.logp_gate", "train.logp_gate_steps",
                "train.sync_verify", "train.sync_fault_from")


def previous_outputs(run_dir: Path) -> list[str]:
    return [name for name in OUTPUTS if (run_dir / name).exists()]


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the finished checkpoints (orbax renames a save's folder to its step when complete), newest first."""
    folder = run_dir / "checkpoints"
    return sorted((int(p.name) for p in folder.iterdir() if p.name.isdigit()), reverse=True) if folder.is_dir() else []


def check_fresh(run_dir: Path) -> None:
    """Refuse a run_dir that holds a previous run's outputs (nothing in it is touched)."""
    found = previous_outputs(run_dir)
    if found:
        raise UserError(f"{run_dir} already holds a run ({', '.join(found)}): continue it with --resume, start a "
                        f"new one with --config.run_dir=NEW_DIR, or delete it with --overwrite")


def flatten(tree: dict, prefix: str = "") -> dict:
    """{'a.b': value} of a nested dict."""
    out = {}
    for k, v in tree.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def config_changes(saved: dict, current: dict) -> list[str]:
    """'key: saved -> current' for each key that changes the training (see `NOT_TRAINING`)."""
    a, b = flatten(saved), flatten(current)
    show = lambda tree, k: repr(tree[k]) if k in tree else "(absent)"  # noqa: E731
    return [f"{k}: {show(a, k)} -> {show(b, k)}" for k in sorted(a.keys() | b.keys())
            if (k in a, a.get(k)) != (k in b, b.get(k))
            and not any(k == n or k.startswith(n + ".") for n in NOT_TRAINING)]


def saved_config(run_dir: Path) -> tuple[int, dict] | None:
    """(step, config) of the run's newest checkpoint whose metadata reads; None without one."""
    return _saved_config(run_dir, checkpoint_steps(run_dir))


def _saved_config(run_dir: Path, steps: list[int]) -> tuple[int, dict] | None:
    """(step, config) of the newest checkpoint whose metadata reads."""
    for step in steps:
        try:
            meta = json.loads((run_dir / "checkpoints" / str(step) / "meta" / "metadata").read_text())
            return step, json.loads(meta["config"])
        except (OSError, ValueError, KeyError):
            continue
    return None


def check_resume(cfg: RunConfig, allow_config_changes: bool = False) -> str | None:
    """Checks a resume of `cfg.run_dir`, the config first: a message when the run is already finished (its
    lora_final written, nothing to do), else None. A run stopped at its last step before exporting its LoRA (a stop
    request after the last step's checkpoint, or `--config.train.num_steps` lowered to a stopped run's newest
    checkpoint) resumes to export `lora_final` only. Raises UserError when there is no checkpoint (naming
    --overwrite when the run's outputs hold none that restores), the config changed in keys that change the
    training, or a stopped run's newest checkpoint lies past train.num_steps."""
    run_dir = Path(cfg.run_dir)
    steps = checkpoint_steps(run_dir)
    if not steps:
        if previous_outputs(run_dir):  # outputs, but nothing that resumes (e.g. every checkpoint set aside)
            damaged = sorted(p.name for p in (run_dir / "checkpoints").glob("*.damaged"))
            raise UserError(f"--resume: {run_dir} holds no checkpoint that restores"
                            + (f" ({', '.join(damaged)} set aside as damaged)" if damaged else "")
                            + ": start it again with --overwrite (deletes its outputs), or use a new run_dir")
        raise UserError(f"--resume: {run_dir / 'checkpoints'} holds no checkpoint: start without --resume")
    saved = _saved_config(run_dir, steps)
    changes = config_changes(saved[1], json.loads(config_json(cfg))) if saved else []
    if changes and not allow_config_changes:
        raise UserError(f"--resume: the config differs from the one checkpoint {saved[0]} was trained with, in keys "
                        f"that change the training (saved -> now):\n  " + "\n  ".join(changes) +
                        "\nPass the same overrides as that run, or add --allow_config_changes to train on with these")
    finished = (run_dir / "lora_final").exists()
    if steps[0] > cfg.train.num_steps and not finished:
        raise UserError(f"--resume: the newest checkpoint of {run_dir} is step {steps[0]}, past train.num_steps="
                        f"{cfg.train.num_steps}: pass --config.train.num_steps={steps[0]} or more to go on")
    if steps[0] >= cfg.train.num_steps and finished:
        return (f"{run_dir} is finished: its newest checkpoint is step {steps[0]} of train.num_steps="
                f"{cfg.train.num_steps} (LoRA in {run_dir / 'lora_final'}); raise --config.train.num_steps to go on")
    for change in changes:
        log.warning("resuming with a changed config: %s", change)
    return None


def preflight(cfg: RunConfig, *, resume: bool, overwrite: bool = False, allow_config_changes: bool = False) -> str | None:
    """The run_dir checks of the command line, before any model, device or Ray: None to go on, or a message when a
    resumed run is already finished. The first process locks run_dir first (`run_lock`: a run_dir another run holds
    is refused, never overwritten). `overwrite` deletes a previous run's outputs (on the first process only)."""
    if resume and overwrite:
        raise UserError("--resume continues the run in config.run_dir, --overwrite deletes it: pass one of them")
    check_writable(Path(cfg.run_dir))
    if first_process() and (not resume or Path(cfg.run_dir).is_dir()):  # a resume of no run_dir is refused below
        run_lock.acquire(Path(cfg.run_dir))
    if resume:
        return check_resume(cfg, allow_config_changes)
    run_dir = Path(cfg.run_dir)
    if not overwrite:
        check_fresh(run_dir)
    elif first_process():
        for name in previous_outputs(run_dir):
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            log.warning("--overwrite: deleted %s", path)
    return None


def check_writable(run_dir: Path) -> None:
    """UserError unless a file can be made in `run_dir`, or where it does not exist yet in its nearest existing
    parent: a probe file, removed at once (permission bits do not stop root; a read-only filesystem, a path through
    a file or a quota do)."""
    folder = run_dir.absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"config.run_dir: {run_dir} lies under {folder}, a file, not a folder: pass a "
                        f"--config.run_dir=DIR in a writable folder")
    try:
        handle, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(f"config.run_dir: cannot write in {folder} ({exc.strerror or exc}): pass a "
                        f"--config.run_dir=DIR in a writable folder") from None


def check_shared(run_dir: Path) -> None:
    """Every JAX process must see one run_dir (a filesystem they share): checkpoints are written by all of them and
    read back by all on --resume. Each process writes a marker named by a nonce from process 0, then each looks for
    everyone's; UserError on every process, naming those that see only part, if any is missing. The markers are
    removed either way; one process does nothing."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return
    nonce = int(multihost_utils.broadcast_one_to_all(np.int32(secrets.randbits(31))))
    marker = lambda i: run_dir / f".process-{i}-of-{n}.{nonce}"  # noqa: E731
    run_dir.mkdir(parents=True, exist_ok=True)
    marker(me).write_text(socket.gethostname())
    multihost_utils.sync_global_devices("run_dir markers written")
    sees_all = all(marker(i).exists() for i in range(n))
    seen = multihost_utils.process_allgather(np.int32(sees_all))
    marker(me).unlink()
    partial = [i for i in range(n) if not seen[i]]
    if partial:
        raise UserError(f"run_dir {run_dir} is not one folder for all {n} JAX processes: process(es) {partial} do "
                        f"not see the others' files in it; put run_dir on a filesystem every host mounts at that "
                        f"path (NFS, Lustre, a bucket mount)")


def first_process() -> bool:
    """Process 0 of a multi-process job by its launcher's environment (JAX is not initialized yet)."""
    env = os.environ
    rank = env.get("JAX_PROCESS_ID") or env.get("SLURM_PROCID") or env.get("OMPI_COMM_WORLD_RANK") or "0"
    return int(rank) == 0


def summary(run_dir: Path, step: int, num_steps: int, ray_logs: str | None = None,
            skipped: list[int] = ()) -> str:
    """Where every output of the run went: the last lines of its log; `skipped`: the steps that skipped an update."""
    run_dir = run_dir.resolve()
    lines = [f"{'finished' if step >= num_steps else 'stopped'} at step {step}/{num_steps}; outputs in {run_dir}:"]
    if skipped:
        lines.append(f"  skipped      an update at {len(skipped)} step(s) ({', '.join(map(str, skipped))}): a "
                     f"non-finite loss, gradient or LoRA; no checkpoint of them (loss, grad_norm in metrics.jsonl)")
    if (run_dir / "metrics.jsonl").exists():
        lines.append(f"  metrics      {run_dir / 'metrics.jsonl'} (one JSON row per step)")
    if (run_dir / "tb").exists():
        import importlib.util
        view = (f"tensorboard --logdir {run_dir / 'tb'}" if importlib.util.find_spec("tensorboard") else
                f"{run_dir / 'tb'} (event files; to view them: pip install tensorboard, then tensorboard --logdir "
                f"{run_dir / 'tb'})")
        lines.append(f"  tensorboard  {view}")
    if (run_dir / wandb_log.ID_FILE).exists():
        lines.append(f"  wandb        run {(run_dir / wandb_log.ID_FILE).read_text().strip()} (an offline run's files: "
                     f"{run_dir / 'wandb'}; `wandb sync` uploads them)")
    images = sorted((run_dir / "eval").glob("step_*.png"))
    if images:
        lines.append(f"  eval grids   {run_dir / 'eval'} (the newest {images[-1].name}; {len(images)} in all)")
    steps = checkpoint_steps(run_dir)
    if steps:
        lines.append(f"  checkpoints  {run_dir / 'checkpoints'} (steps {', '.join(map(str, steps[::-1]))}; "
                     f"--resume continues from the newest)")
    if (run_dir / "lora_final").exists():
        lines.append(f"  final LoRA   {run_dir / 'lora_final'} (PEFT adapter)")
    if ray_logs:
        lines.append(f"  Ray logs     {ray_logs} (rollout actors)")
    return "\n".join(lines)
