"""bridge.lora: Flax LoRA pytree <-> PEFT names (bit-exact), adapter_config, PEFT folders, vLLM-Omni names."""
import json
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from bridge.lora import (adapter_config, bound_modules, flax_to_peft, lora_pairs, peft_to_flax, read_peft,
                         to_vllm_omni, vllm_omni_adapter_config, write_peft)
from jaxflow.models import keymap

D, MLP, RANK, LAYERS = 8, 32, 4, 3
BF16 = np.dtype(ml_dtypes.bfloat16)


def _dims(target: str) -> tuple[int, int]:
    """(in, out) of a block linear of a model with width D and MLP width MLP (modulation: 6 D)."""
    return {"img_mlp.net.0.proj": (D, MLP), "txt_mlp.net.0.proj": (D, MLP), "img_mlp.net.2": (MLP, D),
            "txt_mlp.net.2": (MLP, D), "img_mod.1": (D, 6 * D), "txt_mod.1": (D, 6 * D)}.get(target, (D, D))


def random_tree(dtype=np.float32, targets=keymap.DEFAULT_LORA_TARGETS, seed=0) -> dict:
    """A Flax LoRA pytree as `nnx.state(model, LoRAParam).to_pure_dict()` gives it."""
    rng = np.random.default_rng(seed)
    tree = {}
    for t in targets:
        fan_in, fan_out = _dims(t)
        node = tree.setdefault(keymap.BLOCKS, {})
        for key in keymap.lora_target_path(t):
            node = node.setdefault(key, {})
        node["lora_a"] = rng.standard_normal((LAYERS, fan_in, RANK)).astype(dtype)
        node["lora_b"] = rng.standard_normal((LAYERS, RANK, fan_out)).astype(dtype)
    return tree


def assert_trees_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_trees_equal(a[k], b[k])
        else:
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes()


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_pytree_peft_round_trip_is_bit_exact(dtype):
    tree = random_tree(dtype)
    peft = flax_to_peft(tree)
    assert len(peft) == 2 * LAYERS * len(keymap.DEFAULT_LORA_TARGETS)
    a = peft["transformer_blocks.2.attn.to_out.0.lora_A.weight"]
    b = peft["transformer_blocks.2.img_mlp.net.2.lora_B.weight"]
    assert a.shape == (RANK, D) and b.shape == (D, RANK) and a.dtype == dtype
    assert np.array_equal(a, tree["blocks"]["attn"]["to_out"]["lora_a"][2].T)
    assert_trees_equal(peft_to_flax(peft), tree)
    assert_trees_equal(peft_to_flax({f"transformer.{k}": v for k, v in peft.items()}), tree)  # diffusers prefix


def test_subset_of_targets_and_errors():
    tree = random_tree(targets=("to_q", "img_mlp.net.2"))
    peft = flax_to_peft(tree)
    assert bound_modules(peft) == 2 * LAYERS
    assert_trees_equal(peft_to_flax(peft), tree)
    with pytest.raises(ValueError, match="missing leaf"):
        flax_to_peft(tree, targets=("to_q", "to_k"))
    with pytest.raises(ValueError, match="outside targets"):
        flax_to_peft(tree, targets=("to_q",))
    with pytest.raises(ValueError, match="missing"):
        peft_to_flax({k: v for k, v in peft.items() if not k.startswith("transformer_blocks.1.")})
    with pytest.raises(ValueError, match="outside targets"):
        peft_to_flax(peft, targets=("to_q",))


def test_matches_the_trainers_export():
    """The pytree layout is what the Flax model holds: same PEFT dict as jaxflow.models.lora.lora_to_peft."""
    from flax import nnx

    from jaxflow.models.config import QwenImageConfig
    from jaxflow.models.loading import TensorSource, build_from_source
    from jaxflow.models.lora import LoRAParam, LoRASpec, lora_to_peft, peft_to_lora
    from tests.qwen_ref import TINY, state_dict_numpy, torch_model

    spec = LoRASpec(rank=RANK, alpha=8.0)
    model = build_from_source(QwenImageConfig(**TINY), TensorSource(state_dict_numpy(torch_model(TINY))), lora=spec)
    rng = np.random.default_rng(1)
    peft_to_lora(model, spec, {k: rng.standard_normal(v.shape).astype(np.float32)
                               for k, v in lora_to_peft(model, spec).items()})
    ours = flax_to_peft(nnx.to_pure_dict(nnx.state(model, LoRAParam)))
    theirs = lora_to_peft(model, spec)
    assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    assert adapter_config(spec.rank, spec.alpha, spec.targets) == spec.peft_config()


