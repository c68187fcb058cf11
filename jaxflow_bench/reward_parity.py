"""Reward parity on CPU (float32): each reward model of jaxflow_bridge/rewards/ against its reference code
(tests/rewards/reference_rewards.py: flow_grpo's PickScore scorer, torchmetrics' CLIPScore, LAION's aesthetic script,
hpsv2's score, ImageReward's score) on the same PAIRS non-square image/prompt pairs, with seeded random checkpoints
in the released layouts at 224 px (tests/rewards/reward_checkpoints.py; no weights are downloaded) and a CLIP BPE
vocabulary learned offline (the real one does not ship here).

Per reward: `max_abs_delta` (the reward against its reference), `score_spread` (max - min of the reference's
scores, for scale), and what each input rule is worth on these pairs (`delta_if_*`: the reward with that rule
undone, against the reference), and `delta_bf16` (the reward in bfloat16 against its float32 self; the full-size
models' precision effect needs a GPU and is not measured here). Writes benchmarks/results/reward_parity.json.

    PYTHONPATH=$PWD python -m jaxflow_bench.reward_parity [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from jaxflow_bench.results import write_result
from jaxflow_bridge.rewards.models import preprocess
from jaxflow_bridge.rewards.models.clip import AestheticMLP
from jaxflow_bridge.rewards.multi import build_reward
from tests.rewards import reference_rewards as ref
from tests.rewards import reward_checkpoints as ckpt

SIZE = 224
# (H, W): landscape and portrait; 4 of them resize to a side whose excess over 224 is 3 (mod 4), where crops differ
SHAPES = [(512, 768), (768, 512), (600, 410), (410, 600), (480, 853), (853, 480), (640, 959), (959, 640), (500, 700),
          (1024, 576)]
PROMPTS = ["a red fox “sitting” in the snow at sunset", "Fish &amp; chips on a plate, studio lighting",
           "ﬂuﬀy cats sleeping on a ｂｌｕｅ sofa", "A SIGN THAT SAYS   \"HELLO WORLD\" in neon",
           "a watercolor painting of a lighthouse\nby the sea", "a castle " + "with towers and flags " * 30,
           "the word OCR written on a blackboard &lt;3", "a cute corgi wearing sunglasses at the beach",
           "an oil painting of a castle in the mountains", "a futuristic city skyline at night, cyberpunk style"]
PAIRS = len(SHAPES)


def image(shape: tuple[int, int], seed: int) -> np.ndarray:
    """An image-like uint8 picture: smooth colour fields (a 6 x 6 grid, bicubic-upsampled) plus fine noise."""
    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
    smooth = np.asarray(coarse.resize(shape[::-1], Image.Resampling.BICUBIC), dtype=np.float32)
    return np.clip(smooth + rng.normal(0, 12, (*shape, 3)), 0, 255).astype(np.uint8)


def _scores(fn, pairs) -> np.ndarray:
    return np.concatenate([np.asarray(fn(im[None], [p])).reshape(-1) for im, p in pairs])


def figures(folder: Path) -> dict:
    from transformers import BertTokenizer, CLIPModel

    pairs = [(image(s, i), PROMPTS[i]) for i, s in enumerate(SHAPES)]
    merges = ckpt.learn_merges(ckpt.CORPUS, 300)
    clip_dir = ckpt.write_clip_model(folder / "clip", merges, image_size=SIZE, patch_size=32)
    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), ref.clip_processor(clip_dir)
    torch.manual_seed(1)
    mlp = AestheticMLP(16).eval()
    torch.save(mlp.state_dict(), folder / "mlp.pth")
    n = len(ckpt.json.loads((clip_dir / "vocab.json").read_text()))
    arch = {"vision": {**ckpt.HPS_ARCH["vision"], "image_size": SIZE, "patch_size": 32},
            "text": {**ckpt.HPS_ARCH["text"], "vocab_size": n, "bos_token_id": n - 2, "eos_token_id": n - 1},
            "projection_dim": ckpt.HPS_ARCH["projection_dim"]}
    hps_sd = ckpt.open_clip_state(arch)
    torch.save({"state_dict": hps_sd}, folder / "hps.pt")
    vision = {**ckpt.IR_VISION, "image_size": SIZE, "patch_size": 32}
    ir_sd = ckpt.image_reward_state(vision, ckpt.IR_MED)
    ir_path, med, tok = ckpt.write_image_reward(folder, ir_sd)
    bert = BertTokenizer(str(tok / "vocab.txt"))
    tokenizer = ref.OpenClipTokenizer(merges, preprocess.fix_text)  # ftfy.fix_text does not install here

    def image_reward_ref(images, prompts):
        text = bert(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        pixels = torch.stack([ref.openai_clip_transform(im, SIZE) for im in images])
        with torch.no_grad():
            return ckpt.image_reward_forward(ir_sd, vision, ckpt.IR_MED, pixels, text["input_ids"],
                                             text["attention_mask"]).numpy()

    options = {"pickscore": {"path": str(clip_dir)}, "clip_score": {"path": str(clip_dir)},
               "aesthetic": {"path": str(clip_dir), "mlp_path": str(folder / "mlp.pth")},
               "hps": {"path": str(folder / "hps.pt"), "processor_path": str(clip_dir), "arch": arch},
               "image_reward": {"path": str(ir_path), "med_config": str(med), "tokenizer_path": str(tok),
                                "vision": vision}}
    references = {
        "pickscore": lambda ims, ps: ref.pickscore(model, processor, ims, ps),
        "clip_score": lambda ims, ps: ref.torchmetrics_clip_score(model, processor, ims, ps),
        "aesthetic": lambda ims, ps: ref.laion_aesthetic(model, mlp, ims, SIZE),
        "hps": lambda ims, ps: ref.hpsv2_score(lambda px, ids: ckpt.open_clip_features(hps_sd, arch, px, ids),
                                               tokenizer, ims, ps, SIZE),
        "image_reward": image_reward_ref}
    out = {}
    for name, reference in references.items():
        want = _scores(reference, pairs)
        reward = build_reward({name: 1.0}, **{name: options[name]}).rewards[name]
        out[f"{name}/max_abs_delta"] = float(np.abs(_scores(reward, pairs) - want).max())
        out[f"{name}/score_spread"] = float(np.ptp(want))
        bf16 = build_reward({name: 1.0}, **{name: {**options[name], "dtype": "bfloat16"}}).rewards[name]
        out[f"{name}/delta_bf16"] = float(np.abs(_scores(bf16, pairs) - _scores(reward, pairs)).max())
        for rule, undone in _undone(name, reward).items():
            out[f"{name}/delta_if_{rule}"] = float(np.abs(_scores(undone, pairs) - want).max())
    out["pairs"] = PAIRS
    return out


def _undone(name: str, reward) -> dict:
    """The reward with one of its input rules undone (as it scored before): name -> fn."""
    def with_pixels(crop):
        def fn(images, prompts):
            kept, reward.pixels = reward.pixels, preprocess.Pixels(SIZE, ref.OPENAI_MEAN, ref.OPENAI_STD, crop)
            try:
                return reward(images, prompts)
            finally:
                reward.pixels = kept
        return fn

    if name in ("aesthetic", "image_reward"):
        return {"floor_crop": with_pixels("floor")}
    if name == "hps":
        def uncleaned(images, prompts):
            with torch.no_grad():
                image, text = reward.embed(images, prompts)
            return (image * text).sum(-1).numpy()
        return {"centre_crop": with_pixels("floor"), "uncleaned_prompt": uncleaned}
    if name == "clip_score":
        def end_token_kept(images, prompts):
            reward.keep_end_token = True
            try:
                return reward(images, prompts)
            finally:
                reward.keep_end_token = False
        return {"end_token_kept": end_token_kept}
    return {}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        flat = figures(Path(folder))
    path = write_result(args.out, "reward_parity", flat, command="python -m jaxflow_bench.reward_parity", extra={
        "cpu": platform.processor() or platform.machine(), "dtype": "float32",
        "inputs": f"{PAIRS} non-square images {SHAPES} with their prompts (curly quotes, HTML entities, ligatures, "
                  f"full-width letters, a prompt over 77 tokens); seeded random checkpoints at 224 px, patch 32, "
                  f"width 32 (ImageReward 24/16), 2 layers a tower; a CLIP BPE vocabulary of 300 learned merges",
        "pending": "the full-size models' bf16/fp16 effect against fp32 (GPU)"})
    for k, v in flat.items():
        print(f"{k}: {v:.3g}")
    print(path)


if __name__ == "__main__":
    main()
