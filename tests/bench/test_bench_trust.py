"""jaxflow_bench.trust on the CPU without a run: its arguments, the stale part's trainer command, and the figures
it writes from the parts' metrics."""
import json

import pytest

from jaxflow_bench import e2e, trust
from tests.helpers import ROOT


RECIPE_VALUES = {"prompts": 2, "group": 2, "mini": 1, "micro": 1, "short_start": False}  # e2e.recipe_values' stand-in


def test_bad_arguments_exit_2_naming_them(capsys):
    for argv in (["out", "--stale-from", "9"], ["out", "--kill-after", "5"], ["out", "--parts", "nope"],
                 ["out", "--seed=3"]):
        with pytest.raises(SystemExit) as err:
            trust.main(argv)
        assert err.value.code == 2
    err = capsys.readouterr().err
    assert "--stale-from 9 must be in [1, --steps 5]" in err
    assert "unrecognized arguments: --seed=3 (the trainer's overrides are --config.x=y)" in err


def test_each_part_runs_the_e2e_command_and_the_stale_part_injects_the_fault(tmp_path, monkeypatch):
    ran = {}

    def logged(cmd, env, out, watched):
        ran[out.name] = cmd
        (out / "run").mkdir(parents=True, exist_ok=True)
        (out / "run" / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n")
        (out / "train.log").write_text("error: LoRA sync check: diffusers engine 0 of 1 does not serve version 2\n"
                                       if out.name == "stale" else "")
        return 1 if out.name == "stale" else 0

    monkeypatch.setattr(e2e, "run_logged", logged)
    monkeypatch.setattr(e2e, "recipe_values", lambda config: RECIPE_VALUES)
    args = trust.parser().parse_args([str(tmp_path), "--config", str(ROOT / "configs/tiny_ocr.py"), "--device", "cpu",
                                      "--steps", "3"])
    assert trust.run_part(args, "stale", ["--config.seed=1"])["stopped_by_check"]
    cmd = ran["stale"]
    assert cmd[1:3] == ["-m", "jaxflow.train"] and "--config.train.num_steps=3" in cmd
    assert cmd[-2:] == ["--config.seed=1", "--config.train.sync_fault_from=2"]
    assert '--config.reward.fns={"brightness": 1.0}' in cmd  # a reward that varies on random weights' images
    trust.run_part(args, "healthy", [])
    assert not any("sync_fault_from" in a for a in ran["healthy"])
    monkeypatch.setattr(e2e, "run_logged", lambda *a: 1)
    with pytest.raises(RuntimeError, match="the repeat run failed .exit 1."):
        trust.run_part(args, "repeat", [])


def _part(out, name, metrics, **record):
    (out / name / "run").mkdir(parents=True)
    (out / name / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (out / name / "part.json").write_text(json.dumps({"part": name, **record}))


def _row(step, **k):
    return {"step": step, "grad_norm": 0.5, "sync_verify_s": 0.01 * step, "logp_mismatch_p99": 1e-4 * step, "logp_mismatch_max": 0.1,
            "logp_mismatch_rows": 8, "sync_mismatches": 0, "reward_mean": 0.5, "loss": [0.1, 0.3], "time/step": 10.0,
            "rollout/versions": 1, "staleness": 0, **k}


def test_the_figures_of_the_parts_found(tmp_path):
    _part(tmp_path, "healthy", [_row(s) for s in (1, 2, 3)], rc=0)
    assert set(trust.figures(tmp_path)) == {"sync_verify_s", "logp_mismatch_p99_p99", "logp_mismatch_p99_max",
                                            "logp_mismatch_max", "sync_mismatches", "healthy_steps"}
    _part(tmp_path, "repeat", [_row(1), _row(2, reward_mean=0.75), _row(3, loss=[0.1, 0.2])], rc=0)
    _part(tmp_path, "stale", [_row(1)], rc=1, stopped_by_check=True, stale_from=2)
    _part(tmp_path, "kill", [_row(1, **{"time/step": 50.0}), _row(2), _row(3, **{"time/step": 16.5}), _row(4)],
          rc=0, killed_step=3, retries=1)
    f = trust.figures(tmp_path)
    assert f["sync_verify_s"] == pytest.approx(0.02) and f["logp_mismatch_p99_max"] == pytest.approx(3e-4)
    assert 2e-4 < f["logp_mismatch_p99_p99"] < 3e-4
    assert f["reward_spread_max"] == 0.25 and f["loss_spread_max"] == pytest.approx(0.05)
    assert (f["stale_caught_step"], f["stale_from"], f["stale_exit"]) == (2, 2, 1)
    assert (f["actor_kill_recovery_s"], f["actor_kill_step"], f["actor_kill_retries"]) == (6.5, 3, 1)
    assert f["actor_kill_mixed_steps"] == []


def test_the_kill_part_fails_on_mixed_versions_and_counts_the_retries(tmp_path, monkeypatch):
    """The kill part's run (here a stand-in writing its metrics and log) fails the part when a step's samples came
    from more than one policy or not the step's own; it records the retries the trainer logged."""
    written = {}

    def logged(cmd, env, out, watched):
        (out / "run").mkdir(parents=True, exist_ok=True)
        (out / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written["rows"]))
        (out / "train.log").write_text("WARNING rollout actor died (ActorDiedError); restarting and retrying\n")
        return 0

    monkeypatch.setattr(e2e, "run_logged", logged)
    monkeypatch.setattr(e2e, "recipe_values", lambda config: RECIPE_VALUES)
    monkeypatch.setattr(trust.Killer, "start", lambda self: None)  # no actor to kill here
    args = trust.parser().parse_args([str(tmp_path), "--config", str(ROOT / "configs/tiny_ocr.py"), "--device", "cpu",
                                      "--steps", "3"])
    written["rows"] = [_row(1), _row(2), _row(3)]
    assert trust.run_part(args, "kill", [])["retries"] == 1
    for bad in ({"rollout/versions": 2}, {"staleness": 1}, {"rollout/versions": None}):
        written["rows"] = [_row(1), _row(2), _row(3, **bad)]
        with pytest.raises(RuntimeError, match=r"mixed or stale policy versions at steps \[3\]"):
            trust.run_part(args, "kill", [])


def test_a_part_whose_lora_did_not_move_or_a_stale_run_not_stopped_fails(tmp_path, monkeypatch):
    """A run whose every step had grad_norm 0 (every sample of a group scored the same: the recipe's OCR on random
    weights' images) proves nothing: the part fails naming the reward; so does a stale run the check let finish."""
    written = {}

    def logged(cmd, env, out, watched):
        (out / "run").mkdir(parents=True, exist_ok=True)
        (out / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in written["rows"]))
        (out / "train.log").write_text(written.get("log", ""))
        return written.get("rc", 0)

    monkeypatch.setattr(e2e, "run_logged", logged)
    monkeypatch.setattr(e2e, "recipe_values", lambda config: RECIPE_VALUES)
    args = trust.parser().parse_args([str(tmp_path), "--config", str(ROOT / "configs/tiny_ocr.py"), "--device", "cpu",
                                      "--steps", "3", "--reward", "ocr"])
    written["rows"] = [_row(s, grad_norm=0.0) for s in (1, 2, 3)]
    for part in ("healthy", "repeat"):
        with pytest.raises(RuntimeError, match=f"the {part} run's LoRA did not move .* --reward ocr"):
            trust.run_part(args, part, [])
    written["rows"] = [_row(1, grad_norm=0.0), _row(2), _row(3)]  # moved only after the fault began (version 2)
    with pytest.raises(RuntimeError, match="the stale run's LoRA did not move .grad_norm 0 at every step before"):
        trust.run_part(args, "stale", [])
    written["rows"] = [_row(1), _row(2), _row(3)]
    with pytest.raises(RuntimeError, match="the sync check did not stop the stale run .exit 0"):
        trust.run_part(args, "stale", [])
    written.update(log="error: LoRA sync check: vllm_omni engine 0 of 1 does not serve version 2\n", rc=1)
    assert trust.run_part(args, "stale", [])["stopped_by_check"]
