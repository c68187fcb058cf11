"""jaxflow_bench.plan_vs_measured reads a run's plan line and its measured steps (the first, compiling, left out)."""
import json

import pytest

from jaxflow.config import planner
from jaxflow_bench import plan_vs_measured

# the line a run prints (the planner's own summary), as the e2e log stamps it
PLAN = "12:00:01 " + planner.Plan(planner.Card("NVIDIA H200", 139.8), 1, planner.Layout("colocated", "vllm_omni", False),
                                  4, 4, 0.56, 0.4, 33.0, 0.97, ()).summary() + "\n"


def _run(folder, plan, steps):
    (folder / "run").mkdir(parents=True)
    (folder / "train.log").write_text("start\n" + plan + "done\n")
    (folder / "run" / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "time/step": t}) + "\n"
                                                          for i, t in enumerate(steps)))
    return folder


def test_predicted_against_the_median_of_the_steps_after_the_first(tmp_path):
    run = _run(tmp_path / "a", PLAN, [300.0, 30.0, 31.0, 29.0])
    assert plan_vs_measured.main([str(tmp_path / "out"), str(run)]) == 0
    f = json.loads((tmp_path / "out" / "plan_vs_measured.json").read_text())["figures"]
    assert f["1gpu_colocated/measured_step_s"] == 30.0 and f["1gpu_colocated/predicted_step_s"] == 33.0
    assert abs(f["1gpu_colocated/error"] - 0.1) < 1e-9 and f["within_15pct"] is True
    assert abs(f["1gpu_colocated/measured_img_per_gpu_s"] - 0.97 * 33 / 30) < 1e-6


def test_a_run_without_a_prediction_is_one_line_exit_2(tmp_path, capsys):
    run = _run(tmp_path / "a", "12:00:01 plan: none (no weights)\n", [300.0, 30.0])
    assert plan_vs_measured.main([str(tmp_path / "out"), str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "predicted" in err[0]
    assert not (tmp_path / "out").exists()


def test_arms_mode_plans_every_measured_arm_and_writes_its_own_file(tmp_path):
    assert plan_vs_measured.main([str(tmp_path), "--arms"]) == 0
    record = json.loads((tmp_path / "plan_arms.json").read_text())
    f, measured = record["figures"], json.loads(plan_vs_measured.ARMS_RESULT.read_text())["figures"]
    arms = [a for a in plan_vs_measured.ARMS if f"{a}/step_s" in measured]
    assert {"awm", "nft", "flowgrpo"} <= set(arms)
    for arm in arms:
        assert f[f"{arm}/measured_step_s"] == measured[f"{arm}/step_s"]
        assert abs(f[f"{arm}/error"] - (f[f"{arm}/predicted_step_s"] / f[f"{arm}/measured_step_s"] - 1)) < 1e-5
    assert f["max_abs_error"] == max(abs(f[f"{a}/error"]) for a in arms)
    assert record["command"].endswith("--arms e2e_algorithms.json") and not (tmp_path / "plan_vs_measured.json").exists()


def test_no_runs_and_no_arms_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as exc:
        plan_vs_measured.main([str(tmp_path)])
    assert exc.value.code == 2
