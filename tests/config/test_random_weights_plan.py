"""With model.init=random the plan sizes a transformer/ that holds no weights from its config: the family's
abstract checkpoint (`Family.random_weights`) names the same tensors, with the same shapes, as a real checkpoint."""
import dataclasses
import shutil

import pytest

from jaxflow import families
from jaxflow.config import machine, validation
from jaxflow.config.errors import UserError
from tests.helpers import tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = validation.validate(tiny_config(tmp_path_factory.mktemp("run")))
    return cfg, families.of(cfg), validation.model_folder(cfg)


def test_the_abstract_checkpoint_is_the_real_ones_keys_and_shapes(tiny):
    _, family, folder = tiny
    real = {key: tuple(shape) for key, shape, _ in machine._weights(folder / "transformer")}
    abstract = {key: tuple(shape) for key, shape, _ in family.random_weights(folder)}
    assert abstract == real and len(real) > 10


def test_a_folder_without_transformer_weights_is_sized_from_its_config_only_when_random(tiny, tmp_path):
    cfg, family, folder = tiny
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    for f in (bare / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(UserError, match="no safetensors weights in transformer"):
        machine.model_sizes(cfg, bare)
    random = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="random"))
    real, drawn = machine.model_sizes(cfg, folder), machine.model_sizes(random, bare)
    assert (drawn.lora_params, drawn.layers, drawn.tokens) == (real.lora_params, real.layers, real.tokens)
    assert drawn.transformer_bytes == sum(b for *_, b in family.random_weights(folder)) > 0
    assert (drawn.text_encoder_bytes, drawn.vae_bytes) == (real.text_encoder_bytes, real.vae_bytes)


def test_an_edit_sample_counts_its_reference_images_tokens(tiny):
    """The plan's memory and the fused GEMM's row padding see every image token of a sample: an edit row carries
    the reference image's latents beside the target's (the transformer's sequence), so twice the grid."""
    from jaxflow.config import derived, plan
    from tests.helpers import config_module, ROOT
    cfg, family, folder = tiny
    edit = config_module(ROOT / "configs" / "qwen_edit_ocr.py").get_config("tiny")
    edit.run_dir = cfg.run_dir
    edit.data.train, edit.data.test = str(ROOT / edit.data.train), str(ROOT / edit.data.test)
    edit = validation.validate(edit)
    edit_family, edit_folder = families.of(edit), validation.model_folder(edit)
    h, w = edit_family.grid_hw(edit_folder, edit)
    assert edit_family.image_tokens(edit_folder, edit) == 2 * h * w
    assert machine.model_sizes(edit, edit_folder).tokens == 2 * h * w + derived.text_tokens(edit)[0]
    assert plan._tokens(edit, edit_family, edit_folder) == (2 * h * w, *derived.text_tokens(edit))
    h, w = family.grid_hw(folder, cfg)  # text-to-image: the target's grid alone
    assert machine.model_sizes(cfg, folder).tokens == h * w + derived.text_tokens(cfg)[0]


SIZED_BEFORE_JAX = """
import dataclasses, importlib.util, os, shutil, sys
from pathlib import Path
from jax._src import xla_bridge
from jaxflow.config import machine, validation
machine.visible_gpus = lambda: [["0", "GPU-0", "NVIDIA H200", "143771"]]
spec = importlib.util.spec_from_file_location("config", sys.argv[2])  # not tests.helpers: it starts JAX
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
cfg = module.get_config(*sys.argv[3:])
cfg.run_dir = str(Path(sys.argv[1]) / "run")
cfg.data.train, cfg.data.test = str(Path(cfg.data.train).resolve()), str(Path(cfg.data.test).resolve())
cfg = validation.validate(cfg)
bare = Path(sys.argv[1]) / "bare"
shutil.copytree(validation.model_folder(cfg), bare)
for f in (bare / "transformer").glob("*.safetensors"):
    f.unlink()
cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init="random", path=str(bare)),
                          rollout=dataclasses.replace(cfg.rollout, device="cuda"))
block = machine.before_jax(cfg)
print(xla_bridge.backends_are_initialized(), os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"), block.splitlines()[0])
"""


@pytest.mark.slow
@pytest.mark.parametrize("config", [["configs/tiny_ocr.py"], ["configs/qwen_edit_ocr.py", "tiny"]])
def test_sizing_a_random_transformer_does_not_start_jax_before_its_memory_share_is_set(tmp_path, config):
    """The plan stage sizes a folder without transformer weights from an abstract model; building it must not ask
    JAX for its backend, or JAX starts with its default share of the GPU (75%) before `before_jax` sets the plan's,
    and a colocated engine finds no room (what README's command did on an H200 with model.init=random)."""
    import subprocess
    import sys
    from tests.helpers import ROOT, cluster_free_env
    env = cluster_free_env()
    for name in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, "-c", SIZED_BEFORE_JAX, str(tmp_path), *config], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    started, share, line = out.stdout.strip().splitlines()[-1].split(" ", 2)
    assert started == "False", "JAX's backend started while the plan sized the model"
    assert line.startswith("machine: 1 x NVIDIA H200") and float(share) > 0, out.stdout
