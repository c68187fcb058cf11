"""Eval grid captions wrap at word boundaries; a caption too long for its lines ends in ' ...', never mid-word."""
import numpy as np
from PIL import Image

from jaxflow.run.metrics_log import caption_lines, image_grid

PROMPT = '0.42 a hot air balloon with "MIDNIGHT VALLEY" written on the envelope above a misty lake at dawn'


def test_captions_wrap_and_end_at_word_boundaries():
    lines = caption_lines(PROMPT, 26, 3)
    words = set(PROMPT.split())
    assert len(lines) == 3 and all(len(line) <= 26 for line in lines) and lines[-1].endswith(" ...")
    assert all(w in words for line in lines for w in line.removesuffix(" ...").split()), lines
    assert caption_lines("0.10 short", 26, 3) == ["0.10 short"]


def test_image_grid_writes_captioned_cells(tmp_path):
    images = np.zeros((2, 40, 72, 3), np.uint8)
    image_grid(images, [PROMPT, "0.1 x"], tmp_path / "g.png", columns=2)
    assert Image.open(tmp_path / "g.png").size == (2 * 160, 40 + 40)


def test_eval_calls_hold_as_many_images_as_a_training_call(tmp_path):
    """README's GPU command (1 prompt a call, groups of 16) evaluated its 32 held-out prompts one image a call, at
    batch 1; a call now holds a training call's 16 images."""
    from types import SimpleNamespace

    from jaxflow.config import recipes
    from jaxflow.run.driver import Driver

    cfg = recipes.tiny(recipes.base())
    cfg.sample.prompts_per_call, cfg.sample.group_size, cfg.eval.num_prompts = 1, 16, 32
    cfg.run_dir = str(tmp_path)
    calls = []

    def generate(prompts, n, sampling, seeds, per_call, references=None):
        calls.append((len(prompts), n, per_call))
        return SimpleNamespace(images=np.zeros((len(prompts), 8, 8, 3), np.uint8))

    items = [SimpleNamespace(prompt=f"p{i}", image=None) for i in range(40)]
    scores = np.zeros(32, np.float32)
    pool = SimpleNamespace(submit=lambda *a: SimpleNamespace(result=lambda: {"avg": scores, "ocr": scores, "counts": {}}))
    fake = SimpleNamespace(cfg=cfg, test_items=items, rollout=SimpleNamespace(generate=generate), gold=None,
                           pool=pool, references=lambda its: Driver.references(fake, its))
    out = Driver.evaluate(fake, 3)
    assert calls == [(32, 1, 16)]
    assert out["eval_reward_mean"] == 0.0 and (tmp_path / "eval" / "step_000003.png").exists()
