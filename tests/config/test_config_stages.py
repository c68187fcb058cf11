"""The config's stages: typed sections (jaxflow/config/sections.py), the validation stage run once per process
start (the command line's, whose result the Trainer takes), and the plan that resolves every 'auto'
(jaxflow/config/plan.py)."""
import dataclasses
import json
import subprocess
import sys

import jax
import pytest
from ml_collections import ConfigDict

from jaxflow.config import derived
from jaxflow import train
from jaxflow.config import validation
from jaxflow.config.errors import UserError
from jaxflow.config.sections import RunConfig
from jaxflow.trainer import learner
from jaxflow.trainer.checkpoint import config_json
from jaxflow.trainer.sharding import Layout
from jaxflow.trainer.step_config import TrainConfig
from jaxflow_bridge.families.bagel.sampling import BagelSamplingParams
from jaxflow_bridge.rollout.sampling import SamplingParams
from tests import HANG_S
from tests.helpers import ROOT, tiny_config


def test_the_sections_are_typed_frozen_and_hold_the_algorithms_keys(tmp_path):
    config = validation.validate(tiny_config(tmp_path))
    assert isinstance(config, RunConfig) and config.sample.height == 40 and config.lora.rank == 8
    assert config.lora.targets == tuple(tiny_config(tmp_path).lora.targets)  # lists become tuples
    assert config.train.algorithm == "flowgrpo" and config.train.algorithms["nft"]["beta"] == 0.1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.sample.height = 41
    with pytest.raises(TypeError):
        config.reward.fns["ocr"] = 1.0  # read-only


def test_the_typed_config_reads_as_the_config_it_was_built_from(tmp_path):
    """Everything after the validation stage reads the RunConfig: the algorithms' keys as attributes, and its
    `to_dict` (config.json, every checkpoint's config, which a resume compares) the user's ConfigDict's."""
    raw = tiny_config(tmp_path, ema_decay=0.5)
    config = validation.validate(raw)
    assert (config.train.nft.kl, config.train.rollout_rs, config.train.awm.power) == (
        raw.train.nft.kl, raw.train.rollout_rs, raw.train.awm.power)
    assert config.eval.best_metric == raw.eval.best_metric and dict(config.eval.rewards) == raw.eval.rewards.to_dict()
    assert json.loads(config_json(config)) == json.loads(config_json(raw))
    with pytest.raises(AttributeError, match="train.no_such_key is not a config key"):
        config.train.no_such_key
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.train.nft.kl = 0.0


@pytest.mark.parametrize("key, value, line", [
    ("sample.height", "40", "config.sample.height: '40' must be an int (it is str)"),
    ("train.num_steps", True, "config.train.num_steps: True must be an int (it is bool)"),
    ("train.learning_rate", "1e-3", "config.train.learning_rate: '1e-3' must be a float (it is str)"),
    ("rollout.overlap", 0, "config.rollout.overlap: 0 must be a bool (it is int)"),
    ("train.nft.beta", "x", "config.train.nft.beta: 'x' must be a float (it is str)"),  # an algorithm's section
])
def test_a_value_of_the_wrong_type_is_one_line_naming_the_key(tmp_path, key, value, line):
    values = tiny_config(tmp_path).to_dict()  # a config built without ConfigDict's own type checks
    *path, name = key.split(".")
    section = values
    for part in path:
        section = section[part]
    section[name] = value
    with pytest.raises(UserError) as e:
        validation.validate(ConfigDict(values))
    assert str(e.value) == line


@pytest.mark.parametrize("key, value, line", [
    ("sample.window_range", (2, 5), "config.sample.window_size: SDE window size 2 does not fit in window_range (2, 5) "
                                    "(clipped to [2, 3) so that the last step 3 is excluded)"),
    ("sample.max_sequence_length", 2000, "config.sample.max_sequence_length: max_sequence_length must be in "
                                         "[1, 1024], got 2000"),
])
def test_the_sampling_rules_are_the_engines(tmp_path, key, value, line):
    """The rollout requests' rules (jaxflow_bridge/contract/sampling_rules.py), which the engine checks each request
    with (tests/engines/test_rollout.py: the same messages), refuse the config's values, naming the key."""
    cfg = tiny_config(tmp_path)
    section, name = key.split(".")
    cfg[section][name] = value
    with pytest.raises(UserError) as e:
        validation.validate(cfg)
    assert str(e.value) == line


