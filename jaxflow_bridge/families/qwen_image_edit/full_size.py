"""A Qwen-Image-Edit pipeline at the real size with random weights, for benchmarks and `model.init=random` runs
(nothing downloaded): Qwen-Image's (`jaxflow_bridge/families/qwen_image/full_size.py`: the 20.4B transformer, whose
config the edit model shares, the VAE, and the text encoder of Qwen2.5-VL-7B's size with its vision tower, which the
edit conditioning runs over the reference images) as an edit pipeline with the edit templates' tokenizer, and the
released folder's `processor/` (Qwen2.5-VL's pixel bounds), which vLLM-Omni's edit pipelines load.
`scripts/make_random_pipeline.py --family qwen_image_edit` writes it as a folder."""
from __future__ import annotations

from pathlib import Path

from jaxflow_bridge.families.qwen_image.full_size import full_size_modules
from jaxflow_bridge.families.qwen_image.tiny import save_slow_tokenizer_files
from jaxflow_bridge.families.qwen_image_edit.tiny import TEMPLATES, assemble, write_processor

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 16384  # Qwen/Qwen-Image-Edit's processor/preprocessor_config.json


def full_size_pipeline(device, transformer_device=None, text_encoder: str = "full", plus: bool = False):
    """`qwen_image.full_size.full_size_pipeline`'s modules (the same arguments) as a ``QwenImageEditPipeline``
    (``QwenImageEditPlusPipeline`` with `plus`) whose encoder's ids are the edit tokenizer's."""
    return assemble(*full_size_modules(device, transformer_device, text_encoder, templates=TEMPLATES), plus)


def finish_folder(out: Path, pipe) -> None:
    """What a saved edit folder adds to the diffusers components: the tokenizer's slow files of the edit templates
    and `processor/`."""
    save_slow_tokenizer_files(Path(out) / "tokenizer", TEMPLATES)
    write_processor(out, pipe.tokenizer, TEMPLATES, MIN_PIXELS, MAX_PIXELS)
