"""Plain helpers and constants shared by several test modules (fixtures live in conftest.py).

- the tiny offline run: ROOT, tiny_config, run; a subprocess run's environment and exported LoRA (cluster_free_env,
  final_lora); a previous run's outputs (STATE, fake_run)
- PEFT adapters over a small fake model (D, MLP, RANK, LAYERS, random_peft): tests/helpers_vllm_omni.py builds the
  matching fused transformer; a PEFT adapter over a RolloutPipeline's tiny blocks (make_adapter)
- the train-step tests' tiny LoRA model and sampled batch (TINY, GRID, SEEDS, GROUPS, inputs, tiny_lora_model,
  sampled_batch; conftest.py's `lora_model` fixture is tiny_lora_model()); a random window batch for the sharded
  steps' 2 x 2 grid (random_window_batch); a random batch in a learner's shapes (random_train_batch)
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxflow.config.validation import config_module
from jaxflow.families.qwen_image.config import QwenImageConfig
from jaxflow.nn.config import ModelOptions
from jaxflow.nn.lora import LoRAParam
from jaxflow.families.qwen_image.lora import QwenImageLoRASpec as LoRASpec
from jaxflow.families.qwen_image.transformer import QwenImageTransformer
from jaxflow.trainer.train_batch import TrainBatch
from jaxflow_bridge.families.qwen_image import keymap
from tests.helpers_sampler import SamplerConfig, make_sampler

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------- the tiny run


def tiny_config(run_dir, **train):
    cfg = config_module(ROOT / "configs" / "tiny_ocr.py").get_config()
    cfg.run_dir = str(run_dir)
    cfg.data.train, cfg.data.test = str(ROOT / cfg.data.train), str(ROOT / cfg.data.test)
    cfg.log.progress = cfg.log.tensorboard = False
    cfg.rollout.num_cpus = 0.0  # never wait on the shared test Ray instance's CPUs
    cfg.reward.fns = {"jpeg_incompressibility": 1.0}  # deterministic and fast; OCR scores 0 on noise images
    cfg.eval.every = cfg.checkpoint.every = 1000
    cfg.train.update(train)
    return cfg


def run(cfg, resume=False):
    from jaxflow.train import Trainer

    trainer = Trainer(cfg, resume=resume)
    try:
        return trainer.run()
    finally:
        trainer.close()


def cluster_free_env(**extra):
    """This process's environment for a `python -m jaxflow.train` subprocess: no JAX cluster or launcher variables
    (JAX_COORDINATOR*, JAX_NUM_PROC*, JAX_PROCESS_ID, SLURM_*, OMPI_*), JAX on the CPU, offline; `extra` on top."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROC",
                                                                      "JAX_PROCESS_ID", "SLURM_", "OMPI_"))}
    return {**env, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", **extra}


def final_lora(run_dir):
    """The run's exported LoRA (run_dir/lora_final/adapter_model.safetensors) as numpy arrays by PEFT key."""
    from safetensors.numpy import load_file
    return load_file(str(run_dir / "lora_final" / "adapter_model.safetensors"))


STATE = {"a": jnp.arange(1000, dtype=jnp.float32), "b": jnp.ones((256, 256))}  # "b" is zstd-compressed


def fake_run(run_dir, cfg, steps=(5,)):
    """A previous run's outputs: metrics rows 1..max(steps), an eval image, checkpoints of a tiny state."""
    from jaxflow.trainer.checkpoint import Checkpointer, config_json

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, max(steps) + 1)))
    (run_dir / "eval").mkdir()
    (run_dir / "eval" / "step_000005.png").write_bytes(b"png")
    ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
    for s in steps:
        ckpt.save(s, {k: v * s for k, v in STATE.items()}, {"step": s, "config": config_json(cfg)})
    return ckpt


# ---------------------------------------------------------------------------------------------- PEFT adapters

D, MLP, RANK, LAYERS = 8, 32, 4, 3


