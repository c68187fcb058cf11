"""jaxflow_bridge.contract.lora: adapter_config, PEFT folders (bit-exact), LoRA key names, vLLM-Omni names."""
import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from jaxflow_bridge.contract import safetensors_io
from jaxflow_bridge.families.qwen_image import keymap
from jaxflow_bridge.contract.lora import (adapter_config, bound_modules, lora_pairs, read_peft, to_vllm_omni,
                                          vllm_omni_adapter_config, write_peft)
from tests.helpers import LAYERS, RANK, random_peft

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_adapter_config():
    cfg = adapter_config(64, 128.0, ("to_q", "to_out.0"))
    assert cfg == {"peft_type": "LORA", "r": 64, "lora_alpha": 128.0, "target_modules": ["to_q", "to_out.0"],
                   "init_lora_weights": "gaussian", "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
                   "use_dora": False, "fan_in_fan_out": False}


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_peft_folder_round_trip_is_bit_exact(tmp_path, dtype):
    peft = random_peft(dtype)
    cfg = adapter_config(RANK, 8.0, keymap.DEFAULT_LORA_TARGETS)
    folder = write_peft(tmp_path / "adapter", peft, cfg)
    tensors, config = read_peft(folder)
    assert config == cfg and json.loads((folder / "adapter_config.json").read_text()) == cfg
    assert tensors.keys() == peft.keys()
    for k, v in peft.items():
        assert tensors[k].dtype == dtype and tensors[k].tobytes() == v.tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary folder left behind
    with pytest.raises(FileExistsError):
        write_peft(folder, peft, cfg)


def test_diffusers_folder_replace_and_reading_a_bare_file(tmp_path):
    peft, cfg = random_peft(), adapter_config(RANK, 8.0, keymap.DEFAULT_LORA_TARGETS)
    folder = write_peft(tmp_path / "a", peft, cfg, diffusers=True)
    tensors, config = read_peft(folder / "adapter_model.safetensors")
    assert config == cfg and tensors.keys() == {f"transformer.{k}" for k in peft}
    metadata = safetensors_io.SafetensorsFile(folder / "adapter_model.safetensors").metadata
    assert json.loads(metadata["lora_adapter_metadata"])["transformer.r"] == RANK  # what load_lora_weights reads
    write_peft(folder, {k: np.zeros_like(v) for k, v in peft.items()}, cfg, replace=True)
    assert not any(v.any() for v in read_peft(folder)[0].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    (folder / "adapter_config.json").unlink()
    assert read_peft(folder)[1] is None


def test_lora_pairs_and_bound_modules():
    peft = random_peft()
    assert bound_modules(peft) == LAYERS * len(keymap.DEFAULT_LORA_TARGETS)
    assert bound_modules(random_peft(targets=("to_q", "img_mlp.net.2"))) == 2 * LAYERS
    pairs = lora_pairs({f"transformer.{k}": v for k, v in peft.items()})
    assert "transformer_blocks.0.attn.to_q" in pairs
    with pytest.raises(ValueError, match="only one of"):
        lora_pairs({k: v for k, v in peft.items() if k != "transformer_blocks.0.attn.to_q.lora_B.weight"})
    with pytest.raises(ValueError, match="not a PEFT LoRA key"):
        lora_pairs({"transformer_blocks.0.attn.to_q.weight": np.zeros(1)})


def test_vllm_omni_names():
    """vLLM-Omni 0.20's loader: `to_out.0` -> `to_out` in keys and target_modules; q/k/v stay per projection."""
    peft = {f"transformer.{k}": v for k, v in random_peft().items()}
    renamed = to_vllm_omni(peft)
    assert len(renamed) == len(peft)
    assert "transformer_blocks.1.attn.to_out.lora_A.weight" in renamed
    assert "transformer_blocks.1.attn.to_q.lora_B.weight" in renamed
    assert "transformer_blocks.1.attn.add_v_proj.lora_A.weight" in renamed
    assert "transformer_blocks.1.img_mlp.net.0.proj.lora_A.weight" in renamed
    assert not any(".to_out.0." in k or k.startswith("transformer.") for k in renamed)
    assert renamed["transformer_blocks.1.attn.to_out.lora_B.weight"] is peft[
        "transformer.transformer_blocks.1.attn.to_out.0.lora_B.weight"]
    base = adapter_config(RANK, 8.0, keymap.DEFAULT_LORA_TARGETS)
    cfg = vllm_omni_adapter_config(base)
    assert cfg["target_modules"] == [t.replace("to_out.0", "to_out") for t in keymap.DEFAULT_LORA_TARGETS]
    assert cfg["r"] == RANK and "to_out.0" in base["target_modules"]  # input untouched


def test_imports_neither_jax_nor_torch_nor_jaxflow():
    code = ("import sys, jaxflow_bridge.contract.lora; "
            "assert not {'jax', 'torch', 'flax', 'jaxflow'} & set(sys.modules), sys.modules.keys()")
    subprocess.run([sys.executable, "-c", code], check=True)
