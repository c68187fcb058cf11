"""The reward registry: name -> factory(**options) -> reward fn, and which rewards read a prompt's target text."""

from __future__ import annotations

from typing import Callable

from jaxflow_bridge.rewards.base import RewardFn
from jaxflow_bridge.rewards.edit_ocr import EditOcrReward
from jaxflow_bridge.rewards.jpeg import jpeg_compressibility, jpeg_incompressibility
from jaxflow_bridge.rewards.ocr import OcrReward
from jaxflow_bridge.rewards.pixel import brightness, midtone
from jaxflow_bridge.rewards.shuffled import Shuffled
from jaxflow_bridge.rewards.vlm.vlm_edit_judge import VlmEditJudge
from jaxflow_bridge.rewards.vlm.vlm_judge import VlmJudge
from jaxflow_bridge.rewards.vlm.vlm_ocr import VlmOcrReward


def _torch_model(name: str, module: str = "clip") -> Callable[..., RewardFn]:
    """A factory for reward model `name` of jaxflow_bridge/rewards/<module>.py, imported (with torch and transformers) only
    when that reward is built."""
    def build(**options) -> RewardFn:
        import importlib
        return getattr(importlib.import_module(f"jaxflow_bridge.rewards.models.{module}"), name)(**options)
    return build


# name -> factory(**options) -> reward fn
REGISTRY: dict[str, Callable[..., RewardFn]] = {
    "ocr": OcrReward,
    # edits (conditioned: the source image and target text, rewards/base.py): OCR of the target less the change
    # outside the text (options: consistency, margin, then OcrReward's)
    "edit_ocr": EditOcrReward,
    "vlm_ocr": VlmOcrReward,
    "vlm_judge": VlmJudge,  # a question per image about its prompt (GenEval-style yes/no, or a 1-10 rating)
    "vlm_edit_judge": VlmEditJudge,  # edits (conditioned): a 1-10 rating of instruction following and consistency
    "jpeg_compressibility": lambda: jpeg_compressibility,
    "jpeg_incompressibility": lambda: jpeg_incompressibility,
    "brightness": lambda: brightness,
    "midtone": lambda: midtone,  # closeness to mid-grey: the gold reward that brightness ruins
    # the control of the mini OCR proof: OCR scores permuted across the batch (options: seed, then OcrReward's)
    "ocr_shuffled": lambda seed=0, **ocr: Shuffled(OcrReward(**ocr), seed),
    # the edit proof's control: edit-OCR scores permuted across the batch (options: seed, then EditOcrReward's)
    "edit_ocr_shuffled": lambda seed=0, **edit: Shuffled(EditOcrReward(**edit), seed),
    # CLIP-based reward models from local folders (options: path, processor_path, device, dtype, batch_size)
    "pickscore": _torch_model("PickScore"),
    "clip_score": _torch_model("ClipScore"),
    "aesthetic": _torch_model("Aesthetic"),  # also mlp_path
    "hps": _torch_model("Hps", "hps"),  # HPS v2.1: path = the open_clip checkpoint file, processor_path a folder
    "image_reward": _torch_model("ImageReward", "image_reward"),  # path, med_config, tokenizer_path
}


# rewards that score the text a prompt asks to render (its first "...", or an edit row's "target"): their prompt
# files must name one
NEED_TARGET = frozenset({"ocr", "vlm_ocr", "ocr_shuffled", "edit_ocr", "edit_ocr_shuffled"})
# conditioned rewards (base.py): they score an edit against its source image, so their data must be an edit dataset
CONDITIONED = frozenset({"edit_ocr", "edit_ocr_shuffled", "vlm_edit_judge"})