def _dims(target: str) -> tuple[int, int]:
    """(in, out) of a block linear of a model with width D and MLP width MLP (modulation: 6 D)."""
    return {"img_mlp.net.0.proj": (D, MLP), "txt_mlp.net.0.proj": (D, MLP), "img_mlp.net.2": (MLP, D),
            "txt_mlp.net.2": (MLP, D), "img_mod.1": (D, 6 * D), "txt_mod.1": (D, 6 * D)}.get(target, (D, D))


def random_peft(dtype=np.float32, targets=keymap.DEFAULT_LORA_TARGETS, seed=0) -> dict:
    """A PEFT state dict (no prefix) over LAYERS blocks, as the trainer's `lora_to_peft` names and shapes it."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in targets:
        fan_in, fan_out = _dims(t)
        module = keymap.BLOCK_LINEARS[keymap.lora_target_path(t)]
        for i in range(LAYERS):
            out[f"transformer_blocks.{i}.{module}.lora_A.weight"] = rng.standard_normal((RANK, fan_in)).astype(dtype)
            out[f"transformer_blocks.{i}.{module}.lora_B.weight"] = rng.standard_normal((fan_out, RANK)).astype(dtype)
    return out


def make_adapter(pipe, modules=("attn.to_q", "attn.to_k", "attn.to_out.0", "img_mlp.net.2"), rank=4, seed=0, prefix="", scale=0.3):
    """A PEFT-format adapter over both tiny blocks, and its adapter_config."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name in (f"transformer_blocks.{i}.{m}" for i in range(2) for m in modules):
        linear = pipe.lora.linears[name]
        tensors[f"{prefix}{name}.lora_A.weight"] = scale * rng.standard_normal((rank, linear.in_features), np.float32)
        tensors[f"{prefix}{name}.lora_B.weight"] = scale * rng.standard_normal((linear.out_features, rank), np.float32)
    return tensors, {"r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules), "peft_type": "LORA"}


# ---------------------------------------------------------------------------------------------- the train step

TINY = QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=64,
                       axes_dims_rope=(8, 12, 12))
GRID, SEEDS = (2, 2), [1, 2, 3, 4]
GROUPS = np.array([0, 0, 1, 1])  # the 4 samples of sampled_batch: 2 prompt groups of 2


def inputs(cfg: bool) -> dict:
    """Text conditioning for the 4 samples: random embeddings and masks of ragged lengths, negatives when `cfg`."""
    r = np.random.default_rng(0)
    out = {"prompt_embeds": r.normal(size=(4, 5, 64)).astype(np.float32),
           "prompt_mask": np.arange(5)[None] < np.array([5, 3, 4, 2])[:, None]}
    if cfg:
        out["negative_prompt_embeds"] = r.normal(size=(4, 2, 64)).astype(np.float32)
        out["negative_prompt_mask"] = np.array([[1, 1], [1, 0], [1, 1], [1, 0]], bool)
    return out


def tiny_lora_model():
    """Tiny model whose LoRA params (B included) are all non-zero, so the adapters change the velocity."""
    spec = LoRASpec(rank=4, alpha=8.0, targets=("to_q", "to_v", "img_mlp.net.2"))
    model = QwenImageTransformer(TINY, ModelOptions(), spec, rngs=nnx.Rngs(0))
    leaves, treedef = jax.tree.flatten(nnx.state(model, LoRAParam))
    nnx.update(model, jax.tree.unflatten(
        treedef, [x + 0.3 * jax.random.normal(jax.random.key(i), x.shape) for i, x in enumerate(leaves)]))
    return model


def sampled_batch(model, guidance):
    """A train batch sampled by `model` itself (6 steps, window 2, SEEDS) with fixed advantages."""
    config = SamplerConfig(grid_hw=GRID, num_steps=6, noise_level=1.2, guidance=guidance, window_size=2)
    traj = make_sampler(model, config)(inputs(guidance > 1), SEEDS)
    return TrainBatch(**traj, advantages=np.array([1.0, -1.0, 2.0, -0.5], np.float32))


