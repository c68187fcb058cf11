"""jaxflow_bench.e2e --arms: the arms' overrides (those of configs/mini_ocr.py's arms that define the algorithm), the
argument handling, and e2e_algorithms.json from each arm's result, with runs replaced by synthetic results."""
import ast
import json
from pathlib import Path

import pytest

from jaxflow.config import validation
from jaxflow_bench import e2e, e2e_series

ROOT = Path(__file__).resolve().parents[2]
# what makes an arm that algorithm: the keys compared between the two definitions
ALGORITHM_KEYS = ("train.algorithm", "train.ratio_norm", "train.old_log_prob", "train.beta", "sample.guidance",
                  "sample.sde_type", "sample.window_size", "sample.solver", "train.drop_zero_advantage")


def value(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def test_each_e2e_arm_sets_what_configs_mini_ocr_sets_for_it():
    module = validation.config_module(ROOT / "configs" / "mini_ocr.py")
    assert set(e2e_series.ARMS) - {"flowgrpo"} <= set(module.ARMS)
    for arm, overrides in e2e_series.ARMS.items():
        cfg = module.get_config()
        for arg in overrides:
            key, _, text = arg.removeprefix("--config.").partition("=")
            section, name = key.split(".")
            try:
                cfg[section][name] = type(cfg[section][name])(ast.literal_eval(text))
            except (ValueError, SyntaxError):
                cfg[section][name] = text
        want = module.get_config("" if arm == "flowgrpo" else arm)
        assert {k: value(cfg, k) for k in ALGORITHM_KEYS} == {k: value(want, k) for k in ALGORITHM_KEYS}, arm


def test_arms_run_each_arm_with_its_overrides_and_write_its_step_time_over_flowgrpos(tmp_path, monkeypatch):
    ran = []

    def fake_run(args, overrides, env=None):  # an arm's run: its result file, step time by arm
        ran.append((args.layout, args.out.name, args.result, overrides))
        step = {"flowgrpo": 30.0, "awm": 24.0, "mixgrpo": 27.0}[args.out.name]
        (args.out).mkdir(parents=True)
        (args.out / f"{args.result}.json").write_text(json.dumps(dict(figures=dict(step_s=step, img_per_gpu_s=1.0))))

    monkeypatch.setattr(e2e, "run", fake_run)
    assert e2e.main([str(tmp_path), "--arms", "awm", "flowgrpo", "mixgrpo", "--config.train.num_steps=3"]) == 0
    assert [r[:3] for r in ran] == [("1gpu", arm, f"e2e_alg_{arm}") for arm in ("awm", "flowgrpo", "mixgrpo")]
    assert ran[0][3] == e2e_series.ARMS["awm"] + ["--config.train.num_steps=3"]
    result = json.loads((tmp_path / "e2e_algorithms.json").read_text())
    figures = result["figures"]
    assert figures["awm/step_s"] == 24.0 and figures["flowgrpo/step_s"] == 30.0
    assert figures["awm/step_vs_flowgrpo"] == pytest.approx(0.8)
    assert figures["mixgrpo/step_vs_flowgrpo"] == pytest.approx(0.9) and "flowgrpo/step_vs_flowgrpo" not in figures
    assert "--arms awm flowgrpo mixgrpo --config.train.num_steps=3" in result["command"]


def test_arms_figures_without_flowgrpo_have_no_ratio():
    assert e2e_series.arms_figures({"awm": {"step_s": 24.0}}) == {"awm/step_s": 24.0}


def test_an_unknown_arm_is_refused_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        e2e.main([str(tmp_path), "--arms", "flowgrpo", "ppo"])
    assert exit_.value.code == 2 and "invalid choice: 'ppo'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
