"""The tiny edit folder's `processor/`: what vLLM-Omni's edit pipelines load at start
(`Qwen2VLProcessor.from_pretrained(folder, subfolder="processor")`: the tokenizer, the image processor and the video
processor, by transformers' auto classes). transformers' video processor needs torchvision, absent here: its config
is checked by its keys and class name; the tokenizer and image processor are loaded and compared with the folder's
own (`tokenizer/`, `image_processor/`)."""
import ast
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from jaxflow_bridge.families.qwen_image_edit import tiny

FILES = {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "preprocessor_config.json",
         "video_preprocessor_config.json"}


@pytest.fixture(scope="module")
def folder() -> Path:
    return tiny.tiny_pipeline_path()


def test_the_processor_holds_what_the_loader_reads(folder):
    processor = folder / "processor"
    assert FILES <= {p.name for p in processor.iterdir()}
    image = json.loads((processor / "preprocessor_config.json").read_text())
    video = json.loads((processor / "video_preprocessor_config.json").read_text())
    vision = json.loads((folder / "text_encoder" / "config.json").read_text())["vision_config"]
    for config in (image, video):  # the tiny vision tower's patching, the tiny pixel bounds under the released keys
        assert (config["patch_size"], config["temporal_patch_size"], config["merge_size"]) == (
            vision["patch_size"], vision["temporal_patch_size"], vision["spatial_merge_size"])
        assert (config["min_pixels"], config["max_pixels"]) == (tiny.MIN_PIXELS, tiny.MAX_PIXELS)
    assert image["image_processor_type"] == "Qwen2VLImageProcessor"
    source = importlib.util.find_spec("transformers.models.qwen2_vl.video_processing_qwen2_vl").origin  # not imported
    classes = {n.name for n in ast.walk(ast.parse(Path(source).read_text())) if isinstance(n, ast.ClassDef)}
    assert video["video_processor_type"] in classes


def test_the_processor_loads_as_the_folders_own(folder):
    """Its tokenizer encodes the edit template as `tokenizer/`'s does (the image token's id included), and its image
    processor (transformers' auto class) gives `image_processor/`'s patches and grid."""
    from PIL import Image
    from transformers import AutoImageProcessor, Qwen2Tokenizer

    ours = Qwen2Tokenizer.from_pretrained(folder, subfolder="processor", local_files_only=True)
    theirs = Qwen2Tokenizer.from_pretrained(folder, subfolder="tokenizer", local_files_only=True)
    text = tiny.EDIT_TEMPLATE.format('make the sign read "OPEN"')
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    image_token = json.loads((folder / "text_encoder" / "config.json").read_text())["image_token_id"]
    assert ours.convert_tokens_to_ids("<|image_pad|>") == image_token
    loaded = AutoImageProcessor.from_pretrained(folder, subfolder="processor", local_files_only=True)
    own = AutoImageProcessor.from_pretrained(folder, subfolder="image_processor", local_files_only=True)
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 72, 3), dtype=np.uint8))
    a, b = loaded(images=[picture], return_tensors="np"), own(images=[picture], return_tensors="np")
    assert a["image_grid_thw"].tolist() == b["image_grid_thw"].tolist()
    assert a["image_grid_thw"].prod() // 4 <= tiny.MAX_PIXELS // 28 ** 2  # kept tiny: at most 4 merged tokens
    np.testing.assert_array_equal(a["pixel_values"], b["pixel_values"])


def test_the_diffusers_engine_sees_the_bounds_vllm_omni_loads(folder):
    """The diffusers pipeline's image processor (`diffusers_pipeline.image_processor`: `image_processor/` first, saved
    by transformers with its bounds under `size` only) grids a source sign as the `processor/` vLLM-Omni loads does:
    the two engines condition on the same number of image tokens."""
    from PIL import Image
    from transformers import AutoImageProcessor

    from jaxflow_bridge.families.qwen_image_edit.diffusers_pipeline import image_processor

    omni = AutoImageProcessor.from_pretrained(folder, subfolder="processor", local_files_only=True)
    sign = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 128, 3), dtype=np.uint8))
    ours = image_processor(folder)(images=[sign], return_tensors="np")["image_grid_thw"].tolist()
    assert ours == omni(images=[sign], return_tensors="np")["image_grid_thw"].tolist()
    assert ours[0][0] * ours[0][1] * ours[0][2] // 4 <= tiny.MAX_PIXELS // 28 ** 2
