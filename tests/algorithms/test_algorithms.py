"""The algorithm registry (jaxflow/algorithms/registry.py): every registered component declares the batch fields and
config keys it reads, the config resolves to one component per role, and the train step names no algorithm."""
import ast
import dataclasses
from pathlib import Path

import pytest

from jaxflow.algorithms import registry
from jaxflow.trainer.step_config import TrainConfig
from jaxflow.trainer.train_batch import TrainBatch

ROOT = Path(__file__).resolve().parents[2]
REGISTERED = [(key, value, c) for key, table in registry.TABLES.items() for value, c in table.items()]


@pytest.mark.parametrize("key, value, component", REGISTERED, ids=lambda x: str(getattr(x, "name", x)))
def test_every_component_declares_its_batch_fields_and_config_keys(key, value, component):
    batch_fields = {f.name for f in dataclasses.fields(TrainBatch)}
    config_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert isinstance(component.fields, tuple) and set(component.fields) <= batch_fields, component.fields
    assert key in component.config_keys and set(component.config_keys) <= config_fields, component.config_keys
    assert component.summary and isinstance(component.recompute, bool)


@pytest.mark.parametrize("key, value, component", REGISTERED, ids=lambda x: str(getattr(x, "name", x)))
def test_the_config_resolves_to_the_registered_component(key, value, component):
    loss = "nft" if key == "algorithm" and value == "nft" else "flowgrpo"
    kw = {"algorithm": loss, key: value}
    if key == "ratio_norm" and value == "guard":
        kw["old_log_prob"] = "recompute"
    config = TrainConfig(guidance=1.0, grid_hw=(2, 2), **kw)
    role = registry.Policy._fields[list(registry.TABLES).index(key)]
    assert getattr(config.policy, role) is component
    assert config.batch_fields == config.policy.loss.batch_fields(config)


def test_an_unknown_choice_names_the_registered_ones():
    with pytest.raises(ValueError, match=r"TrainConfig.algorithm='ppo'; choose 'flowgrpo' \(.*\), 'nft' \(.*\), "
                                         r"'mixgrpo' \(.*\) or 'awm' \(.*\)"):
        TrainConfig(guidance=1.0, grid_hw=(2, 2), algorithm="ppo")
    with pytest.raises(ValueError, match=r"old_log_prob='bypass'; choose 'rollout' .*'recompute' .*"
                                         r"'rollout_corrected' .* or 'recompute_corrected'"):
        TrainConfig(guidance=1.0, grid_hw=(2, 2), old_log_prob="bypass")


def test_the_recompute_pass_is_asked_for_by_a_component_and_runs_for_a_log_prob_loss():
    assert TrainConfig(guidance=1.0, grid_hw=(2, 2), old_log_prob="recompute", num_mini_batches=2).recompute_pass
    assert not TrainConfig(guidance=1.0, grid_hw=(2, 2), old_log_prob="rollout", num_mini_batches=2).recompute_pass
    assert not TrainConfig(guidance=1.0, grid_hw=(2, 2), algorithm="nft", old_log_prob="recompute",
                           num_mini_batches=2).recompute_pass


def algorithm_names_in(path: Path) -> list[str]:
    """Where `path` names an algorithm: a string constant that is a registered choice, or an attribute read of an
    algorithm config key (it should call the resolved policy instead)."""
    names = {v for _, v, _ in REGISTERED if isinstance(v, str)} | {c.name for _, _, c in REGISTERED}
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value in names:
            found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in registry.TABLES | {"nft": None}:
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def test_the_train_step_names_no_algorithm():
    found = algorithm_names_in(ROOT / "jaxflow" / "trainer" / "train_step.py")
    assert not found, f"jaxflow/trainer/train_step.py branches on algorithms ({found}): call config.policy's components"


def test_the_checker_sees_a_branch_on_an_algorithm(tmp_path):
    f = tmp_path / "step.py"
    f.write_text('if config.old_log_prob == "rollout_corrected":\n    pass\nif config.drop_zero_advantage:\n    pass\n')
    assert set(algorithm_names_in(f)) == {"line 1: .old_log_prob", "line 1: 'rollout_corrected'",
                                          "line 3: .drop_zero_advantage"}
