"""model.unroll_upgrade, resolved by the plan stage (`plan.unroll_upgrade`, `make_plan`): a long single-process run
planned with unrolled blocks and the fused kernel starts on the short-run program and records the unrolled one to
swap to; a short run, a run of several processes, an engine on the trainer's weights and 'off' do not upgrade, each
with its reason."""
import dataclasses

import pytest

from jaxflow.config import derived, machine, planner, validation
from jaxflow.config import plan as plan_lib
from jaxflow.config.errors import UserError
from jaxflow.nn.config import ModelOptions
from tests.helpers import tiny_config

UNROLLED = ModelOptions(dtype="bfloat16", scan_unroll=60, lora_gemm="pallas")
H200 = planner.Card("NVIDIA H200", 140.4)


def decide(mode="auto", planned=UNROLLED, *, auto_unroll=True, processes=1, upgrades=True):
    return plan_lib.unroll_upgrade(mode, planned, 60, auto_unroll=auto_unroll, processes=processes,
                                   family="qwen_image", upgrades=upgrades)


def test_the_cases():
    swaps, why = decide()
    assert swaps and why.startswith("auto: the blocks start in a scan")
    # a short run: the plan's short start already scans the blocks with XLA's linears
    short = dataclasses.replace(UNROLLED, scan_unroll=1, lora_gemm="xla")
    assert decide(planned=short) == (False, "")  # 'auto', the default, says nothing there
    assert decide("on", planned=short) == (False, "on: the planned blocks run in a scan (model.scan_unroll=1): nothing "
                                                  "to swap to")
    swaps, why = decide(processes=2)
    assert not swaps and "2 processes would all have to swap at the same step" in why
    assert decide("off") == (False, "")
    # 'auto' only where the plan unrolled them for the kernel; 'on' wherever they are unrolled
    assert not decide(auto_unroll=False)[0] and "model.unroll_upgrade='on'" in decide(auto_unroll=False)[1]
    xla = dataclasses.replace(UNROLLED, lora_gemm="xla")
    assert not decide(planned=xla)[0] and decide("on", xla, auto_unroll=False)[0]
    swaps, why = decide("on", upgrades=False)
    assert not swaps and "qwen_image's model cannot swap" in why
    swaps, why = plan_lib.unroll_upgrade("auto", UNROLLED, 60, auto_unroll=True, processes=1, family="qwen_image",
                                         upgrades=True, shared=True)
    assert not swaps and "rollout.share_weights" in why


@pytest.fixture
def plan(monkeypatch, tmp_path):
    """The plan of the tiny config on one H200 where the fused kernel runs (stubbed: the tiny model is no H200 case),
    with model.scan_unroll=0, model.lora_gemm='auto' (the recipe's) and `upgrade`."""
    monkeypatch.setattr(plan_lib, "lora_gemm", lambda cfg, *a: ("pallas", "auto: unrolled blocks, bf16 on H100/H200s"))
    monkeypatch.setattr(machine, "local_gpus", lambda: (H200, 1))

    def make(upgrade="auto", steps=10_000, processes=1):
        raw = tiny_config(tmp_path, num_steps=steps)
        raw.model.update(scan_unroll=0, unroll_upgrade=upgrade)
        cfg = validation.validate(raw)
        return plan_lib.make_plan(cfg, validation.model_folder(cfg), backend="gpu", devices=1, batch_devices=1,
                                  on_hopper=True, processes=processes)
    return make


def test_a_long_run_starts_scanned_and_records_the_unrolled_program(plan):
    p = plan()
    assert (p.model.scan_unroll, p.model.lora_gemm) == (1, "xla")
    assert not set(derived.PALLAS_XLA_OPTIONS) & set(p.xla_options)
    assert p.upgrade.model.lora_gemm == "pallas" and p.upgrade.model.scan_unroll >= 2
    assert dict(p.upgrade.xla_options).items() >= derived.PALLAS_XLA_OPTIONS.items()
    assert p.lora_gemm_why == "until the unroll upgrade, then pallas (auto: unrolled blocks, bf16 on H100/H200s)"
    line = p.summary().splitlines()[-1]
    assert line.startswith("  unroll upgrade (model.unroll_upgrade): auto: the blocks start in a scan")
    assert line.endswith(f"then model.lora_gemm=pallas, model.scan_unroll={p.upgrade.model.scan_unroll}, XLA options "
                         f"{dict(p.upgrade.xla_options)}")
    assert p.resized(2, 8, "fitted").upgrade == p.upgrade  # the memory check's fit keeps it


def test_short_multi_process_and_off_runs_keep_the_plan(plan):
    short = plan(steps=3)  # the short start: the blocks scan with XLA's linears, nothing to swap to
    assert short.upgrade is None and short.upgrade_why == "" and "unroll upgrade" not in short.summary()
    assert short.lora_gemm_why.startswith("auto: a short run")
    many = plan(processes=2)  # unrolled with the kernel from the start
    assert many.upgrade is None and "2 processes" in many.upgrade_why
    assert (many.model.lora_gemm, many.model.scan_unroll >= 2) == ("pallas", True)
    off = plan("off")
    assert off.upgrade is None and off.upgrade_why == "" and off.model == many.model
    assert "unroll upgrade" not in off.summary()


def test_a_bad_value_is_one_line(tmp_path):
    raw = tiny_config(tmp_path)
    raw.model.unroll_upgrade = "yes"
    with pytest.raises(UserError) as e:
        validation.validate(raw)
    assert str(e.value) == "config.model.unroll_upgrade: 'yes'; choose one of ('off', 'auto', 'on')"