def random_window_batch(b: int, w: int = 2, n: int = 6, length: int = 5, seed: int = 0) -> TrainBatch:
    """A random TrainBatch of `b` samples for a 2 x 2 latent grid (64 channels): `w` window steps of an `n`-step
    schedule, text embeds of `length` tokens (width 64) with right-padded masks."""
    r = np.random.default_rng(seed)
    starts = r.integers(0, n - w, size=b)
    return TrainBatch(latents=r.normal(size=(b, w + 1, 4, 64)).astype(np.float32),
                      log_probs=(-1.4 + 0.01 * r.normal(size=(b, w))).astype(np.float32),
                      sigmas=np.linspace(1, 0, n + 1).astype(np.float32),
                      step_index=(starts[:, None] + np.arange(w)).astype(np.int32), noise_level=np.float32(1.0),
                      prompt_embeds=r.normal(size=(b, length, 64)).astype(np.float32),
                      prompt_mask=np.arange(length)[None] < r.integers(1, length + 1, size=b)[:, None],
                      advantages=r.normal(size=b).astype(np.float32))


def expected_served(payload) -> dict:
    """What the trainer expects an engine to serve for a LoRA payload at the probe's modules and positions
    (jaxflow_bridge/contract/served.py's `expected`, under the payload's own module names)."""
    from jaxflow_bridge.contract.served import expected_probe

    return expected_probe(payload.arrays(), payload.scale, payload.version)


def cli_run_raising(tmp_path, imports: str, raised: str) -> subprocess.CompletedProcess:
    """`python -m jaxflow.train`'s command line (jaxflow.run.cli.main) over a stand-in trainer whose run raises
    `raised` (an expression over `imports` and `self.cfg`) after start-up; the finished process."""
    from tests import HANG_S
    code = ("import sys; from jaxflow.run import cli\n" + imports + "\n"
            "class T:\n"
            "    driver, start = None, 0\n"
            "    def __init__(self, cfg, resume=False): self.cfg = cfg\n"
            f"    def run(self): raise {raised}\n"
            "    def close(self): pass\n"
            "sys.exit(cli.main(T))")
    return subprocess.run([sys.executable, "-c", code, f"--config.run_dir={tmp_path / 'run'}",
                           "--config.rollout.layout=in_process"], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_S)


def random_train_batch(learner, seed: int = 0) -> TrainBatch:
    """A random TrainBatch in the shapes the `learner`'s step is compiled for (`Learner.batch_shapes`): latents,
    embeds and log-probs drawn from `seed`, the schedule 1 -> 0, each row's window inside it, masks right-padded."""
    from jaxflow.config import derived

    cfg = learner.cfg
    shapes, _ = learner.batch_shapes(derived.train_config(cfg, learner.grid, learner.plan.num_micro_batches))
    r = np.random.default_rng(seed)
    b, w, n = shapes["advantages"].shape[0], cfg.sample.window_size, cfg.sample.num_steps
    out = {}
    for name, s in shapes.items():
        if name.endswith("mask"):
            out[name] = np.arange(s.shape[1])[None] < r.integers(1, s.shape[1] + 1, size=(b, 1))
        elif name == "sigmas":
            out[name] = np.broadcast_to(np.linspace(1, 0, n + 1, dtype=np.float32), s.shape).copy()
        elif name == "step_index":
            out[name] = (r.integers(0, n - w + 1, size=(b, 1)) + np.arange(w)).astype(np.int32)
        elif name == "noise_level":
            out[name] = np.full(s.shape, 0.7, np.float32)
        elif name == "log_probs":
            out[name] = (-1.4 + 0.01 * r.normal(size=s.shape)).astype(np.float32)
        else:
            out[name] = r.normal(size=s.shape).astype(s.dtype)
    return TrainBatch(**out)
