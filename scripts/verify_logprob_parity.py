"""Rollout vs trainer log-prob parity: |logp_jax - logp_rollout| for every SDE window step of real rollouts.

    python scripts/verify_logprob_parity.py [--model-family qwen_image|qwen_image_edit|bagel] [--model DIR]
        [--engine diffusers|vllm_omni|bagel_torch] [--dtype float32] [--jax-dtype D] [--jax-rope bfloat16] [--cfg 4]
        [--steps 4] [--window 2] [--prompts 4] [--n 2] [--lora-rank R] [--lora-apply layers|folder|merged] [--think K]
        [--deploy single_stage|two_stage] [--quantization fp8] [--enforce-eager] [--init checkpoint|random]
        [--sleep-cycles N] [--micro-batches M] [--cfg-forward batched|split] [--json OUT]

Rolls out on the engine (default: diffusers; the model defaults to the tiny offline pipeline saved in --dtype, which
vLLM-Omni needs; with --model-family bagel: the bagel_torch engine on the tiny random BAGEL, float32, or --engine
vllm_omni --dtype bfloat16 (scripts/check_bagel_vllm_omni.sh); BAGEL's text CFG over the whole interval with renorm
min 0, 64 x 96 images; --think K: BAGEL's think mode, at most K think tokens in each context; with --model-family
qwen_image_edit, or a --model folder of that family, the tiny Qwen-Image-Edit or the folder's on either engine, each
prompt an instruction over one seeded random reference image of the sample size; 40 x 72 images, 48 x 80 on
vllm_omni, whose edit pre-processing samples multiples of 16 only), then recomputes each window step's log-prob with
the same transformer weights loaded into the Flax model, through the train step's own forward
(`jaxflow.trainer.parity.recompute`). With --lora-rank both sides get one random non-zero PEFT adapter (the engine
via update_lora, JAX via peft_to_lora); --jax-lora-seed gives the JAX side a different one (a negative control).
--quantization fp8 (vllm_omni) serves the DiT's linears in FP8 (rollout.quantization) against the bf16/fp32 JAX
recompute: its |dlogp| is FP8's error, not a bug's (pass a --threshold that fits it); --enforce-eager runs vLLM-Omni
without torch.compile (a compiled graph's fault vs a kernel's). --cfg-forward runs true CFG's rows as two forwards,
no padded text ("split": the engines' default, as the recipe's rollout.cfg_forward) or as one padded forward
("batched"). --init random draws the base weights from --seed by the shared random spec on both sides (the engine's
`random_seed`, the trainer's model.init=random), so a --model folder needs no transformer weights
(`scripts/make_random_pipeline.py --no-transformer-weights`); at full size pass --micro-batches to bound the JAX
recompute's memory. --sleep-cycles N sleeps and wakes the engine N times after the adapter is applied, before the
rollout, as the trainer does around each update. A rollout whose log-probs are not all finite fails before JAX
loads.

Prints |dlogp| mean/p50/p99/max and ratio mean/min/max per window position, then overall. Exits 1 when the
overall MAX |dlogp| exceeds --threshold: a mismatch bug need not touch every sample (one prompt length, one
window position), and at the sample counts this runs p99 is within a value or two of the max anyway.

Default thresholds (max |dlogp|; figures measured on the tiny pipeline, CPU, CFG 4):
- both sides float32: 1e-5. The floor is 2.4e-7 (1-2 ulp of logp); every bug tried exceeds 1e-5: bf16-rounded
  weights alone 2.8e-5, last prompt token masked 4.5e-5, guidance 3.5 vs 4 1.3e-4, a different 5%-scale adapter
  2.5e-4, bf16-rounded sigmas 4.4e-4, CFG forgotten 7.2e-4, schedule mu of 512x512 3.1e-3.
- either side bfloat16: 1e-2, a gross-bug detector only. A mean-over-elements log-prob barely moves when the
  velocity does (the first-order term averages out), so those bugs sit within 1-10x of the bf16 noise (2.6e-4
  to 4.3e-4 here; verl-omni saw p99 2.7e-3 on SD3.5 with CFG) and only a float32 run can tell them apart.
  1e-2 leaves room for a large model's noise and still catches a wrong noise level (1.2 vs 1.0: 1e-1) or a
  badly wrong schedule (5e-2). bf16 noise alone exceeds the trainer's default clip_range (1e-4).
The JAX base weights must also match the engine's fingerprint (bf16 bytes: fp32 and bf16 copies agree).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxflow import families
from jaxflow.families.bagel.loading import folder_config, load_bagel, random_bagel
from jaxflow.families.bagel.lora import BagelLoRASpec
from jaxflow.nn.config import ModelOptions
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.families.qwen_image.loading import load_transformer
from jaxflow.families.qwen_image.random_init import random_transformer
from jaxflow.nn.lora import peft_to_lora
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
from jaxflow.trainer.parity import parity_stats, random_adapter, recompute
from jaxflow_bridge.contract.lora_payload import LoRAPayload
from jaxflow_bridge.contract.schedule import CFG_FORWARDS
from jaxflow_bridge.contract.served import ServedProbe, differing, expected_probe
from jaxflow_bridge.contract.trajectory import TrajectoryBatch
from jaxflow_bridge.engines.vllm_omni.rules import family_problems

PROMPTS = [
    'A storefront sign that reads "OPEN 24 HOURS" in red neon',
    "a red fox",
    'A chalkboard menu with the words "Soup of the day: tomato" written in white chalk',
    "a lighthouse at dusk, waves crashing on dark rocks",
    'A vintage poster with the title "JAXFLOW" above a rocket',
    "two cats asleep on a windowsill",
    'A wooden street sign pointing left, labelled "Main St"',
    "a bowl of ramen, steam rising, top-down view",
]
THRESHOLDS = {True: 1e-5, False: 1e-2}  # keyed by "both sides float32"
DTYPE_CHOICES = ("float32", "bfloat16")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-family", choices=families.FAMILIES,
                   help="default: the --model folder's family, else qwen_image")
    p.add_argument("--model", type=Path, help="a diffusers Qwen-Image(-Edit) folder or a BAGEL folder (default: the "
                                              "family's tiny one)")
    p.add_argument("--engine", choices=("diffusers", "vllm_omni", "bagel_torch"),
                   help="default: diffusers, or bagel_torch for --model-family bagel")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="float32", help="rollout dtype")
    p.add_argument("--jax-dtype", choices=DTYPE_CHOICES, help="trainer dtype (default: --dtype)")
    p.add_argument("--cfg", type=float, default=4.0, help="true CFG scale; 1 = off")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--window", type=int, default=2, help="SDE window size")
    p.add_argument("--noise-level", type=float, help="default: 1.2, BAGEL's recipe 0.7")
    p.add_argument("--sde-type", choices=("sde", "cps"), default="sde")
    p.add_argument("--prompts", type=int, default=4, help=f"number of prompts (at most {len(PROMPTS)})")
    p.add_argument("--n", type=int, default=2, help="images per prompt")
    p.add_argument("--height", type=int, help="default: 40 (BAGEL 64; Qwen-Image-Edit on vllm_omni 48)")
    p.add_argument("--width", type=int, help="default: 72 (BAGEL 96; Qwen-Image-Edit on vllm_omni 80)")
    p.add_argument("--seed", type=int, default=0,
                   help="base sample seed; also seeds the LoRA adapter and --init random's base weights")
    p.add_argument("--init", choices=("checkpoint", "random"), default="checkpoint",
                   help="base weights: the folder's, or drawn from --seed on both sides (model.init=random)")
    p.add_argument("--sleep-cycles", type=int, default=0,
                   help="sleep and wake the engine this many times after the adapter is applied, before the rollout")
    p.add_argument("--lora-rank", type=int, help="apply one random LoRA adapter (alpha = rank) to both sides")
    p.add_argument("--lora-apply", choices=("layers", "folder", "merged"),
                   help="vllm_omni: how the engine applies the adapter (default: the engine's, layers)")
    p.add_argument("--deploy", choices=("single_stage", "two_stage"),
                   help="BAGEL on vllm_omni: vLLM-Omni's deployment (default: the engine's, single_stage)")
    p.add_argument("--quantization", choices=("none", "fp8"), default="none",
                   help="vllm_omni: the DiT's linears in FP8 (rollout.quantization)")
    p.add_argument("--enforce-eager", action="store_true", help="vllm_omni: no torch.compile (omni_args enforce_eager)")
    p.add_argument("--jax-lora-seed", type=int, help="a different adapter seed for the JAX side (negative control)")
    p.add_argument("--think", type=int, help="BAGEL: think mode with this max_think_tokens (the trainer rebuilds the "
                                            "context from the carried ids)")
    p.add_argument("--jax-rope", choices=DTYPE_CHOICES, default="float32",
                   help="bfloat16: round the JAX side's RoPE tables as vLLM-Omni's transformer does (diagnostic)")
    p.add_argument("--micro-batches", type=int, default=1, help="JAX recompute micro-batches (memory)")
    p.add_argument("--cfg-forward", choices=CFG_FORWARDS,
                   help="true CFG's rows in one padded forward or two (Qwen-Image engines; default: the engine's)")
    p.add_argument("--threshold", type=float, help="max |dlogp| allowed (default: 1e-5 fp32, 1e-2 with bf16)")
    p.add_argument("--json", type=Path, help="write the config, stats and per-sample dlogp here")
    args = p.parse_args(argv)
    if args.model_family is None:
        args.model_family = folder_family(args.model) if args.model else "qwen_image"
    bagel = args.model_family == "bagel"
    args.engine = args.engine or ("bagel_torch" if bagel else "diffusers")
    # Qwen-Image-Edit on vllm_omni: multiples of 16, the sizes vLLM-Omni's edit pre-processing keeps
    edit_vllm = args.model_family == "qwen_image_edit" and args.engine == "vllm_omni"
    for key, qwen, bagel_value in (("noise_level", 1.2, 0.7), ("height", 48 if edit_vllm else 40, 64),
                                   ("width", 80 if edit_vllm else 72, 96)):
        if getattr(args, key) is None:
            setattr(args, key, bagel_value if bagel else qwen)
    if args.engine not in families.by_name(args.model_family).engines:
        p.error(f"--engine {args.engine} does not serve --model-family {args.model_family}")
    if not 1 <= args.prompts <= len(PROMPTS):
        p.error(f"--prompts must be in [1, {len(PROMPTS)}]")
    if args.jax_lora_seed is not None and args.lora_rank is None:
        p.error("--jax-lora-seed needs --lora-rank")
    if args.think is not None and not bagel:
        p.error("--think is BAGEL's think mode: pass --model-family bagel")
    if args.lora_apply and args.engine != "vllm_omni":
        p.error("--lora-apply is an option of --engine vllm_omni")
    for flag, used in (("--quantization", args.quantization != "none"), ("--enforce-eager", args.enforce_eager)):
        if used and args.engine != "vllm_omni":
            p.error(f"{flag} is an option of --engine vllm_omni")
    if args.cfg_forward and bagel:
        p.error("--cfg-forward is the Qwen-Image engines' (diffusers, vllm_omni): drop it for --model-family bagel")
    if args.deploy and not (bagel and args.engine == "vllm_omni"):
        p.error("--deploy is BAGEL's vLLM-Omni deployment: pass --model-family bagel --engine vllm_omni")
    if args.deploy == "two_stage" and args.think is not None:
        p.error("--deploy two_stage has no think mode: drop --think")
    if args.sleep_cycles < 0:
        p.error("--sleep-cycles must be >= 0")
    if args.init == "random" and args.engine == "vllm_omni":  # the engine's own rule, refused before it starts
        for key, message in family_problems(args.model_family, init="random", deploy=None):
            if key == "model.init":
                p.error(f"--init random on --engine vllm_omni: {message}")
    if args.engine == "vllm_omni" and args.dtype != "bfloat16":
        p.error("--engine vllm_omni runs --dtype bfloat16 only (vLLM-Omni 0.20 fails its warm-up in float32)")
    args.jax_dtype = args.jax_dtype or args.dtype
    if args.threshold is None:
        args.threshold = THRESHOLDS[args.dtype == args.jax_dtype == "float32"]
    return args


def folder_family(folder: Path) -> str:
    """The family whose spec claims the model folder; SystemExit naming the choices for a folder of none."""
    from jaxflow_bridge.engines import families as torch_families

    for name in torch_families.FAMILIES:
        if torch_families.spec(name).is_folder(folder):
            return name
    raise SystemExit(f"--model {folder} is no family's folder: pass --model-family ({', '.join(families.FAMILIES)})")


def tiny_folder(family: str, dtype: str) -> Path:
    """The family's tiny offline model folder saved in `dtype`."""
    from jaxflow_bridge.engines import families as torch_families

    return torch_families.module(family, "tiny").tiny_pipeline_path(dtype=dtype)


