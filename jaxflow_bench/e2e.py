"""End-to-end `python -m jaxflow.train` benchmarks with random full-size weights, each layout an argument.

    python -m jaxflow_bench.e2e OUT [--layout inproc|1gpu|2gpu|2gpu_colocated|node] [--recipe FAMILY]
        [--config FILE] [--device cuda|cpu] [--engine vllm_omni|diffusers] [--sleep true|false] [--prompts 2]
        [--micro N] [--per-call N] [--steps N] [--reward NAME] [--result NAME] [--model-dir DIR] [--profile-step K]
        [--one-gpu FILE] [--quantization fp8] [--config.x=y ...]
    python -m jaxflow_bench.e2e OUT --scaling [--layouts 2gpu_colocated 2gpu] [--config.x=y ...]
    python -m jaxflow_bench.e2e OUT --arms flowgrpo guard corrected dropzero nft mixgrpo mixgrpo_flash awm
        [--config.x=y ...]

One run: a family's recipe (--recipe, default the registry's DEFAULT: its spec.py E2E names the config, e.g.
configs/qwen_ocr.py or configs/bagel_ocr.py) at its own settings with only the prompts per step cut (--prompts,
default 2; prompts per rollout call min(4, prompts / 2), or --per-call; a one-GPU recipe one),
train.num_micro_batches scaled so that a micro-batch keeps the recipe's size (or --micro samples), 4 steps
(--steps), no eval or checkpoints. The random folder (--model-dir, default the E2E folder, e.g. /tmp/qwen_random or
/tmp/bagel_random) is written if missing. The log goes to OUT/train.log, each line stamped with the time of day; the
GPUs' memory is read by nvidia-smi every 0.5 s; OUT/RESULT.json gets `jaxflow_bench.summary`'s figures (RESULT
default e2e_ENGINE_LAYOUT, e2e_FAMILY_LAYOUT for another family's recipe, e2e_8gpu for the node), rewritten
after each step past the first, marked partial until the run ends (run_result.py: a run cut short leaves one).
--config.x=y arguments go to the trainer.
--config FILE runs that recipe on the model it names (--model-dir replaces it; nothing is written). --device cpu
runs inproc or 1gpu on the CPU with jaxflow.train's CPU_OVERRIDES (the tiny recipe: --config configs/tiny_ocr.py):
no memory is read there, nor without nvidia-smi, and the result has no peak_gib; RESULT default e2e_cpu_LAYOUT.
The micro-batch defaults to the family's E2E `micro` where it names one (an edit family's rows carry the reference
image's tokens too), else the recipe's; at most an update's samples per device.

Layouts (JAX gets a fixed pool, XLA_CLIENT_MEM_FRACTION, where it shares a GPU):
  inproc  one GPU, the diffusers engine in the trainer's process (no Ray); pool 0.5
  1gpu    one GPU shared by the trainer and a Ray rollout actor (num_gpus=1); pool 0.56 (a one-GPU recipe 0.5); with
          --sleep true the engine also sleeps while JAX trains
  2gpu    two GPUs (CUDA_VISIBLE_DEVICES, default 0,1): a Ray head of its own owns both; the trainer sees only the
          second and the Ray actor takes the first; pool 0.9
  2gpu_colocated  two GPUs, each as 1gpu: the trainer data-parallel over both, one engine on each
  node    the recipe at its real batch on every GPU of this node as users launch it: `ray start --head` and
          launch/ray_train.sh, colocated, one engine a GPU; --micro 2 samples a micro-batch per GPU, pool 0.5,
          3 steps; with --one-gpu (a 1gpu result of this host) also scaling_efficiency
--scaling: 1gpu on GPU 0 (PROMPTS 2) and each of --layouts on two (PROMPTS 4), one prompt a call, into
OUT/LAYOUT/RESULT.json (a result already there is kept), then OUT/e2e_2gpu.json (`results.scaling_figures`);
2gpu_colocated runs --colocated-micro (2) samples in a pool of --colocated-pool (0.5), 2gpu with rollout.overlap.
--arms: --layout (1gpu) per algorithm arm into OUT/ARM/e2e_alg_ARM.json, then OUT/e2e_algorithms.json side by
side: `ARM/step_s` etc. and `ARM/step_vs_flowgrpo` (the arm's step time over FlowGRPO's).
--quantization fp8: the rollout's DiT in FP8 (rollout.quantization, vLLM-Omni only; the LoRA served as layers);
RESULT default e2e_recipe_fp8_LAYOUT. Its figures beside img_per_gpu_s and rollout_s: logp_diff_p50 / logp_diff_p99
(the log-prob mismatch against the bf16 trainer, `summary.mismatch_figures`) and, with
--config.train.old_log_prob=rollout_corrected (or recompute_corrected), rejected_share.
--profile-step K traces step K, dumps the train step's HLO and runs scripts/profile_step.py on both.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from jaxflow_bench.cli import parse_with_overrides
from jaxflow_bench.e2e_series import ARMS, arms, scaling
from jaxflow_bench.run_result import RunResult
from jaxflow_bench.summary import metrics_rows, print_steps, steady_figures
from jaxflow_bridge.engines import families

LAYOUTS = ("inproc", "1gpu", "2gpu", "2gpu_colocated", "node")
POOL = {"inproc": "0.5", "1gpu": "0.56", "2gpu": "0.9", "2gpu_colocated": "0.56", "node": "0.5"}
FIXED = ["--config.eval.every=0", "--config.checkpoint.every=1000", "--config.log.progress=False"]
RECIPE_VALUES = ("import json, sys; from jaxflow import families; from jaxflow.config.validation import config_module; "
                 "c = config_module(sys.argv[1]).get_config(); print(json.dumps(dict("
                 "prompts=c.sample.prompts_per_step, group=c.sample.group_size, "
                 "mini=c.train.num_mini_batches, micro=c.train.num_micro_batches, "
                 "short_start=c.model.scan_unroll == 0 and c.model.lora_gemm == 'auto' "
                 "and families.of(c).fused_gemm)))")
# a run's blocks unrolled, whatever their count (model.scan_unroll >= the blocks): the recipe's long run's program,
# which the plan's short-run start (jaxflow/config/planner.py short_start) would scan for a benchmark's few steps
UNROLLED = "--config.model.scan_unroll=1000"


class Refused(Exception):
    """Input to fix, found before anything started (exit 2)."""


def recipe_values(config: str) -> dict:
    """The recipe's prompts per step, group size, mini- and micro-batches, and whether the plan may start a short
    run with its blocks in a scan (read in a process of its own on the CPU: this one must not hold a GPU)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", RECIPE_VALUES, config], env=env, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        raise Refused("--layout node runs on a GPU node: no nvidia-smi here") from None
    return len(out.splitlines())


