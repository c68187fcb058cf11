"""The config's every key in one base, the real recipe, and the tiny offline overrides the defaults build on.

`base()` is the real setting, Qwen-Image LoRA FlowGRPO on OCR prompts with the vLLM-Omni rollout
(`configs/qwen_ocr.py`). Values and their sources:
- 512^2, 10 sampling steps, noise 1.2 'sde', window 2 in [0, 5), true CFG 4, 50 ODE eval steps:
  flow_grpo `config/grpo.py: pickscore_qwenimage` and verl-omni
  `examples/flowgrpo_trainer/qwen_image/run_qwen_image_ocr_lora.sh`.
- LoRA r64 / alpha128 on the 12 targets: flow_grpo `scripts/train_qwenimage.py`, verl-omni's OCR script.
- lr 3e-4, AdamW b (0.9, 0.999), wd 1e-4, eps 1e-8, grad clip 1.0, adv clip 5: flow_grpo `config/base.py`.
- clip range 1e-4: flow_grpo's default (verl-omni's script uses 1e-5); beta 0: both Qwen recipes.
- 32 prompts x 16 images per step: both (pickscore_qwenimage groups per epoch; verl-omni train_batch_size 32, n 16).
- 2 optimizer updates of 256 samples per step, like both: flow_grpo `scripts/train_qwenimage.py` with
  num_batches_per_epoch 4 and gradient_accumulation_steps 2 (2 updates per epoch), verl-omni's
  ppo_mini_batch_size 16 of train_batch_size 32 prompts. Here train.num_mini_batches 2: each update takes 16 whole
  prompt groups x 16 images (shuffled), in 64 micro-batches of 4 samples: the largest micro-batch whose step fits
  one H200 beside the vLLM-Omni engine, measured (`scripts/fit_micro_batch.py`, BENCHMARKS.md): 8 samples need
  66.9 GiB beside the weights, 4 need 37.9 GiB (JAX's pool 0.58 of the GPU leaves 41.5 free, and the engine its
  58 GiB), 2 need 22.9 GiB; 4 samples train 12% faster than 2 (12.8 s against 14.6 a step of 32 images). On more
  devices a micro-batch spreads over them (train.num_micro_batches counts the micro-batches of one update).
- old log-probs recomputed by the trainer before the first update (verl-omni's `compute_log_prob`; flow_grpo
  takes the rollout's): the bf16 rollout's log-probs differ from the trainer's by ~1e-4..4e-4
  (scripts/verify_logprob_parity.py), more than the 1e-4 clip band. The mismatch stays in the metrics
  (logp_diff_*).
- negative prompt " ": flow_grpo's Qwen pipeline. Reward: OCR (flow_grpo's `ocr`; verl-omni uses a VLM judge,
  available here as `vlm_ocr`).

`tiny(c)` turns a config into the embedded default's: the tiny offline Qwen-Image, diffusers rollout on CPU, float32,
toy sizes (the tiny VAE has spatial factor 4, so 40x72 images are 5x9 packed latent tokens).
"""
from __future__ import annotations

from pathlib import Path

import ml_collections

from bridge.contract.keymap import DEFAULT_LORA_TARGETS

DATA = Path(__file__).resolve().parents[1] / "data"  # the clone's prompt files, found from any working directory