def test_adapter_config():
    cfg = adapter_config(64, 128, ("to_q", "to_out.0"))
    assert cfg == {"peft_type": "LORA", "r": 64, "lora_alpha": 128.0, "target_modules": ["to_q", "to_out.0"],
                   "init_lora_weights": "gaussian", "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
                   "use_dora": False, "fan_in_fan_out": False}
    assert adapter_config(4, 8)["target_modules"] == list(keymap.DEFAULT_LORA_TARGETS)
    with pytest.raises(ValueError, match="unknown LoRA target"):
        adapter_config(4, 8, ("to_x",))
    with pytest.raises(ValueError, match="rank"):
        adapter_config(0, 8)


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float32"])
def test_peft_folder_round_trip(tmp_path, dtype):
    peft = flax_to_peft(random_tree(np.float32))
    cfg = adapter_config(RANK, 8.0)
    folder = write_peft(tmp_path / "adapter", peft, cfg, dtype=dtype)
    tensors, config = read_peft(folder)
    assert config == cfg and json.loads((folder / "adapter_config.json").read_text()) == cfg
    want = np.dtype(np.float32) if dtype in (None, "float32") else BF16
    assert tensors.keys() == peft.keys()
    for k, v in peft.items():
        assert tensors[k].dtype == want and np.array_equal(tensors[k], np.asarray(v, want))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]  # no temporary folder left behind
    with pytest.raises(FileExistsError):
        write_peft(folder, peft, cfg)


def test_bf16_folder_round_trip_to_pytree(tmp_path):
    tree = random_tree(BF16)
    tensors, _ = read_peft(write_peft(tmp_path / "a", flax_to_peft(tree), adapter_config(RANK, 8.0)))
    assert_trees_equal(peft_to_flax(tensors), tree)


def test_lora_pairs_and_bound_modules():
    peft = flax_to_peft(random_tree())
    assert bound_modules(peft) == LAYERS * len(keymap.DEFAULT_LORA_TARGETS)
    pairs = lora_pairs({f"transformer.{k}": v for k, v in peft.items()})
    assert "transformer_blocks.0.attn.to_q" in pairs
    with pytest.raises(ValueError, match="only one of"):
        lora_pairs({k: v for k, v in peft.items() if k != "transformer_blocks.0.attn.to_q.lora_B.weight"})
    with pytest.raises(ValueError, match="not a PEFT LoRA key"):
        lora_pairs({"transformer_blocks.0.attn.to_q.weight": np.zeros(1)})


def test_vllm_omni_names():
    """vLLM-Omni 0.20's loader: `to_out.0` -> `to_out` in keys and target_modules; q/k/v stay per projection."""
    peft = {f"transformer.{k}": v for k, v in flax_to_peft(random_tree()).items()}
    renamed = to_vllm_omni(peft)
    assert len(renamed) == len(peft)
    assert "transformer_blocks.1.attn.to_out.lora_A.weight" in renamed
    assert "transformer_blocks.1.attn.to_q.lora_B.weight" in renamed
    assert "transformer_blocks.1.attn.add_v_proj.lora_A.weight" in renamed
    assert "transformer_blocks.1.img_mlp.net.0.proj.lora_A.weight" in renamed
    assert not any(".to_out.0." in k or k.startswith("transformer.") for k in renamed)
    assert renamed["transformer_blocks.1.attn.to_out.lora_B.weight"] is peft[
        "transformer.transformer_blocks.1.attn.to_out.0.lora_B.weight"]
    cfg = vllm_omni_adapter_config(adapter_config(RANK, 8.0))
    assert cfg["target_modules"] == [t.replace("to_out.0", "to_out") for t in keymap.DEFAULT_LORA_TARGETS]
    assert cfg["r"] == RANK and "to_out.0" in adapter_config(RANK, 8.0)["target_modules"]  # input untouched


def test_imports_neither_jax_nor_torch():
    code = "import sys, bridge.lora; assert not {'jax', 'torch', 'flax'} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True)
