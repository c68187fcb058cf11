"""FlowGRPO with the OCR reward on the mini text-rendering Qwen-Image, one GPU, about 10 minutes.

    python -m jaxflow.train --config configs/mini_ocr.py --config.model.path=OUT/pipeline
    python -m jaxflow.train --config configs/mini_ocr.py:control --config.model.path=OUT/pipeline

OUT/pipeline is built by experiments/mini_ocr/run.sh (which runs both). `:control` is the same run with the OCR scores
shuffled across the batch (`jaxflow_bridge/rewards/shuffled.py`): it must not raise OCR. Prompts: data/mini_ocr, written by
`python -m experiments.mini_ocr.words --out data/mini_ocr` (4000 train words, 200 held out for eval).
Both sides store float32 (the model is small); the diffusers engine runs in the trainer's process, the trainer's
matmuls run at XLA's default precision (TF32 on GPUs: its log-probs move ~1e-5, and the old log-probs are
recomputed by the trainer, so the ratio's reference is its own).

The RL recipe is flow_grpo's SD3 OCR one (`general_ocr_sd3_1gpu`), not the Qwen-Image speed recipe of base(), whose
short window in the high-noise steps held the held-out OCR flat here: every step but the last is an SDE step and
trained (window 9 of 10, noise 0.7), two optimizer updates per step, an EMA of the LoRA for the eval and the export;
but beta = 0 (flow_grpo's is 0.04). A prompt's 12 samples share their initial noise (`sample.same_latent`): it is no
trained action, so its share of a group's reward spread would only be noise in every advantage. With this recipe the
held-out OCR rose +0.149 to +0.207 on six pipelines built from nothing, and no shuffled control rose (BENCHMARKS.md,
"Mini OCR")."""
from pathlib import Path

from jaxflow.config.recipes import base, tiny

DATA = Path(__file__).resolve().parents[1] / "data" / "mini_ocr"
# the algorithm arms compared on this proof (experiments/mini_ocr/run.sh ARM=...): FlowGRPO as below (""), with
# GRPO-Guard's ratio ("guard"), with rollout correction instead of the recompute pass ("corrected"), with the
# zero-advantage filter ("dropzero": groups of equal rewards not trained), without CFG in its rollouts and evals
# ("cfgfree": as NFT's policy, so its rise starts from the same CFG-free "before"), or DiffusionNFT ("nft": CFG-free,
# deterministic rollouts, its OCR recipe's beta 0.1 and old-policy decay, eval without CFG too), MixGRPO ("mixgrpo":
# a 2-step SDE window shared by the step's samples, sliding over the schedule every 10 steps), its Flash variant
# ("mixgrpo_flash": DPM-Solver++(2M) after the window) or AWM ("awm": its OCR recipe's advantage-weighted matching,
# KL 0.003, one update a step as there); and FlowGRPO with the rollout in vLLM-Omni, in a Ray actor on the trainer's
# GPU, on the pipeline's bf16 copy (OUT/pipeline_bf16): its DiT in bf16 ("omni") or FP8 ("omni_fp8"; docs/mini_ocr.md,
# "FP8 arm")
ARMS = ("", "guard", "corrected", "dropzero", "cfgfree", "nft", "mixgrpo", "mixgrpo_flash", "awm", "omni", "omni_fp8")
VARIANTS = tuple(f"{arm}{sep}{control}" for arm in ARMS for sep, control in (("", ""), ("_" if arm else "", "control")))


def get_config(variant: str = ""):
    if variant not in VARIANTS:
        raise ValueError(f"configs/mini_ocr.py:{variant}: unknown variant; choose one of {VARIANTS[1:]} or none "
                         f"(configs/mini_ocr.py)")
    arm, control = variant.removesuffix("control").removesuffix("_"), variant.endswith("control")
    c = tiny(base())
    c.run_dir = f"runs/mini_ocr{'_' + arm if arm else ''}{'_control' if control else ''}"
    c.model.path = ""  # the folder experiments/mini_ocr/run.sh builds: --config.model.path=OUT/pipeline
    c.lora.rank, c.lora.alpha = 32, 64.0
    c.rollout.update(device="cuda", num_gpus=1.0, layout="in_process")
    c.model.matmul_precision = "default"
    # one rollout call a step (192 images): faster steps than 4 calls whose OCR overlaps the next call's rollout,
    # side by side and alone on the GPU (docs/mini_ocr.md; benchmarks/HISTORY.md, "Mini OCR", attempts 8 and 13)
    c.sample.update(height=64, width=128, num_steps=10, guidance=4.0, noise_level=0.7, window_size=9,
                    window_range=(0, 9), max_sequence_length=32, prompts_per_step=16, group_size=12,
                    prompts_per_call=16, same_latent=True)
    # the eval and lora_final use the LoRA's EMA (flow_grpo's OCR recipe evaluates an EMA): about the last 20 updates
    # one 10-minute run: as many steps as fit in 8.75 minutes from the trainer's start (the first compiles; process
    # start-up comes on top; the step time on an H200: docs/mini_ocr.md), then the checkpoint and lora_final
    c.train.update(num_steps=1000, max_minutes=8.75, learning_rate=3e-4, beta=0.0, num_mini_batches=2,
                   old_log_prob="recompute", ema_decay=0.95)
    c.reward.fns = {"ocr_shuffled": 1.0} if control else {"ocr": 1.0}
    # the OCR of 192 small images a step on 16 cores: 12 engines of 1 thread each (the reward pool scores the step's
    # images in 12 pieces at once; with another run beside it on the machine, fewer: --config.reward.workers=7)
    c.reward.update(workers=12, options={"ocr": {"num_threads": 1}, "ocr_shuffled": {"num_threads": 1}})
    c.data = dict(train=str(DATA / "train.txt"), test=str(DATA / "test.txt"))
    c.eval.update(every=10, num_prompts=64, num_steps=10, guidance=4.0)
    c.checkpoint.update(every=10, keep=1)  # a run cut by a time limit resumes (experiments/mini_ocr/run.sh)
    if arm == "guard":
        c.train.ratio_norm = "guard"
    elif arm == "corrected":
        c.train.old_log_prob = "rollout_corrected"
    elif arm == "dropzero":
        c.train.drop_zero_advantage = True
    elif arm == "cfgfree":
        c.sample.guidance = c.eval.guidance = 1.0
    elif arm == "nft":
        c.train.algorithm = "nft"
        # its rollout is deterministic: a group's images differ only by their initial noise
        c.sample.update(guidance=1.0, sde_type="ode", same_latent=False)
        c.eval.guidance = 1.0
    elif arm in ("mixgrpo", "mixgrpo_flash"):
        c.train.algorithm = "mixgrpo"
        c.sample.update(window_size=2, solver="dpm2" if arm == "mixgrpo_flash" else "euler")
        c.train.mixgrpo.update(interval=10, stride=1)
    elif arm == "awm":
        c.train.algorithm = "awm"
        # its one update a step is all 192 samples: 'auto' splits it where a shared GPU's JAX pool is too small
        c.train.update(beta=0.003, num_mini_batches=1, num_micro_batches="auto", old_log_prob="rollout")
    elif arm in ("omni", "omni_fp8"):
        # the LoRA as layers in both (bf16's 'auto' would merge it; FP8 weights take no merge), so the two arms
        # differ in rollout.quantization alone
        c.rollout.update(engine="vllm_omni", dtype="bfloat16", layout="colocated", lora_apply="layers",
                         quantization="fp8" if arm == "omni_fp8" else "none")
    return c
