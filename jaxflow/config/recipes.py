"""The config's every key in one base, the real recipe, and the tiny offline overrides the defaults build on.

`base()` is the real setting: the default family's (the torch registry's DEFAULT) LoRA FlowGRPO on OCR prompts
with the vLLM-Omni rollout (`configs/qwen_ocr.py`, whose docstring gives each value's source).

`tiny(c)` turns a config into the embedded default's: the default family's tiny offline model, diffusers rollout on
CPU, float32,
toy sizes (the tiny VAE has spatial factor 4, so 40x72 images are 5x9 packed latent tokens).
"""
from __future__ import annotations

from functools import reduce
from pathlib import Path

import ml_collections

from jaxflow_bridge.engines import families

FAMILY = families.DEFAULT  # the real recipe's
SPECS = [families.spec(name) for name in families.FAMILIES]

DATA = Path(__file__).resolve().parents[2] / "data"  # the clone's prompt files, found from any working directory

# Keys whose value is a whole dict or list: one key each (`config_keys`), not a section.
WHOLE_KEYS = ("reward.fns", "reward.options", "eval.rewards", "train.xla_options", "sharding.rules")

# Every key of `base()` with one line of help: what it is, its unit or allowed values (`--print_config` prints it
# beside the value; tests/run/test_cli.py fails for a key without one). A default is stated once, in `base()` (the
# help never repeats it: tests/run/test_cli.py); why it was chosen stays beside the value.
HELP: dict[str, str] = {
    "seed": "seed of the prompt order, the rollout's noise, the mini-batch shuffles and model.init='random'",
    "run_dir": "output folder (checkpoints, metrics.jsonl, tb, eval grids, lora_final), relative to the cwd",
    "model.family": f"the model's family: {' or '.join(map(repr, families.FAMILIES))} (its engines: its spec.py ENGINES)",
    "model.path": f"required: the family's model folder (its spec.py FOLDER) or tiny offline model: "
                  f"{', '.join(repr(s.TINY) for s in SPECS)}",
    "model.dtype": "the trainer's compute dtype: float32, bfloat16 or float16",
    "model.param_dtype": "storage dtype of the frozen base weights: float32, bfloat16 or float16",
    "model.attention": "attention: 'auto' (cudnn for bf16/fp16 compute on a GPU, else xla), 'xla' or 'cudnn'",
    "model.remat": "remat policy: none, full, save_attn, save_matmuls, save_matmuls_stats (bf16 on GPUs), dots, "
                   "dots_no_batch",
    "model.scan_unroll": "blocks per scan step; >= the blocks: unrolled; 0: the plan's (unrolled for pallas, not for a short run)",
    "model.matmul_precision": "XLA matmul precision: auto (highest, true fp32, for float32 compute; else default), "
                              "default, high, highest",
    "model.lora_gemm": "adapted linears: 'xla', 'pallas' (fused Hopper GEMM: bf16, H100/H200s) or 'auto' (logged "
                       "at start)",
    "model.unroll_upgrade": "'auto': long runs planned unrolled+pallas start scanned, swap once compiled; 'on': any "
                            "unrolled; 'off'",
    "model.init": "base weights: 'checkpoint' (from model.path) or 'random' (drawn from seed; "
                  "jaxflow_bridge/contract/random_weights.py)",
    "lora.rank": "LoRA rank, an int >= 1",
    "lora.alpha": "LoRA alpha, > 0: the adapter's scale is alpha / rank",
    "lora.targets": "the linears adapted in every block, by checkpoint name (the family's keymap.py LORA_TARGETS)",
    "rollout.engine": "rollout engine: 'vllm_omni' (GPU, bfloat16 only), 'diffusers' (anywhere), 'bagel_torch' (CPU, "
                      "float32)",
    "rollout.dtype": "the engine's dtype: 'bfloat16' (vllm_omni's only) or 'float32' (diffusers)",
    "rollout.device": "the engine's torch device: 'cpu', 'cuda' or 'cuda:N'",
    "rollout.num_servers": "rollout engines (Ray actors); 'auto': colocated on GPUs one per trainer device (all "
                           "processes'), else one",
    "rollout.num_gpus": "GPUs Ray gives each rollout actor (1: a GPU to itself; 0 on a CPU)",
    "rollout.num_cpus": "CPUs Ray gives each rollout actor",
    "rollout.max_retries": "retries of a rollout call on fresh actors after an actor dies",
    "rollout.address": "the Ray cluster to join; '': start a local Ray instance",
    "rollout.sleep_while_training": "True: the engines' weights go to CPU while JAX trains (not with layout 'split')",
    "rollout.layout": "'colocated' (trainer's GPUs), 'split' (own GPUs), 'in_process' (no Ray), 'auto': the first that "
                      "fits, else colocated",
    "rollout.overlap": "True: step k+1's rollout runs while step k trains, one step off-policy; needs layout 'split' "
                       "(docs/design.md)",
    "rollout.compile": "diffusers engine only: torch.compile the transformer block",
    "rollout.share_weights": "True: the in_process diffusers engine runs on the trainer's base weights (one copy)",
    "rollout.lora_apply": "the engines' lora_apply: 'layers', 'merged' (vllm_omni), 'folder' (engine's own) or 'auto' "
                         "(plan.py)",
    "rollout.cfg_forward": "true CFG's two rows: 'batched' (one forward, text padded to one length) or 'split' (a "
                           "forward each)",
    "rollout.quantization": "vllm_omni only: 'none' (bf16 DiT) or 'fp8' (FP8 weights and activations of the DiT's linears; "
                            "LoRA as layers)",
    "rollout.bagel_deploy": "vllm_omni's stages (Family.stages): 'single_stage' or 'two_stage' (a vLLM thinker "
                            "prefills, the DiT denoises)",
    "rollout.thinker_memory": "two-stage deployment: the thinker's share of the GPU (vLLM's gpu_memory_utilization; "
                              "0.0: its deploy file's 0.45)",
    "sample.height": "image height in pixels: a multiple of the family's pixels per latent token (16 for the released "
                     "models)",
    "sample.width": "image width in pixels: a multiple of the family's pixels per latent token (16 for the released "
                    "models)",
    "sample.num_steps": "sampling steps of the training rollout",
    "sample.guidance": "true CFG scale of the rollout and the train step, >= 1 (1: no CFG)",
    "sample.noise_level": "the SDE's noise level inside a sample's window, > 0",
    "sample.sde_type": "the window's step: 'sde', 'cps' (coefficients-preserving) or 'ode' (train.algorithm "
                       "'nft' only)",
    "sample.solver": "'euler' (the sde_type step) or 'dpm2' (DPM-Solver++(2M): each step with 'ode' (nft, awm), or "
                     "after the window)",
    "sample.window_size": "steps of a sample's SDE window (noised; ODE outside), the steps FlowGRPO trains; in [1, "
                          "num_steps)",
    "sample.window_range": "(lo, hi): each sample's window lies in steps [lo, hi), its start drawn per sample",
    "sample.negative_prompt": "true CFG's negative prompt (the recipe's ' ': flow_grpo's pipeline; '': the empty "
                              "context)",
    "sample.cfg_interval": "a family with interval CFG only: (lo, hi), its text CFG at steps with lo < sigma <= hi",
    "sample.cfg_renorm_min": "a family with interval CFG only: floor of its CFG's per-sample global renorm factor, "
                             "in [0, 1]",
    "sample.same_latent": "True: a prompt group shares its initial noise (flow_grpo's same_latent; not with a "
                          "deterministic sampler)",
    "sample.think": "a family that thinks (Family.thinks): True adds a greedy think decode (vLLM-Omni's think mode)",
    "sample.max_think_tokens": "think mode: most tokens a think decode feeds (<|im_start|> included), >= 1; ids pad to "
                               "max_sequence_length + this",
    "sample.max_sequence_length": "prompt tokens: the train step pads text to this, the rollout refuses longer prompts",
    "sample.negative_max_sequence_length": "negative prompt tokens the train step pads to (0: max_sequence_length); "
                                           "shorter: a forward of their own",
    "sample.prompts_per_step": "prompts a training step samples, each rolled out group_size times",
    "sample.group_size": "images per prompt (a GRPO group), >= 2",
    "sample.prompts_per_call": "prompts per rollout request (requests go round-robin to the engines); divides "
                               "prompts_per_step",
    "train.num_steps": "training steps (a rollout and its updates each), >= 1",
    "train.compile_cache": "True: keep compiles ($JAXFLOW_CACHE/xla) and step executables (…/executables) for next start",
    "train.max_minutes": "> 0: end the run (checkpoint, lora_final) before this many minutes; 0: no limit",
    "train.max_skipped_steps": "steps in a row with a skipped (non-finite) update a run tolerates, >= 0; one more "
                               "stops it, exit 1",
    "train.logp_gate": "bound on each step's p99 |trainer - rollout| log-prob (bf16 noise < 1e-3, float32 < 1e-6), > 0",
    "train.logp_gate_steps": "k steps in a row over train.logp_gate (or the run's first step) stop the run, exit 1; 0/None: off",
    "train.sync_verify": "check each engine serves the LoRA sent after every sync; a mismatch re-syncs once, then exit 1",
    "train.sync_fault_from": "fault injection (tests, benchmarks): engines get the previous LoRA from this version on; 0: off",
    "train.num_micro_batches": "micro-batches of an update (gradient accumulation), dividing a mini-batch; 'auto': the largest "
                               "micro-batch that fits",
    "train.learning_rate": "AdamW learning rate, > 0",
    "train.clip_range": "the ratio's clip: clip(r, 1 - clip_range, 1 + clip_range), > 0",
    "train.adv_clip": "advantages clamped to +-adv_clip (nft: its optimality r's scale)",
    "train.beta": "KL coefficient against the adapters-off policy, >= 0 (0: no KL term; nft: train.nft.kl)",
    "train.global_std": "advantages divided by the reward std of the whole step (True) or of each prompt group",
    "train.max_grad_norm": "gradients clipped to this global norm",
    "train.weight_decay": "AdamW weight decay",
    "train.ema_decay": "in (0, 1): an EMA of the LoRA, which the evals sample and lora_final holds; 0: off",
    "train.adam_b1": "AdamW beta1 (flow_grpo's adam_beta1)",
    "train.adam_b2": "AdamW beta2 (flow_grpo's adam_beta2)",
    "train.adam_eps": "AdamW epsilon (flow_grpo's adam_epsilon)",
    "train.old_log_prob": "logp_old: 'recompute' (trainer's), 'rollout' (engine's), 'rollout_corrected' (verl "
                          "bypass), 'recompute_corrected'",
    "train.rejection_threshold": "t for 'rollout_corrected': a window step outside rollout_rs' bound (token_k1: ratio "
                                 "in [1/t, t]) weighs 0",
    "train.rollout_rs": "verl's rejection estimator: token_k1..3 per window step; recompute_corrected adds off, "
                        "seq_sum/mean_k1..3, seq_max_k2/3",
    "train.rollout_is": "'recompute_corrected': verl's truncated IS weights, 'off', 'token' (per window step) or "
                        "'sequence' (per sample)",
    "train.rollout_is_threshold": "rollout_is: the IS weights' truncation, > 0",
    "train.ratio_norm": "'none' (FlowGRPO's ratio) or 'guard' (GRPO-Guard's, arXiv 2510.22319; needs "
                        "old_log_prob='recompute')",
    "train.guard_stats": "guard: 'sample' (each sample's own step's scale and dt: the paper's per step) or 'batch' (verl-omni's means)",
    "train.guard_clip_range": "guard: the clip of its normalized ratio, > 0",
    "train.num_mini_batches": "optimizer updates per step, each on whole prompt groups; divides "
                              "sample.prompts_per_step",
    "train.num_inner_epochs": "passes over the step's mini-batches, >= 1 (each later one on the rows shuffled anew)",
    "train.drop_zero_advantage": ("True: rows whose advantage is 0 are dropped, the loss is the kept rows' "
                                   "mean (docs/numerics.md §11)"),
    "train.algorithm": "'flowgrpo', 'nft' (DiffusionNFT), 'mixgrpo' (sliding SDE window) or 'awm' (docs/numerics.md §10, §12, §13)",
    "train.nft.beta": "nft: beta, the implicit policies' step, > 0",
    "train.nft.timesteps": "nft: timesteps trained a sample, in [0, sample.num_steps]; 0: int(0.99 sample.num_steps)",
    "train.nft.decay_flat": "nft: updates during which the old policy's decay is 0 (the old policy is the LoRA)",
    "train.nft.decay_rate": "nft: the old policy's decay growth per update after decay_flat",
    "train.nft.decay_max": "nft: the old policy's largest decay, in [0, 1)",
    "train.nft.kl": "nft: weight of the reference-velocity MSE, >= 0, in place of train.beta",
    "train.nft.ema": "nft: EMA decay (with warm-up) of the LoRA that evals sample and lora_final holds; 0: off",
    "train.mixgrpo.interval": "mixgrpo: training steps between the SDE window's moves (MixGRPO's iters_per_group)",
    "train.mixgrpo.stride": "mixgrpo: steps the window moves each time (prog_overlap_step); it rolls back at sample.window_range's end",
    "train.awm.timesteps": "awm: noised timesteps trained a micro-batch, one per stratum of [1, int(fraction num_steps)]",
    "train.awm.fraction": "awm: the share of the schedule the timesteps are drawn from, in (0, 1]",
    "train.awm.power": "awm: the generalized-Huber power p of its log-prob surrogate, > 0 (ghuber_power)",
    "train.awm.adv_max": "awm: advantages scaled to clip(A, +-adv_clip) / adv_clip * adv_max (advantage_max)",
    "train.awm.clip_range": "awm: its ratio's clip range, > 0",
    "train.xla_options": "XLA options (names 'xla_...') of the train step's jits only, never process-wide",
    "reward.fns": "reward name -> weight; the step's reward is the weighted sum (docs/design.md §3b)",
    "reward.options": "reward name -> its options (ocr: num_threads; 'actor': a Ray actor of its own; docs/design.md "
                      "§3b)",
    "reward.workers": "reward threads; a reward that splits (ocr) scores a batch in up to this many pieces at once",
    "data.train": "training prompts: .txt (one a line, the target in the first \"...\") or .jsonl ({prompt, target})",
    "data.test": "held-out prompts for the evals, as data.train",
    "eval.every": "evaluate every this many steps and the final policy; 0: no eval",
    "eval.num_prompts": "held-out prompts evaluated (data.test's first), one ODE image each",
    "eval.num_steps": "ODE sampling steps of the eval",
    "eval.guidance": "true CFG scale of the eval",
    "eval.solver": "the eval's ODE solver, for any algorithm: 'euler' or 'dpm2' (DiffusionNFT's DPM-Solver++(2M))",
    "eval.rewards": "gold rewards of the evals, name -> weight as reward.fns (logged eval_gold/<name>); {}: none",
    "eval.best_metric": "an eval.rewards name: run_dir/lora_best keeps the best eval's adapter by it; '': none",
    "eval.stop_after": "N > 0: stop (exit 0) once best_metric fell at N evals in a row as the training reward rose",
    "checkpoint.every": "steps between checkpoints (also after the last step and on SIGINT/SIGTERM), >= 1",
    "checkpoint.keep": "the newest checkpoints kept, >= 1",
    "sharding.data": "size of the mesh's data axis (one of data/fsdp/tensor may be -1: the remaining devices)",
    "sharding.fsdp": "size of the mesh's fsdp axis",
    "sharding.tensor": "size of the mesh's tensor axis",
    "sharding.rules": "(logical axis name, mesh axes) rules (docs/design.md §4); default: the batch over data x fsdp",
    "log.tensorboard": "TensorBoard scalars in run_dir/tb (metrics.jsonl is always written)",
    "log.progress": "a line as each start-up phase begins; a progress bar on a terminal, one line a step when "
                    "stdout is a file",
    "log.wandb": "also log config, metrics and eval grids to wandb (pip install wandb); a resume continues its run",
    "log.wandb_project": "the wandb project (the run's id is kept in run_dir/wandb_id)",
    "log.wandb_mode": "'offline' (no network; `wandb sync` uploads later) or 'online'; env WANDB_MODE overrides it",
    "profile.start_step": "the first step (>= 1) of the jax.profiler trace",
    "profile.num_steps": "steps traced from start_step on; 0: no trace",
    "profile.dir": "the trace's folder; '': run_dir/profile",
}


