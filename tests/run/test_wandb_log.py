"""wandb as an optional log (log.wandb, jaxflow/run/wandb_log.py), against a stand-in `wandb` module that records
what the run sends through wandb's public API (init, Image, run.log, run.finish); wandb itself is not installed."""
import importlib.machinery
import sys
import types

import numpy as np
import pytest

from jaxflow.config import validation
from jaxflow.config.errors import UserError
from jaxflow.run import run_dir as run_dir_lib
from jaxflow.run.metrics_log import RunLog, eval_grid_path, image_grid
from jaxflow.run.wandb_log import ID_FILE, WandbLog
from tests.helpers import run, tiny_config


class StandIn(types.ModuleType):
    """`wandb` as the run uses it: init's arguments, each logged row with its step, finish."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # installed, as importlib.util.find_spec sees
        self.inits, self.rows, self.finished = [], [], 0
        stand_in = self

        class Run:
            def log(self, row, step=None):
                stand_in.rows.append((step, row))

            def finish(self):
                stand_in.finished += 1

        class Image:
            def __init__(self, data, caption=None):
                self.data, self.caption = data, caption

        self.Image, self._run = Image, Run()

    def init(self, **kwargs):
        self.inits.append(kwargs)
        return self._run


@pytest.fixture
def wandb(monkeypatch):
    stand_in = StandIn()
    monkeypatch.setitem(sys.modules, "wandb", stand_in)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return stand_in


def test_config_rows_and_eval_grids_reach_wandb(tmp_path, wandb):
    config = {"train": {"num_steps": 3}, "log": {"wandb": True}}
    runlog = RunLog(tmp_path, 3, 0, tensorboard=False, progress=False,
                    wandb=WandbLog(tmp_path, 0, "proj", "offline", config))
    images = np.random.default_rng(0).integers(0, 256, (2, 16, 16, 3), dtype=np.uint8)
    image_grid(images, ["0.50 a", "0.25 b"], eval_grid_path(tmp_path, 2))
    runlog.log(1, {"reward_mean": 0.5, "logp_diff_mean": np.array([0.1, 0.2])})
    runlog.log(2, {"reward_mean": 0.75, "eval_reward_mean": 0.375})
    runlog.close()
    (init,) = wandb.inits
    assert init["config"] == config and init["project"] == "proj" and init["dir"] == str(tmp_path)
    assert [step for step, _ in wandb.rows] == [1, 2]
    first, second = wandb.rows[0][1], wandb.rows[1][1]
    assert first["reward_mean"] == 0.5 and first["logp_diff_mean/1"] == 0.2 and "eval/grid" not in first
    assert second["eval_reward_mean"] == 0.375
    grid = second["eval/grid"].data
    assert grid.dtype == np.uint8 and grid.ndim == 3 and np.array_equal(grid[:16, :16], images[0])
    assert wandb.finished == 1


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, wandb):
    WandbLog(tmp_path, 0, "jaxflow", "offline", {}).close()
    kept = (tmp_path / ID_FILE).read_text().strip()
    WandbLog(tmp_path, 4, "jaxflow", "offline", {}).close()  # resumed from the checkpoint of step 4
    WandbLog(tmp_path, 0, "jaxflow", "offline", {}).close()  # started over: a new wandb run
    first, resumed, fresh = wandb.inits
    assert first["id"] == resumed["id"] == kept and fresh["id"] != kept
    assert all(init["resume"] == "allow" for init in wandb.inits)
    assert (tmp_path / ID_FILE).read_text().strip() == fresh["id"]
    assert f"wandb        run {fresh['id']}" in run_dir_lib.summary(tmp_path, 1, 1)
    with pytest.raises(UserError, match="already holds a run"):  # a new run (no --resume) is refused
        run_dir_lib.check_fresh(tmp_path)


def test_offline_is_the_default_and_wandb_mode_overrides(tmp_path, wandb, monkeypatch):
    cfg = tiny_config(tmp_path)
    assert validation.validate(cfg).log.wandb_mode == "offline" and not cfg.log.wandb
    WandbLog(tmp_path, 0, "jaxflow", cfg.log.wandb_mode, {})
    monkeypatch.setenv("WANDB_MODE", "online")
    WandbLog(tmp_path, 0, "jaxflow", "offline", {})
    assert [init["mode"] for init in wandb.inits] == ["offline", "online"]


@pytest.mark.parametrize("key, value, line", [
    ("log.wandb_mode", "cloud", "config.log.wandb_mode: 'cloud'; choose one of ('offline', 'online')"),
    ("log.wandb_project", "", "config.log.wandb_project: is empty: name the wandb project"),
])
def test_bad_wandb_keys_are_one_line(tmp_path, wandb, key, value, line):
    cfg = tiny_config(tmp_path)
    cfg.log.wandb = True
    section, name = key.split(".")
    cfg[section][name] = value
    with pytest.raises(UserError) as err:
        validation.validate(cfg)
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_without_wandb_installed(tmp_path, monkeypatch):
    """log.wandb=False never imports wandb; log.wandb=True names `pip install wandb`, at validation and at open."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError; find_spec finds none
    cfg = tiny_config(tmp_path)
    validation.validate(cfg)
    runlog = RunLog(tmp_path, 1, 0, tensorboard=False, progress=False)
    runlog.log(1, {"reward_mean": 0.5})
    runlog.close()
    cfg.log.wandb = True
    for opened in (lambda: validation.validate(cfg), lambda: WandbLog(tmp_path, 0, "jaxflow", "offline", {})):
        with pytest.raises(UserError, match=r"^config\.log\.wandb: True needs the wandb package: pip install wandb"):
            opened()


@pytest.mark.slow
def test_a_run_and_its_resume_log_to_one_wandb_run(ray_session, tmp_path, wandb):
    cfg = tiny_config(tmp_path, num_steps=2)
    cfg.log.wandb, cfg.eval.every = True, 2
    run(cfg)
    cfg.train.num_steps = 3
    run(cfg, resume=True)
    first, resumed = wandb.inits
    assert first["config"]["train"]["num_steps"] == 2 and resumed["config"]["train"]["num_steps"] == 3
    assert first["id"] == resumed["id"] and resumed["resume"] == "allow" and first["mode"] == "offline"
    assert [step for step, _ in wandb.rows] == [1, 2, 3] and wandb.finished == 2
    assert [("eval/grid" in row, "reward_mean" in row) for _, row in wandb.rows] == [(False, True), (True, True),
                                                                                     (True, True)]