@pytest.mark.slow
def test_the_command_line_validates_once_and_the_trainer_takes_the_result(tmp_path):
    """The command line's preflight validates; the trainer it builds receives that RunConfig, and nothing in the
    process validates again (a stand-in trainer: the count is the whole process's)."""
    code = ("import sys\n"
            "from jaxflow.config import validation\n"
            "from jaxflow.run import cli\n"
            "calls, real = [], validation.validate\n"
            "validation.validate = lambda cfg: calls.append(cfg) or real(cfg)\n"
            "class T:\n"
            "    driver, start = None, 0\n"
            "    def __init__(self, config, resume=False): print('trainer got', type(config).__name__)\n"
            "    def run(self): return {'history': []}\n"
            "    def close(self): pass\n"
            "code = cli.main(T)\n"
            "print('validations', len(calls))\n"
            "sys.exit(code)")
    out = subprocess.run([sys.executable, "-c", code, "--config.rollout.layout=in_process",
                          f"--config.run_dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    assert "trainer got RunConfig" in out.stdout and "validations 1" in out.stdout, out.stdout


class _Stop(Exception):
    pass


def _stop(*args, **kwargs):
    raise _Stop


def test_the_trainer_validates_only_a_config_not_yet_validated(tmp_path, monkeypatch):
    config = validation.validate(tiny_config(tmp_path))
    calls = []
    monkeypatch.setattr(validation, "validate", lambda cfg: calls.append(cfg) or config)
    monkeypatch.setattr(train, "maybe_initialize_distributed", _stop)  # the step after the checks' validation
    with pytest.raises(_Stop):
        train.Trainer(config)
    assert calls == []
    raw = tiny_config(tmp_path)
    with pytest.raises(_Stop):
        train.Trainer(raw)  # built from a ConfigDict (tests, scripts): validated here, once
    assert calls == [raw]


def test_the_plan_on_this_cpu_machine(tmp_path):
    """The tiny config's plan here: XLA's linears (no H100/H200), its scan of 1 block, the config's XLA options, the LoRA
    served as layers by the diffusers engine; vllm_omni merges it (rollout.lora_apply 'auto')."""
    cfg = validation.validate(tiny_config(tmp_path))
    folder = validation.model_folder(cfg)
    layout = Layout.create(derived.sharding_config(cfg))
    plan = learner.run_plan(cfg, folder, layout)
    assert (plan.backend, plan.devices, plan.batch_devices) == ("cpu", jax.device_count(), layout.batch_devices)
    assert plan.micro_batch == max(1, 4 * 4 // plan.batch_devices)  # 4 prompts x 4 images, one micro-batch
    assert (plan.model.lora_gemm, plan.model.scan_unroll) == ("xla", 1)
    assert dict(plan.xla_options) == dict(cfg.train.xla_options)  # the config's, no pallas ones
    assert "not an H100/H200" in plan.lora_gemm_why and "float32 compute" in plan.lora_gemm_why
    assert (plan.layout, plan.engines, plan.lora_apply) == ("colocated", 1, "layers")
    lines = plan.summary().splitlines()
    assert len(lines) == 3 and lines[0].startswith("plan: ") and "model.lora_gemm=xla" in lines[1]
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="vllm_omni"),
                              model=dataclasses.replace(cfg.model, scan_unroll=0))
    plan = learner.run_plan(cfg, folder, layout)
    assert plan.lora_apply == "merged" and plan.model.scan_unroll == 1  # 0: a scan of 1 where the linears run xla
    assert plan.quantization == "none" and "quantization none (rollout.quantization)" in plan.summary()
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, quantization="fp8"))
    plan = learner.run_plan(cfg, folder, layout)  # FP8 weights take no merge: 'auto' serves the LoRA as layers
    assert (plan.lora_apply, plan.quantization) == ("layers", "fp8")
    assert "LoRA served as layers (rollout.lora_apply), quantization fp8" in plan.summary().splitlines()[2]


def test_auto_never_reaches_the_family_or_the_learner(tmp_path, monkeypatch):
    """The family builds its model from resolved ModelOptions (the plan's), not from 'auto' nor a callback."""
    from jaxflow import families
    raw = tiny_config(tmp_path)
    raw.model.scan_unroll = 0
    cfg = validation.validate(raw)
    assert cfg.model.lora_gemm == "auto"
    folder = validation.model_folder(cfg)
    family, seen = families.of(cfg), []
    build = family.build_model
    monkeypatch.setattr(type(family), "build_model",
                        lambda self, cfg, folder, spec, opts, **kw: seen.append(opts) or build(cfg, folder, spec,
                                                                                                opts, **kw))
    trainer_learner = learner.Learner(cfg, folder)
    assert [(o.lora_gemm, o.scan_unroll) for o in seen] == [("xla", 1)]
    assert trainer_learner.plan.model == seen[0] and trainer_learner.model.opts.lora_gemm == "xla"


def test_the_cfg_scale_has_no_default_of_its_own():
    """The CFG scale's one default is the config's (sample.guidance in the recipe): a request, a sampling params
    object or a train step config without it is refused, never run at a scale of its own."""
    with pytest.raises(ValueError, match=r"sampling parameters \['true_cfg_scale'\] have no default: give them"):
        SamplingParams.from_dict({"height": 64})
    with pytest.raises(ValueError, match=r"BAGEL sampling parameters \['cfg_text_scale'\] have no default"):
        BagelSamplingParams.from_dict({})
    with pytest.raises(TypeError, match="guidance"):
        TrainConfig(grid_hw=(1, 1))
