"""The random full-size edit folder (`jaxflow_bridge/families/qwen_image_edit/full_size.py`), built on the meta device
(shapes only, nothing allocated) with the short text encoder: Qwen-Image's released transformer config as an edit
pipeline, the encoder's ids the edit tokenizer's, and the folder's additions (`finish_folder`): the tokenizer's slow
files of the edit templates and `processor/` at the released pixel bounds."""
import json

from jaxflow_bridge.families.qwen_image import full_size as qwen_full_size
from jaxflow_bridge.families.qwen_image.tiny import tokenizer_vocab
from jaxflow_bridge.families.qwen_image_edit import full_size, spec, tiny


def test_the_full_size_edit_pipeline_and_its_folder_additions(tmp_path):
    pipe = full_size.full_size_pipeline("meta", text_encoder="short")
    assert type(pipe).__name__ == "QwenImageEditPipeline" and type(pipe).__name__ in spec.PIPELINE_CLASSES
    assert type(full_size.full_size_pipeline("meta", "meta", "short", plus=True)).__name__ == (
        "QwenImageEditPlusPipeline")
    assert dict(pipe.transformer.config) == dict(qwen_full_size.full_size_pipeline("meta", text_encoder="short")
                                                 .transformer.config)
    config = pipe.text_encoder.config
    assert config.text_config.hidden_size == qwen_full_size.TEXT_CONFIG["hidden_size"]
    for token, key in (("<|image_pad|>", "image_token_id"), ("<|vision_start|>", "vision_start_token_id"),
                       ("<|vision_end|>", "vision_end_token_id")):  # the edit template's image tokens
        assert pipe.tokenizer.convert_tokens_to_ids(token) == getattr(config, key), token
    (tmp_path / "tokenizer").mkdir()
    full_size.finish_folder(tmp_path, pipe)
    vocab = json.loads((tmp_path / "tokenizer" / "vocab.json").read_text())
    assert vocab == tokenizer_vocab(tiny.TEMPLATES)[0] != tokenizer_vocab()[0]  # the edit words', not Qwen-Image's
    assert json.loads((tmp_path / "processor" / "vocab.json").read_text()) == vocab
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        processor = json.loads((tmp_path / "processor" / name).read_text())
        assert (processor["min_pixels"], processor["max_pixels"]) == (3136, 12845056), name
    assert (full_size.MIN_PIXELS, full_size.MAX_PIXELS) != (tiny.MIN_PIXELS, tiny.MAX_PIXELS)