def base() -> ml_collections.ConfigDict:
    """Every key of the training config, at the real recipe's values (each key's meaning: `HELP`)."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.run_dir = "runs/qwen_ocr"
    c.model = dict(family=FAMILY, path="", dtype="bfloat16", param_dtype="bfloat16", attention="auto",
                   # save_matmuls_stats keeps q/k/v, MLP hidden and cuDNN attention's output + softmax statistics:
                   # faster than save_matmuls (BENCHMARKS.md, train step)
                   remat="save_matmuls_stats",
                   # 0 = the blocks unrolled (each block's weights held as arrays of their own) where lora_gemm runs
                   # "pallas", else a scan (with XLA's linears about half the update's temporaries; config.model_options).
                   # Unrolled with the fused kernel, the recipe's train phase is faster on one H200 for minutes more
                   # compile at start than a scan's seconds (BENCHMARKS.md, the recipe on one GPU; docs/design.md)
                   scan_unroll=0,
                   matmul_precision="auto",
                   # "auto" picks "pallas" where it runs and pays (unrolled blocks, bf16, one H100/H200, rows that
                   # tile; BENCHMARKS.md, the fused LoRA GEMM), else "xla", the choice and its reason logged at start
                   lora_gemm="auto",
                   init="checkpoint",
                   # "auto": a long run planned with unrolled blocks and the fused kernel starts on the scanned program
                   # and swaps to the unrolled one once it compiled beside the first steps (jaxflow/config/plan.py;
                   # its first step in about half the time, BENCHMARKS.md "Start-up")
                   unroll_upgrade="auto")
    c.lora = dict(rank=64, alpha=128.0, targets=list(families.module(FAMILY, "keymap").DEFAULT_LORA_TARGETS))
    # num_servers: an int or "auto" (one engine per trainer GPU where colocated; the field's type is object)
    c.rollout = dict(engine="vllm_omni", dtype="bfloat16", device="cuda",
                     num_servers=ml_collections.FieldReference("auto", field_type=object), num_gpus=1.0,
                     num_cpus=1.0, max_retries=2, address="",
                     # off: it pays only where something can use the freed memory; JAX's fixed pool cannot (it never
                     # grows): one H200 is slower with it (BENCHMARKS.md, the recipe on one GPU); the trainer warns if
                     # set there
                     sleep_while_training=False,
                     # "auto": vLLM-Omni colocated where it fits (an H200), else the diffusers engine in the
                     # trainer's process on its weights (an 80 GB card; BENCHMARKS.md, the recipe on one H100)
                     layout="auto", overlap=False, compile=False,
                     # off: only the diffusers engine in the trainer's process (layout "in_process") can share;
                     # layout "auto" turns it on where it picks that engine
                     share_weights=False,
                     # "auto": vLLM-Omni serves the LoRA merged into its base weights, restored from a host copy
                     # while JAX trains: the recipe faster on one H200 than with LoRA layers (BENCHMARKS.md, the
                     # recipe on one GPU); the diffusers engine, layers
                     lora_apply="auto",
                     # "split": no attention mask within a prompt group; vLLM-Omni's rollout faster with the LoRA and
                     # without (BENCHMARKS.md, true CFG)
                     cfg_forward="split",
                     # "none": the bf16 DiT the trainer trains, until FP8's trade-off is measured (docs/vllm_omni.md, FP8 rollout)
                     quantization="none",
                     # a family with stages on vllm_omni: vLLM-Omni's single DiT stage (what verl-omni trains
                     # with), or "two_stage" (a vLLM thinker prefills, the DiT denoises; the family's docs)
                     bagel_deploy="single_stage",
                     # its thinker's share of the GPU; 0.0: the deploy file's 0.45, too much beside the DiT stage and
                     # the trainer at full size (about 0.25 on an H200: the family's docs)
                     thinker_memory=0.0)
    c.sample = dict(height=512, width=512, num_steps=10, guidance=4.0, noise_level=1.2, sde_type="sde",
                    solver="euler", window_size=2, window_range=(0, 5), negative_prompt=" ", same_latent=False,
                    cfg_interval=(0.0, 1.0), cfg_renorm_min=0.0,
                    # think mode off; vLLM-Omni's default cap on a think decode
                    think=False, max_think_tokens=1000,
                    # the longest OCR prompt has 74 tokens (96 rather than 128: 2.8% fewer train-step tokens at 512^2)
                    max_sequence_length=96,
                    # 0: negatives padded to 96 and run in one call with the prompts. 32 (2.9% fewer tokens) ran the
                    # train phase slower than batched (two H200s; benchmarks/HISTORY.md, vLLM-Omni in the loop)
                    negative_max_sequence_length=0,
                    prompts_per_step=32, group_size=16, prompts_per_call=4)
    c.train = dict(num_steps=300, compile_cache=True, max_minutes=0.0, max_skipped_steps=3, logp_gate=1e-2,
                   logp_gate_steps=3, sync_verify=True, sync_fault_from=0,
                   # an int or "auto" (any literal on the command line: the field's type is object)
                   num_micro_batches=ml_collections.FieldReference(64, field_type=object), learning_rate=3e-4,
                   clip_range=1e-4, adv_clip=5.0, beta=0.0, global_std=True, max_grad_norm=1.0, weight_decay=1e-4,
                   ema_decay=0.0,
                   adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8,
                   old_log_prob="recompute", rejection_threshold=2.0, ratio_norm="none",
                   # guard_clip_range: flow_grpo's and verl-omni's Guard recipes
                   rollout_rs="token_k1", rollout_is="off", rollout_is_threshold=2.0,
                   guard_stats="sample", guard_clip_range=2e-6,
                   num_mini_batches=2, num_inner_epochs=1,
                   # flow_grpo's SD3 trainer drops such samples, the recipe's (train_qwenimage.py) does not (docs/design.md)
                   drop_zero_advantage=False,
                   algorithm="flowgrpo",
                   # nft: DiffusionNFT's config/nft.py sd3_ocr; kl: verl-omni's NFT recipe; ema: NVlabs'
                   nft=dict(beta=0.1, timesteps=0, decay_flat=75, decay_rate=0.0075, decay_max=0.999, kl=1e-4, ema=0.9),
                   mixgrpo=dict(interval=25, stride=1),
                   # clip_range: AWM's OCR recipe
                   awm=dict(timesteps=6, fraction=0.9, power=0.25, adv_max=1.0, clip_range=1.0),
                   # cuBLAS GEMMs, no Triton ones: faster on an H200 (BENCHMARKS.md, train step). No
                   # latency-hiding scheduler: with the trainer on 2 GPUs it kept the unrolled backward's weight
                   # gradients alive to overlap the LoRA all-reduces, the update at 4 samples far above its need
                   # without it, one GPU's; one GPU runs the same either way (BENCHMARKS.md, two GPUs;
                   # benchmarks/HISTORY.md, two GPUs colocated)
                   xla_options={"xla_gpu_enable_triton_gemm": False, "xla_gpu_enable_latency_hiding_scheduler": False})
    # 8 reward threads, each with its own RapidOCR engine of 2 onnxruntime threads (16 cores a GPU)
    c.reward = dict(fns={"ocr": 1.0}, options={"ocr": {"num_threads": 2}}, workers=8)
    c.data = dict(train=str(DATA / "ocr" / "train.txt"), test=str(DATA / "ocr" / "test.txt"))
    # no gold rewards: the evals score the training rewards alone
    c.eval = dict(every=30, num_prompts=32, num_steps=50, guidance=4.0, solver="euler", rewards={}, best_metric="", stop_after=0)
    c.checkpoint = dict(every=10, keep=3)
    c.sharding = dict(data=-1, fsdp=1, tensor=1, rules=[("batch", ("data", "fsdp"))])
    c.log = dict(tensorboard=True, progress=True, wandb=False, wandb_project="jaxflow", wandb_mode="offline")
    c.profile = dict(start_step=2, num_steps=0, dir="")
    return c


def config_keys(cfg) -> list[str]:
    """The dotted leaf keys of `cfg` in HELP's order (the order base() sets them; keys HELP lacks come last, sorted);
    a `WHOLE_KEYS` key is one key, its dict or list one value."""
    def walk(section, prefix: str):
        for name in section.keys():
            key, value = prefix + name, section[name]
            if isinstance(value, (dict, ml_collections.ConfigDict)) and key not in WHOLE_KEYS:
                yield from walk(value, key + ".")
            else:
                yield key
    order = {key: i for i, key in enumerate(HELP)}
    return sorted(walk(cfg, ""), key=lambda key: (order.get(key, len(order)), key))


def config_value(cfg, key: str):
    """The value of a `config_keys` key, a ConfigDict as a plain dict."""
    value = reduce(lambda section, name: section[name], key.split("."), cfg)
    return value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` at the embedded default's settings: the tiny offline model on the CPU, a few minutes on 2 cores."""
    c.run_dir = "runs/tiny_ocr"
    c.model.update(path="tiny", dtype="float32", param_dtype="float32", remat="none", scan_unroll=1)
    c.lora.update(rank=8, alpha=16.0)
    c.rollout.update(engine="diffusers", dtype="float32", device="cpu", num_gpus=0.0, sleep_while_training=False,
                     layout="colocated")
    c.sample.update(height=40, width=72, num_steps=4, window_range=(0, 3), prompts_per_step=4, group_size=4,
                    prompts_per_call=2)
    c.train.update(num_steps=10, num_micro_batches=1, num_mini_batches=1, old_log_prob="rollout", xla_options={})
    c.reward.update(workers=2, options={"ocr": {"num_threads": 1}})
    c.eval.update(every=5, num_prompts=4, num_steps=4)
    c.checkpoint.update(every=5, keep=3)
    return c