def edit_references(count: int, height: int, width: int, seed: int) -> list[np.ndarray]:
    """One seeded random uint8 (1, height, width, 3) reference image per prompt (an edit model's)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (1, height, width, 3), dtype=np.uint8) for _ in range(count)]


def build_engine(name: str, folder: Path, dtype: str, lora_apply: str | None = None, deploy: str | None = None,
                 quantization: str = "none", eager: bool = False, random_seed: int | None = None,
                 cfg_forward: str | None = None):
    """The rollout engine `name` from jaxflow_bridge.rollout.server's registry, in-process; SystemExit if unavailable.
    `lora_apply`: the vllm_omni engine's (layers, folder, merged); `deploy`: its BAGEL deployment; `quantization`,
    `eager`: its DiT's FP8 and no torch.compile; `random_seed`: base weights drawn from it, not read from the folder;
    `cfg_forward`: true CFG's rows in one forward or two (the engine's default without it); bagel_torch skips its
    image decode."""
    from jaxflow_bridge.rollout.server import engine_class

    config = {"engine": name, "model": str(folder), "dtype": dtype, **({"lora_apply": lora_apply} if lora_apply else {}),
              **({"deploy": deploy} if deploy else {}), **({"decode": "preview"} if name == "bagel_torch" else {}),
              **({"quantization": quantization} if quantization != "none" else {}),
              **({"omni_args": {"enforce_eager": True}} if eager else {}),
              **({"random_seed": random_seed} if random_seed is not None else {}),
              **({"cfg_forward": cfg_forward} if cfg_forward else {})}
    try:
        return engine_class(config)(config)
    except (ImportError, ValueError) as e:
        raise SystemExit(f"rollout engine {name!r} is not available here: {e}") from e


def print_table(stats: dict, step_index: np.ndarray) -> None:
    cols = ("mean", "p50", "p99", "max", "ratio_mean", "ratio_min", "ratio_max")
    print(f"{'window':>6s} {'steps':>6s} " + " ".join(f"{c + (' |d|' if 'ratio' not in c else ''):>12s}"
                                                       for c in cols))
    rows = [(str(k), f"{step_index[:, k].min()}-{step_index[:, k].max()}", s)
            for k, s in enumerate(stats["per_step"])] + [("all", "", stats["overall"])]
    for pos, steps, s in rows:
        print(f"{pos:>6s} {steps:>6s} " + " ".join(
            f"{s[c]:12.4e}" if "ratio" not in c else f"{s[c]:12.9f}" for c in cols))


def jax_model(args, folder: Path, opts: ModelOptions, spec):
    """The JAX model: the base weights read from `folder` (BAGEL's, or a `transformer/`), or drawn from --seed by the
    shared random spec as the engine drew them (--init random: nothing read but the config)."""
    if args.model_family == "bagel":
        return random_bagel(folder_config(folder), opts, spec, args.seed) if args.init == "random" else \
            load_bagel(folder, opts, spec)
    model_type = families.by_name(args.model_family).model_type
    if args.init == "random":
        return random_transformer(QwenImageConfig.from_json(folder / "config.json"), opts, spec, seed=args.seed,
                                  model_type=model_type)
    return load_transformer(folder, opts, lora=spec, model_type=model_type)


def main(argv=None) -> int:
    args = parse_args(argv)
    bagel = args.model_family == "bagel"
    if args.model is None and bagel:
        from jaxflow_bridge.families.bagel.tiny import tiny_bagel_path

        args.model = tiny_bagel_path(dtype=args.dtype)
    elif args.model is None:
        args.model = tiny_folder(args.model_family, args.dtype)  # vLLM-Omni takes its dtype from the folder's
    engine = build_engine(args.engine, args.model, args.dtype, args.lora_apply, args.deploy, args.quantization,
                          args.enforce_eager, args.seed if args.init == "random" else None, args.cfg_forward)
    try:
        return check(args, engine, bagel)
    finally:
        engine.close()


def check(args, engine, bagel: bool) -> int:
    """Roll out on `engine`, recompute in JAX, print and write the comparison; the exit code."""
    engine_fingerprint = engine.info()["fingerprint"]
    folder = args.model if bagel else args.model / "transformer"
    spec = (BagelLoRASpec if bagel else QwenImageLoRASpec)(rank=args.lora_rank, alpha=float(args.lora_rank)) \
        if args.lora_rank else None
    round_to = ml_dtypes.bfloat16 if args.dtype == "bfloat16" else None  # both sides hold the same adapter values
    # drawn base weights: the adapter's shapes from the config (a BAGEL folder always holds its weights)
    drawn = args.model if args.init == "random" and not bagel else None
    if spec:
        adapter = random_adapter(folder, spec, args.seed, round_to=round_to, drawn=drawn)
        ack = engine.update_lora(adapter, 1, spec.peft_config())
        print(f"LoRA rank {spec.rank} on {ack['bound_modules']} engine modules")
        payload = LoRAPayload(1, spec.peft_config(), tensors=adapter)
        want = expected_probe(adapter, payload.scale, 1)
        served = ServedProbe.from_dict(ack["served"])
        bad = differing(want, served)
        print(f"served probe: {len(want) - len(bad)} of {len(want)} probed modules within their rounding bound"
              + (f"; differing: {bad[:5]}" if bad else ""))
        if bad:
            print("FAIL: the engine does not serve the adapter it was sent")
            return 1
    for cycle in range(args.sleep_cycles):  # the trainer's sleep/wake around each update, the adapter in place
        freed = engine.sleep()
        engine.wake()
        print(f"sleep/wake cycle {cycle + 1} of {args.sleep_cycles}: the sleep freed {freed / 2**30:.2f} GiB")

    sampling = {"height": args.height, "width": args.width, "num_inference_steps": args.steps,
                "sde_type": args.sde_type, "noise_level": args.noise_level,
                "sde_window_size": args.window, "sde_window_range": (0, args.steps - 1)}
    bagel_cfg = {"cfg_interval": (0.0, 1.0), "cfg_renorm_min": 0.0} if bagel else {}
    sampling.update({"cfg_text_scale": args.cfg, **bagel_cfg} if bagel else {"true_cfg_scale": args.cfg})
    if args.think is not None:
        sampling.update(think=True, max_think_tokens=args.think)
    edit = args.model_family == "qwen_image_edit"
    refs = {"references": edit_references(args.prompts, args.height, args.width, args.seed)} if edit else {}
    t0 = time.perf_counter()
    batch = TrajectoryBatch.from_dict(engine.generate(PROMPTS[: args.prompts], args.n, sampling, args.seed, **refs))
    engine.sleep()  # frees the accelerator before JAX first touches it; a no-op on CPU
    t1 = time.perf_counter()
    nonfinite = int((~np.isfinite(batch.log_probs)).sum())
    if nonfinite:
        print(f"FAIL: {nonfinite} of {batch.log_probs.size} rollout log-probs are not finite (latents: "
              f"{int((~np.isfinite(batch.latents)).sum())} of {batch.latents.size} values not finite)")
        return 1

    opts = ModelOptions(dtype=args.jax_dtype, param_dtype=args.jax_dtype, rope_table_dtype=args.jax_rope)
    model = jax_model(args, folder, opts, spec)
    if spec:
        jax_seed = args.seed if args.jax_lora_seed is None else args.jax_lora_seed
        peft_to_lora(model, spec, random_adapter(folder, spec, jax_seed, round_to=round_to, drawn=drawn))
    t2 = time.perf_counter()
    if families.by_name(args.model_family).fingerprint(model) != engine_fingerprint:
        print(f"FAIL: the JAX base weights' fingerprint differs from the engine's ({engine_fingerprint[:12]})")
        return 1
    patch = math.isqrt(args.height * args.width // batch.latents.shape[2])
    out = recompute(model, batch, grid_hw=(args.height // patch, args.width // patch), guidance=args.cfg,
                    sde_type=args.sde_type, noise_level=args.noise_level, num_micro_batches=args.micro_batches,
                    **bagel_cfg)
    t3 = time.perf_counter()

    stats = parity_stats(out["dlogp"], out["ratio"])
    print(f"{args.model_family}: engine {args.engine} ({args.dtype}) vs JAX ({args.jax_dtype}); base weights "
          f"{'drawn from seed ' + str(args.seed) if args.init == 'random' else 'from the folder'}, "
          f"{args.sleep_cycles} sleep/wake cycle(s) before the rollout; cfg {args.cfg}, {args.sde_type} "
          f"noise {args.noise_level}, {args.steps} steps, window {args.window}, B = {len(batch)}, "
          f"{args.height}x{args.width}; JAX matmul precision {opts.precision}, attention {model.impl}, RoPE tables "
          f"{args.jax_rope}; rollout {t1 - t0:.1f} s, JAX load {t2 - t1:.1f} s, recompute {t3 - t2:.1f} s")
    print_table(stats, batch.step_index)
    worst = stats["overall"]["max"]
    passed = bool(worst <= args.threshold)
    print(f"{'PASS' if passed else 'FAIL'}: max |dlogp| {worst:.3e} {'<=' if passed else '>'} "
          f"threshold {args.threshold:.1e}")
    if args.json:
        report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                  **stats, "passed": passed, "fingerprint": engine_fingerprint,
                  "step_index": batch.step_index.tolist(),
                  "log_prob_rollout": batch.log_probs.tolist(), "dlogp": out["dlogp"].tolist(),
                  **({"context_tokens": batch.prompt_mask.sum(1).tolist()} if bagel else {})}
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