def base() -> ml_collections.ConfigDict:
    """Every key of the training config, at the real recipe's values."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.run_dir = "runs/qwen_ocr"
    c.model = dict(path="",  # required: a diffusers Qwen-Image folder (model_index.json, transformer/, ...)
                   dtype="bfloat16", param_dtype="bfloat16", attention="auto",
                   # save q/k/v, MLP hidden and cuDNN attention's output + softmax statistics (bf16 on GPUs only;
                   # float32 or a CPU: "save_matmuls"): 2.2% faster than save_matmuls (BENCHMARKS.md, train step)
                   remat="save_matmuls_stats",
                   # blocks per iteration of the scan over the 60 stacked blocks; >= 60 runs them unrolled, each
                   # block's weights held as arrays of their own: with lora_gemm "auto", the recipe's train phase
                   # 1.12x on one H200 (11.1 s against 12.4 a step of 32 images; the step 1.03x) for ~4 min more
                   # compile at start (BENCHMARKS.md, the recipe on one GPU); 1: a scan, compiled in ~16 s
                   scan_unroll=60,
                   matmul_precision="auto",  # "highest" for float32 compute (true fp32 on GPUs, not TF32)
                   # "pallas": the adapted linears as one fused Hopper GEMM each (bf16, one H100/H200; BENCHMARKS.md,
                   # the fused LoRA GEMM); "xla" runs anywhere; "auto": pallas where it runs and pays (unrolled
                   # blocks, bf16, one H100/H200, rows that tile), else xla, the choice and its reason logged at start
                   lora_gemm="auto",
                   init="checkpoint")  # "random": base weights drawn from `seed` (bridge/contract/random_weights.py)
    c.lora = dict(rank=64, alpha=128.0, targets=list(DEFAULT_LORA_TARGETS))
    c.rollout = dict(engine="vllm_omni", dtype="bfloat16", device="cuda", num_servers=1, num_gpus=1.0,
                     num_cpus=1.0, max_retries=2, address="",
                     # the engine's weights to CPU while JAX trains: only where something can use the freed memory;
                     # JAX's fixed pool cannot (it never grows), so off (one H200: 0.716 img/GPU/s without, 0.681
                     # with, first sleep 29 s; BENCHMARKS.md, the recipe on one GPU); the trainer warns if set there
                     sleep_while_training=False,
                     # where the engines run (docs/design.md, where things run): "colocated", Ray actors on the
                     # trainer's own GPUs, one per device, taking turns with it; "split", actors on GPUs apart from
                     # the trainer's (rollout.overlap keeps both busy); "in_process", one engine in the trainer's
                     # process, no Ray
                     layout="colocated",
                     # True: step k+1's rollout runs while step k trains (one step off-policy; for rollout GPUs apart
                     # from the trainer's: docs/design.md, "Overlap")
                     overlap=False,
                     compile=False,  # diffusers engine: torch.compile the transformer block
                     # true CFG's positive and negative rows in one forward, text padded to one length ("batched"),
                     # or one forward each at its own length ("split": no attention mask within a prompt group;
                     # vLLM-Omni's rollout 1.05x with the LoRA, 1.07x without: BENCHMARKS.md, true CFG)
                     cfg_forward="split")
    c.sample = dict(height=512, width=512, num_steps=10, guidance=4.0, noise_level=1.2, sde_type="sde",
                    window_size=2, window_range=(0, 5), negative_prompt=" ",
                    same_latent=False,  # True: a prompt group shares its initial noise (flow_grpo's same_latent)
                    # prompt tokens: the train step pads text to this, the rollout refuses longer prompts; the longest
                    # OCR prompt has 74 (96 rather than 128: 2.8% fewer train-step tokens at 512^2)
                    max_sequence_length=96,
                    prompts_per_step=32, group_size=16, prompts_per_call=4)
    c.train = dict(num_steps=300,
                   max_minutes=0.0,  # > 0: end the run (checkpoint, lora_final) before this wall time; 0: no limit
                   num_micro_batches=64, learning_rate=3e-4, clip_range=1e-4, adv_clip=5.0,
                   beta=0.0, global_std=True, max_grad_norm=1.0, weight_decay=1e-4, ema_decay=0.0,
                   adam_b1=0.9, adam_b2=0.999, adam_eps=1e-8,  # flow_grpo's adam_beta1/2, adam_epsilon
                   # "recompute" (the trainer's, verl-omni's compute_log_prob), "rollout" (the engine's, flow_grpo) or
                   # "rollout_corrected": the engine's with rejection, verl's rollout-correction bypass mode: a sample's
                   # window step with exp(logp - logp_rollout) outside [1/t, t] trains nothing (docs/design.md)
                   old_log_prob="recompute", rejection_threshold=1.001,
                   # "guard": GRPO-Guard's ratio (arXiv 2510.22319; verl-omni's grpo_guard loss), the old policy's SDE
                   # mean drift added and every step brought to one scale; needs old_log_prob="recompute"
                   ratio_norm="none",
                   num_mini_batches=2,  # optimizer updates per step, each on whole prompt groups
                   num_inner_epochs=1,  # passes over the step's mini-batches
                   # True: micro-batches whose advantages are all 0 (prompt groups of equal rewards) are not trained;
                   # flow_grpo's SD3 trainer drops such samples, its Qwen-Image script does not (docs/design.md)
                   drop_zero_advantage=False,
                   # "nft": DiffusionNFT (arXiv 2509.16117) instead of FlowGRPO: trains on the rollout's final
                   # latents noised afresh (no log-probs, no CFG: sample.guidance=1), the rollout sampling with an old
                   # policy that trails the LoRA (docs/numerics.md §10). nft: its beta (the implicit policies'
                   # step), timesteps trained a sample (0: every sampling step but one, its 0.99 fraction), and the
                   # old policy's decay: 0 for decay_flat updates, then decay_rate an update up to decay_max (its
                   # OCR recipe `config/nft.py: sd3_ocr`)
                   algorithm="flowgrpo",
                   nft=dict(beta=0.1, timesteps=0, decay_flat=75, decay_rate=0.0075, decay_max=0.999),
                   # XLA options of the train step's jits: cuBLAS GEMMs, no Triton ones: 1.4% faster on an H200
                   xla_options={"xla_gpu_enable_triton_gemm": False})  # (BENCHMARKS.md, train step)
    # 8 reward threads, each with its own RapidOCR engine of 2 onnxruntime threads (16 cores a GPU)
    c.reward = dict(fns={"ocr": 1.0}, options={"ocr": {"num_threads": 2}}, workers=8)
    c.data = dict(train=str(DATA / "ocr" / "train.txt"), test=str(DATA / "ocr" / "test.txt"))
    c.eval = dict(every=30, num_prompts=32, num_steps=50, guidance=4.0)
    c.checkpoint = dict(every=10, keep=3)
    c.sharding = dict(data=-1, fsdp=1, tensor=1, rules=[("batch", ("data", "fsdp"))])
    c.log = dict(tensorboard=True, progress=True)
    # jax.profiler trace of steps start_step .. start_step + num_steps - 1 (0 steps: off); dir "" = run_dir/profile
    c.profile = dict(start_step=2, num_steps=0, dir="")
    return c


def tiny(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`c` at the embedded default's settings: the tiny offline model on the CPU, a few minutes on 2 cores."""
    c.run_dir = "runs/tiny_ocr"
    c.model.update(path="tiny", dtype="float32", param_dtype="float32", remat="none", scan_unroll=1)
    c.lora.update(rank=8, alpha=16.0)
    c.rollout.update(engine="diffusers", dtype="float32", device="cpu", num_gpus=0.0, sleep_while_training=False)
    c.sample.update(height=40, width=72, num_steps=4, window_range=(0, 3), prompts_per_step=4, group_size=4,
                    prompts_per_call=2)
    c.train.update(num_steps=10, num_micro_batches=1, num_mini_batches=1, old_log_prob="rollout", xla_options={})
    c.reward.update(workers=2, options={"ocr": {"num_threads": 1}})
    c.eval.update(every=5, num_prompts=4, num_steps=4)
    c.checkpoint.update(every=5, keep=3)
    return c
