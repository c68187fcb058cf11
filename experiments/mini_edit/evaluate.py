"""Edit-OCR of a pipeline folder (optionally with a PEFT LoRA) on held-out sign edits, with its standard error.

    python -m experiments.mini_edit.evaluate --pipeline OUT/pipeline [--lora RUN/lora_final]
        --data OUT/data/test.jsonl --json OUT/eval/before.json --grid OUT/eval/before.png [--num 200 --steps 10]

Sampling is the trainer's eval of configs/mini_edit.py (mini_ocr's `eval_sampling` over that config; --steps and
--guidance replace its eval.num_steps and eval.guidance): deterministic ODE, one edit per pair from seed = its
index, on the edit rollout's own `RolloutPipeline` with the pair's source sign as its reference; scores are the
config's reward, `EditOcrReward` with its options (OCR of the target word less the change outside the text). The grid
shows the first 16 pairs, source beside edit.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from experiments.mini_ocr.evaluate import add_eval_arguments, eval_sampling
from jaxflow.config import validation as config_lib
from jaxflow.run.data import PromptItem, load_prompts, load_reference
from jaxflow.run.metrics_log import image_grid
from jaxflow_bridge.contract.lora import read_peft
from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import RolloutPipeline
from jaxflow_bridge.rewards.edit_ocr import EditOcrReward

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "mini_edit.py"


def reward() -> EditOcrReward:
    """configs/mini_edit.py's reward: edit_ocr with its options."""
    cfg = config_lib.config_module(CONFIG).get_config()
    return EditOcrReward(**cfg.reward.options["edit_ocr"])


def evaluate(pipeline: Path, items: list[PromptItem], lora: Path | None = None, steps: int | None = None,
             guidance: float | None = None, device: str | None = None, chunk: int = 64) -> dict:
    """Edit-OCR scores (mean, standard error, per pair), edits and sources of one eval-sampling edit per pair,
    seeded by its index."""
    pipe = RolloutPipeline.from_pretrained(pipeline, "float32", device)
    if lora is not None:
        tensors, config = read_peft(lora)
        pipe.update_lora(tensors, 1, config)
    sampling = eval_sampling(steps, guidance, CONFIG)
    refs = [load_reference(it.image, sampling.height, sampling.width) for it in items]
    prompts = [it.prompt for it in items]
    images = np.concatenate([
        pipe.generate(prompts[i:i + chunk], 1, sampling, list(range(i, min(i + chunk, len(items)))),
                      references=refs[i:i + chunk]).images for i in range(0, len(items), chunk)])
    sources = np.concatenate(refs)
    scores = reward()(images, prompts, sources=sources, targets=[it.target for it in items])
    return dict(mean=float(scores.mean()), se=float(scores.std(ddof=1) / np.sqrt(len(scores))), n=len(scores),
                scores=[round(float(s), 4) for s in scores], images=images, sources=sources)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_eval_arguments(p)
    p.add_argument("--data", type=Path, required=True, help="edit JSONL (experiments/mini_edit/signs.py)")
    a = p.parse_args(argv)
    items = load_prompts(a.data)[:a.num]
    start = time.perf_counter()
    out = evaluate(a.pipeline, items, a.lora, a.steps, a.guidance, device=a.device)
    images, sources = out.pop("images"), out.pop("sources")
    out.update(seconds=round(time.perf_counter() - start, 1), lora=str(a.lora) if a.lora else None)
    shown = min(16, len(items))
    pairs = np.stack([sources[:shown], images[:shown]], 1).reshape(-1, *images.shape[1:])
    captions = [c for it, s in zip(items, out["scores"]) for c in (it.prompt, f"{s:.2f} -> {it.target}")]
    image_grid(pairs, captions, a.grid, columns=4)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out) + "\n")
    print(f"edit-OCR {out['mean']:.3f} ± {out['se']:.3f} (n={out['n']}, {out['seconds']}s) -> {a.json}")


if __name__ == "__main__":
    main()
