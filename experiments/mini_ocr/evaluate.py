"""OCR reward of a pipeline folder (optionally with a PEFT LoRA) on held-out prompts, with its standard error.

    python -m experiments.mini_ocr.evaluate --pipeline OUT/pipeline [--lora RUN/lora_final]
        --prompts data/mini_ocr/test.txt --json OUT/eval/before.json --grid OUT/eval/before.png
        [--num 200 --steps 10 --guidance 4.0] [--also-steps 40]

Sampling is the trainer's eval of configs/mini_ocr.py (`jaxflow.config.validation.sampling(eval_mode=True)`; --steps and
--guidance replace its eval.num_steps and eval.guidance): deterministic ODE, one image per prompt from seed = its
index, on the rollout's own `RolloutPipeline`; scores are `OcrReward`. The grid shows the first 32. The JSON holds the
steps and guidance it sampled with. --also-steps N evaluates the same prompts again at N denoising steps into
NAME_sN.json and NAME_sN.png beside --json and --grid (flow_grpo and verl-omni train OCR at 10 steps and evaluate
at 40).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from jaxflow.config import derived
from jaxflow.config import sections
from jaxflow.config import validation as config_lib
from jaxflow.run.data import load_prompts
from jaxflow.run.metrics_log import image_grid
from jaxflow_bridge.contract.lora import read_peft
from jaxflow_bridge.rewards.ocr import OcrReward
from jaxflow_bridge.families.qwen_image.diffusers_pipeline import RolloutPipeline
from jaxflow_bridge.rollout.sampling import SamplingParams

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "mini_ocr.py"


def eval_sampling(steps: int | None = None, guidance: float | None = None, config: Path = CONFIG) -> SamplingParams:
    """configs/mini_ocr.py's (or `config`'s) eval sampling (`jaxflow.config.validation.sampling(eval_mode=True)`);
    `steps` and `guidance`, where given, replace its eval.num_steps and eval.guidance."""
    cfg = config_lib.config_module(config).get_config()
    if steps is not None:
        cfg.eval.num_steps = steps
    if guidance is not None:
        cfg.eval.guidance = guidance
    return SamplingParams.from_dict(derived.sampling(sections.build(cfg), eval_mode=True))


def load(pipeline: Path, lora: Path | None = None, device: str | None = None) -> RolloutPipeline:
    """The pipeline folder in float32 on `device`, with the PEFT `lora` bound where given."""
    pipe = RolloutPipeline.from_pretrained(pipeline, "float32", device)
    if lora is not None:
        tensors, config = read_peft(lora)
        pipe.update_lora(tensors, 1, config)
    return pipe


def evaluate(pipe: RolloutPipeline, prompts: list[str], steps: int | None = None, guidance: float | None = None,
             chunk: int = 64) -> dict:
    """OCR scores (mean, standard error, per prompt) and images of one `eval_sampling(steps, guidance)` image per
    prompt, seeded by its index, from `load`'s pipeline."""
    sampling = eval_sampling(steps, guidance)
    images = np.concatenate([pipe.generate(prompts[i:i + chunk], 1, sampling, list(range(i, i + len(
        prompts[i:i + chunk])))).images for i in range(0, len(prompts), chunk)])
    scores = OcrReward()(images, prompts)
    return dict(mean=float(scores.mean()), se=float(scores.std(ddof=1) / np.sqrt(len(scores))), n=len(scores),
                scores=[round(float(s), 4) for s in scores], steps=sampling.num_inference_steps,
                guidance=sampling.true_cfg_scale, images=images)


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    """The options every mini proof's evaluate shares (all but its held-out data's)."""
    p.add_argument("--pipeline", type=Path, required=True)
    p.add_argument("--lora", type=Path, default=None, help="a PEFT folder, e.g. RUN_DIR/lora_final")
    p.add_argument("--num", type=int, default=200)
    p.add_argument("--steps", type=int, help="denoising steps (default: the config's eval.num_steps, 10)")
    p.add_argument("--guidance", type=float, help="true CFG scale (default: the config's eval.guidance, 4)")
    p.add_argument("--device", default=None)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--grid", type=Path, required=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_eval_arguments(p)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--also-steps", type=int, nargs="+", default=(),
                   help="evaluate again at each of these denoising steps: NAME_sN.json / .png beside --json / --grid")
    a = p.parse_args(argv)
    prompts = [it.prompt for it in load_prompts(a.prompts)][:a.num]
    start = time.perf_counter()
    pipe = load(a.pipeline, a.lora, a.device)  # once for every step count; the first eval's seconds include it
    for steps, tag in ((a.steps, ""), *((n, f"_s{n}") for n in a.also_steps)):
        out = evaluate(pipe, prompts, steps, a.guidance)
        images = out.pop("images")
        out.update(seconds=round(time.perf_counter() - start, 1), lora=str(a.lora) if a.lora else None)
        start = time.perf_counter()
        json_path, grid = (path.with_name(f"{path.stem}{tag}{path.suffix}") for path in (a.json, a.grid))
        image_grid(images[:32], [f"{s:.2f} {q}" for s, q in zip(out["scores"], prompts)], grid, columns=4)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(out) + "\n")
        print(f"OCR {out['mean']:.3f} ± {out['se']:.3f} (n={out['n']}, {out['steps']} steps, {out['seconds']}s) -> "
              f"{json_path}")


if __name__ == "__main__":
    main()