def run_logged(cmd: list[str], env: dict, out: Path, watched: list[str] | None) -> int:
    """Run `cmd` with every output line stamped with the time of day, to the terminal and OUT/train.log, while
    nvidia-smi writes the memory of the `watched` GPUs (ids; [] all, None none) to OUT/gpu_mem.csv every 0.5 s; the
    command's exit status."""
    watcher = None
    if watched is not None:
        with open(out / "gpu_mem.csv", "w") as mem:
            watcher = subprocess.Popen(["nvidia-smi", *(["-i", ",".join(watched)] if watched else []),
                                        "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "500"],
                                       stdout=mem, stderr=subprocess.DEVNULL)
    try:
        with open(out / "train.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                    errors="replace")
            for line in proc.stdout:
                stamped = f"{time.strftime('%H:%M:%S')} {line}"
                sys.stdout.write(stamped)
                log.write(stamped)
                log.flush()
            return proc.wait()
    finally:
        if watcher is not None:
            watcher.kill()
            watcher.wait()


def check_jax_on_gpu(env: dict) -> None:
    code = ("import jax; b = jax.default_backend(); assert b == 'gpu', f'JAX runs on {b}, not the GPU'; "
            "print(jax.devices())")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def start_ray_head(env: dict, out: Path, gpus: int, temp_dir: str | None) -> str | None:
    """`ray start --head` owning `gpus` GPUs (a temp dir of its own and a free port when `temp_dir`); its address
    where it writes one in `temp_dir`."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--num-gpus={gpus}",
           "--disable-usage-stats"]
    if temp_dir:
        cmd[5:5] = ["--port=0"]
        cmd.append(f"--temp-dir={temp_dir}")
    with open(out / "ray_start.log", "w") as log:
        if subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode:
            raise RuntimeError(f"the Ray head did not start: see {out / 'ray_start.log'}")
    if not temp_dir:
        return None
    current = Path(temp_dir) / "ray_current_cluster"  # ray start writes its address there
    address = current.read_text().strip() if current.is_file() else ""
    if not re.search(r":[1-9][0-9]*$", address):
        raise RuntimeError(f"no address for the Ray head in {temp_dir}: see {out / 'ray_start.log'}")
    return address


def stop_private_head(temp_dir: str) -> None:
    """Stop only the processes of the head started with `temp_dir` (they outlast SIGTERM: killed 2 s later)."""
    subprocess.run(["pkill", "-f", temp_dir], capture_output=True, check=False)
    time.sleep(2)
    subprocess.run(["pkill", "-9", "-f", temp_dir], capture_output=True, check=False)


def described(args, overrides: list[str], given: dict) -> str:
    """The result's command: the environment that changed the run, then this runner's arguments."""
    env = [f"{k}={given[k]}" for k in ("XLA_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES") if k in given]
    opts = [f"--layout={args.layout}"] + [f"--{k.replace('_', '-')}={v}" for k in (
        "device", "recipe", "config", "engine", "sleep", "prompts", "micro", "per_call", "steps", "reward", "model_dir",
        "profile_step", "one_gpu") if (v := getattr(args, k)) is not None]
    opts += [f"--quantization={args.quantization}"] if args.quantization != "none" else []
    return shlex.join([*env, "python", "-m", "jaxflow_bench.e2e", "OUT", *opts, *overrides])


def cpu_overrides() -> list[str]:
    """The trainer's overrides that put a run on the CPU (jaxflow.train's own list: imported only for a CPU run, as
    it imports JAX)."""
    from jaxflow.train import CPU_OVERRIDES
    return CPU_OVERRIDES.split()


def e2e_recipe(args) -> dict:
    """The --recipe family's (default the registry's DEFAULT) `spec.E2E`: its config, random folder and the rest."""
    return families.spec(args.recipe or families.DEFAULT).E2E


def setup(args, given: dict) -> tuple[list[str], dict, int, list[str] | None]:
    """The layout's set-up, checked before anything starts (Refused: input to fix): the trainer's command (but for
    a private Ray head's address), its environment, the GPUs the result counts and those nvidia-smi watches (ids;
    [] all; None none: a CPU run, or no nvidia-smi)."""
    env = dict(given)
    layout, recipe, cpu = args.layout, e2e_recipe(args), args.device == "cpu"
    one_gpu = bool(args.recipe) and recipe["one_gpu"]
    config = args.config or recipe["config"]
    engine = "diffusers" if cpu else "vllm_omni" if one_gpu else args.engine or "vllm_omni"
    if args.config and not Path(args.config).is_file():
        raise Refused(f"--config {args.config}: no such file (a recipe such as configs/tiny_ocr.py)")
    if cpu and not args.config:
        raise Refused("--device cpu runs a recipe of its own small model: --config configs/tiny_ocr.py")
    if cpu and (args.engine == "vllm_omni" or layout not in ("inproc", "1gpu")):
        raise Refused("--device cpu runs the diffusers engine in --layout inproc or 1gpu (its actor on the CPU)")
    if engine == "vllm_omni" and layout == "inproc":
        raise Refused("the vllm_omni engine runs in a Ray actor: --layout 1gpu or 2gpu")
    if args.quantization != "none" and engine != "vllm_omni":
        raise Refused(f"--quantization {args.quantization} quantizes vLLM-Omni's DiT: a GPU run without --engine "
                      f"diffusers")
    if one_gpu and (layout != "1gpu" or args.engine == "diffusers"):
        raise Refused(f"--recipe {args.recipe} runs vLLM-Omni on one GPU: --layout 1gpu without --engine")
    env["PYTHONUNBUFFERED"] = "1"
    if cpu:
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)  # jax >= 0.11 ignores the GPU when both fractions are set
        env.setdefault("XLA_CLIENT_MEM_FRACTION", "0.5" if one_gpu else POOL[layout])
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if one_gpu or layout == "node" else env.get(
            "XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    r = recipe_values(config)
    gpus, devices, visible = 1, 1, env.get("CUDA_VISIBLE_DEVICES")
    if layout == "node":
        gpus = devices = gpu_count()
    elif layout == "2gpu":
        pair = env.get("CUDA_VISIBLE_DEVICES", "0,1")
        if not re.fullmatch(r"[0-9]+,[0-9]+", pair):
            raise Refused(f"--layout 2gpu needs two GPUs: set CUDA_VISIBLE_DEVICES to two ids such as 0,1 "
                          f"(it is '{pair}')")
        gpus, visible = 2, pair
    elif layout == "2gpu_colocated":
        gpus = devices = 2
    prompts = args.prompts or (r["prompts"] if layout == "node" else 2)
    samples = prompts * r["group"] // r["mini"]  # an update's
    micro = args.micro or (2 if one_gpu or layout == "node" else  # the E2E's or the recipe's, at most an update
                           min(recipe.get("micro") or r["prompts"] * r["group"] // (r["mini"] * r["micro"]),
                               samples // devices))
    if samples % (micro * devices):
        raise Refused(f"--micro {micro} x {devices} {'GPUs' if devices > 1 else 'device'} does not divide an "
                      f"update's {samples} samples")
    cmd = [] if args.config and not args.model_dir else [
        f"--config.model.path={args.model_dir or recipe['folder']}"]
    if not args.config and recipe["init"] != "checkpoint":
        cmd.append(f"--config.model.init={recipe['init']}")
    if cpu:
        cmd += cpu_overrides()
    elif layout != "node":
        cmd += [f"--config.rollout.engine={engine}", "--config.rollout.dtype=bfloat16", "--config.rollout.device=cuda"]
    if args.quantization != "none":
        cmd.append(f"--config.rollout.quantization={args.quantization}")
    if args.sleep:
        cmd.append(f"--config.rollout.sleep_while_training={args.sleep}")
    if layout != "node" or args.prompts:
        cmd += [f"--config.sample.prompts_per_step={prompts}"]
    if layout != "node" or args.per_call:
        cmd += [f"--config.sample.prompts_per_call={1 if one_gpu else args.per_call or max(1, min(4, prompts // 2))}"]
    cmd += [f"--config.train.num_micro_batches={samples // micro // devices}",
            f"--config.train.num_steps={args.steps or (3 if layout == 'node' else 4)}", *FIXED,
            *([UNROLLED] if r["short_start"] and not cpu else []),
            f"--config.run_dir={Path(args.out) / 'run'}"]
    if args.reward:
        cmd.append(f"--config.reward.fns={json.dumps({args.reward: 1.0})}")
    gpu_share = [] if cpu else ["--config.rollout.num_gpus=1"]
    cmd += {"inproc": ["--config.rollout.layout=in_process", "--config.rollout.num_gpus=0"],
            "1gpu": [*([] if one_gpu else ["--config.rollout.layout=colocated"]), *gpu_share],
            "2gpu_colocated": ["--config.rollout.layout=colocated", *gpu_share, "--config.rollout.num_servers=2"],
            "2gpu": ["--config.rollout.layout=split", *gpu_share],
            "node": ["--config.rollout.layout=colocated", *gpu_share, f"--config.rollout.num_servers={gpus}"]}[layout]
    train = (["bash", "launch/ray_train.sh", config] if layout == "node" else
             [sys.executable, "-m", "jaxflow.train", "--config", config])
    watched = None if cpu or not shutil.which("nvidia-smi") else visible.split(",") if visible else []
    return [*train, *cmd], env, gpus, watched


def ensure_model(args, env: dict) -> None:
    """Write the recipe's random folder if it is missing (nothing for --config)."""
    if not args.config:
        recipe = e2e_recipe(args)
        model, maker = args.model_dir or recipe["folder"], recipe["writer"]
        if not (Path(model) / recipe["marker"]).is_file():
            subprocess.run([sys.executable, maker[0], "--out", model, *maker[1:]], env=env, check=True)


