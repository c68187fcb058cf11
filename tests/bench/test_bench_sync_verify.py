"""jaxflow_bench.sync_verify at small shapes: the LoRA state it builds is the spec's (every PEFT module, A and B of
the right shapes), and it writes the check's figures."""
import json

import numpy as np

from jaxflow.families.qwen_image.lora import QwenImageLoRASpec
from jaxflow.nn.lora import lora_to_peft
from jaxflow_bench import sync_verify


def test_the_state_has_the_spec_shapes_and_the_figures_are_written(tmp_path):
    spec = QwenImageLoRASpec(rank=4, alpha=8.0)
    tensors = lora_to_peft(sync_verify.lora_state(spec, layers=2, dim=8, mlp=24), spec)
    assert len(tensors) == 2 * 2 * 12
    assert tensors["transformer_blocks.1.img_mlp.net.0.proj.lora_A.weight"].shape == (4, 8)
    assert tensors["transformer_blocks.1.img_mlp.net.0.proj.lora_B.weight"].shape == (24, 4)
    assert tensors["transformer_blocks.0.txt_mlp.net.2.lora_A.weight"].shape == (4, 24)
    assert tensors["transformer_blocks.0.attn.to_q.lora_B.weight"].shape == (8, 4)
    assert all(np.std(v) > 0 for v in tensors.values())
    sync_verify.main([str(tmp_path), "--layers", "3", "--dim", "8", "--mlp", "16", "--rank", "4", "--repeats", "2"])
    written = json.loads(next(tmp_path.glob("sync_verify_*.json")).read_text())
    f = written["figures"]
    assert (f["modules"], f["probed_modules"], f["lora_params"]) == (36, 32, 3 * 4 * (8 * 16 + 4 * 24))
    assert 0 < f["expected_of_s"] <= f["sync_verify_s"] and written["shapes"]["layers"] == 3