def result_name(args) -> str:
    """The result file's name: --result, else the node's, a recipe's other than the default family's
    (e2e_RECIPE_LAYOUT: e2e_bagel_1gpu), a quantized rollout's (e2e_recipe_fp8_LAYOUT) or e2e_ENGINE_LAYOUT."""
    if args.result:
        return args.result
    if args.layout == "node":
        return "e2e_8gpu"
    if args.recipe and args.recipe != families.DEFAULT:
        return f"e2e_{args.recipe}_{args.layout}"
    if args.quantization != "none":
        return f"e2e_recipe_{args.quantization}_{args.layout}"
    return f"e2e_{'cpu' if args.device == 'cpu' else args.engine or 'vllm_omni'}_{args.layout}"


def one_gpu_figure(path: Path) -> float:
    """The img/GPU/s of --one-gpu's result (Refused: not a result file with one)."""
    try:
        return float(json.loads(Path(path).read_text())["figures"]["img_per_gpu_s"])
    except (OSError, ValueError, KeyError, TypeError):
        raise Refused(f"--one-gpu {path}: not a result file with figures.img_per_gpu_s (a 1gpu run's "
                      f"OUT/e2e_1gpu.json)") from None


def run(args, overrides: list[str], env: dict | None = None) -> Path:
    """One layout's run into args.out; the result file's path."""
    given = dict(os.environ if env is None else env)
    cmd, env, gpus, watched = setup(args, given)
    layout, out = args.layout, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    exclude = []
    if args.profile_step is not None:
        cmd += [f"--config.profile.start_step={args.profile_step}", "--config.profile.num_steps=1"]
        env["XLA_FLAGS"] = (f"{env.get('XLA_FLAGS', '')} --xla_dump_to={out / 'hlo'} --xla_dump_hlo_as_text "
                            "--xla_dump_hlo_module_re=.*update.*")
        exclude = [args.profile_step]
    one = one_gpu_figure(args.one_gpu) if args.one_gpu else None
    mem = None if watched is None else out / "gpu_mem.csv"

    def figures(rows: list[dict]) -> dict | None:
        f = steady_figures(rows, gpus, exclude=exclude, gpu_mem=mem)
        if f is not None and one:
            f.update(one_gpu_img_per_gpu_s=one, scaling_efficiency=f["img_per_gpu_s"] / one)
        return f

    result = RunResult(out / "run", out, result_name(args), described(args, overrides, given), figures)
    temp_dir = None
    try:
        if layout != "node" and args.device != "cpu":
            check_jax_on_gpu(env)
        ensure_model(args, env)
        if layout == "2gpu":
            # no token authentication (ray 2.60's `ray start` turns it on where ~/.ray/auth_token exists, and then
            # refuses a driver without RAY_AUTH_MODE=token)
            pair = env.get("CUDA_VISIBLE_DEVICES", "0,1")
            temp_dir, env["RAY_AUTH_MODE"] = f"/tmp/ray_e2e_{os.getpid()}", "disabled"
            address = start_ray_head(dict(env, CUDA_VISIBLE_DEVICES=pair), out, 2, temp_dir)
            env["CUDA_VISIBLE_DEVICES"] = pair.split(",")[1]
            cmd.append(f"--config.rollout.address={address}")
        elif layout == "node":
            env.setdefault("RAY_AUTH_MODE", "token")  # the head makes a token (~/.ray/auth_token); the trainer asks
            start_ray_head(env, out, gpus, None)
        with result.watching():
            rc = run_logged([*cmd, *overrides], env, out, watched)
        if rc:
            raise RuntimeError(f"the training run failed (exit {rc}): see {out / 'train.log'} (the steps done, if "
                               f"any count, are in {result.out / result.name}.json, marked partial)")
    finally:
        if temp_dir:
            stop_private_head(temp_dir)
        elif layout == "node":
            subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop"], capture_output=True, check=False)
    if watched is None:
        print("the GPUs' memory is not read (a CPU run, or no nvidia-smi): the result has no peak_gib")
    print_steps(metrics_rows(out / "run"), gpus)
    path = result.final()
    print(path)
    if args.profile_step is not None:
        subprocess.run([sys.executable, "scripts/profile_step.py", "--out", str(out), "--trace",
                        str(out / "run" / "profile"), "--hlo", str(out / "hlo")], env=env, check=True)
    return path


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], usage=__doc__.split("\n\n")[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--layout", choices=LAYOUTS, default="1gpu")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--recipe", choices=tuple(families.FAMILIES), help=f"a family's recipe (its spec.py E2E; "
                                                                             f"default {families.DEFAULT})")
    source.add_argument("--config", help="a recipe config of its own model instead (e.g. configs/tiny_ocr.py)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="cpu: the trainer and a diffusers engine on the CPU "
                                                             "(jaxflow.train's CPU overrides; default cuda)")
    p.add_argument("--engine", choices=("vllm_omni", "diffusers"))
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="rollout.quantization: the rollout's DiT in FP8 (vLLM-Omni)")
    p.add_argument("--sleep", choices=("true", "false"), help="rollout.sleep_while_training (default the recipe's)")
    p.add_argument("--prompts", type=int, help="prompts a step (default 2; the node: the recipe's)")
    p.add_argument("--micro", type=int, help="samples a micro-batch (default the E2E's or the recipe's; a one-GPU "
                                             "recipe and the node 2)")
    p.add_argument("--per-call", type=int, help="prompts a rollout call (default min(4, prompts / 2))")
    p.add_argument("--steps", type=int, help="training steps (default 4; the node 3)")
    p.add_argument("--reward", help="train on this one reward instead of the recipe's (e.g. brightness)")
    p.add_argument("--result", help="the result file's name")
    p.add_argument("--model-dir", help="the random folder (written if missing)")
    p.add_argument("--profile-step", type=int)
    p.add_argument("--one-gpu", type=Path, help="a 1gpu result of this host: the node's scaling_efficiency")
    p.add_argument("--scaling", action="store_true")
    p.add_argument("--layouts", nargs="+", choices=("2gpu_colocated", "2gpu"), default=["2gpu_colocated", "2gpu"])
    p.add_argument("--colocated-micro", type=int, default=2)
    p.add_argument("--colocated-pool", type=float, default=0.5)
    p.add_argument("--arms", nargs="+", choices=tuple(ARMS))
    return p


def main(argv=None) -> int:
    args, overrides = parse_with_overrides(parser(), argv)
    try:
        if args.scaling or args.arms:
            (scaling if args.scaling else arms)(args, overrides, run)
        else:
            run(args, overrides)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
