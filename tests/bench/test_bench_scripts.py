"""Benchmark scripts' code paths at toy size on the CPU (their figures come from GPU runs, BENCHMARKS.md), and the
scripts' layout: command lines over the jaxflow_bench package, none importing another."""
import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from experiments.mini_ocr.algorithms import collect
from experiments.mini_ocr.result import breakdown
from experiments.mini_ocr.sweep import collect as sweep_collect
from jaxflow_bridge.rollout.sampling import SamplingParams
from tests import HANG_S

ROOT = Path(__file__).resolve().parents[2]
IMPORT = re.compile(r"^\s*(?:from\s+([\w.]+)\s+import\b|import\s+([\w.]+))", re.M)


def script_imports(text: str, scripts: set[str]) -> set[str]:
    """The modules of scripts/ that `text` (a script, or a shell script's inline Python) imports."""
    return {m.split(".")[0] for pair in IMPORT.findall(text) for m in pair if m} & scripts


def test_scripts_import_the_package_not_each_other_and_touch_no_sys_path():
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}
    assert script_imports("import os\n    from bench_model import FULL\nimport gemm_ceiling\n", scripts) == {
        "bench_model", "gemm_ceiling"}  # the checker sees an import
    bad = [f"{p.name}: {why}" for p in sorted((ROOT / "scripts").iterdir()) if p.suffix in (".py", ".sh")
           for why in (["sys.path"] if re.search(r"sys\.path\.(insert|append)", p.read_text()) else [])
           + sorted(script_imports(p.read_text(), scripts))]
    assert not bad, "\n".join(bad)


def test_benchmarks_take_the_recipes_train_step_config():
    """The train-step benchmarks build TrainConfig from the recipe (`jaxflow_bench.workload.recipe_train_config`) with
    their own changes only, never by hand, so they time the step that ships."""
    by_hand = [p.name for p in sorted((ROOT / "scripts").glob("*.py")) if "TrainConfig(" in p.read_text()]
    assert not by_hand, by_hand


def test_the_result_files_module_imports_neither_framework():
    """A machine with one framework writes result files: jaxflow_bench.results (and flops, rollout, kernels) import
    neither JAX nor torch."""
    code = ("import sys; import jaxflow_bench.results, jaxflow_bench.flops, jaxflow_bench.rollout, "
            "jaxflow_bench.kernels; print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'torch'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_attention_bench_writes_its_result_file(tmp_path):
    subprocess.run([sys.executable, "scripts/bench_attention.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True, timeout=HANG_S)
    record = json.loads((tmp_path / "attention_cudnn.json").read_text())
    assert {"name", "command", "device", "date", "figures"} <= set(record)
    figures = record["figures"]
    assert figures["xla_no_mask_fwd_ms"] > 0 and figures["xla_no_mask_fwd_bwd_ms"] > 0


def test_pallas_gemm_bench_writes_its_result_file(tmp_path):
    run = subprocess.run([sys.executable, "scripts/bench_pallas_gemm.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         check=True, capture_output=True, text=True, timeout=HANG_S)
    assert "pallas: skipped, the Hopper kernel needs an H100 or H200" in run.stdout  # CPU: the XLA columns only
    figures = json.loads((tmp_path / "pallas_gemm.json").read_text())["figures"]
    assert set(figures) == {f"{c}_64x32x128" for c in ("xla", "xla+c", "xla_notriton", "xla_bT_notriton")}
    assert all(v > 0 for v in figures.values())


@pytest.mark.slow
def test_lora_gemm_bench_writes_its_result_file(tmp_path):
    run = subprocess.run([sys.executable, "scripts/bench_lora_gemm.py", "--tiny", "--out", str(tmp_path)], cwd=ROOT,
                         check=True, capture_output=True, text=True, timeout=HANG_S)
    assert "fused: skipped, the kernel needs an H100 or H200" in run.stdout  # CPU: the XLA columns only
    figures = json.loads((tmp_path / "lora_gemm.json").read_text())["figures"]
    assert set(figures) == {f"{c}_{n}_ms_128x128x256" for c in ("fwd", "bwd") for n in ("base", "xla")}
    assert all(v > 0 for v in figures.values())


def test_mini_ocr_breakdown_counts_prompts_by_score_and_change():
    before, after = [0.0, 0.0, 0.5, 1.0, 0.75], [0.0, 0.25, 1.0, 0.75, 0.75]
    assert breakdown(before, after) == dict(before=dict(zero=2, partial=2, perfect=1),
                                            after=dict(zero=1, partial=3, perfect=1), rose=2, fell=1, same=2)
    with pytest.raises(ValueError, match="evaluate the same prompts"):
        breakdown(before, after[:4])


def fake_mini_ocr_run(pipeline: Path, before: float, after: dict[str, tuple[float, int, int]]) -> None:
    """An experiments/mini_ocr/run.sh OUT as its files: eval/before.json (before_nft.json: 0.1 lower, no CFG;
    before_omni.json, the bf16 folder's: 0.05 higher) and, per arm suffix, (OCR after, steps, seconds)."""
    (pipeline / "eval").mkdir(parents=True)
    for name, ocr in (("before", before), ("before_nft", before - 0.1), ("before_omni", before + 0.05)):
        (pipeline / "eval" / f"{name}.json").write_text(json.dumps(dict(mean=ocr, se=0.03, n=200)))
    lines = []
    for suffix, (ocr, steps, seconds) in after.items():
        (pipeline / "eval" / f"after{suffix}.json").write_text(json.dumps(dict(mean=ocr, se=0.04, n=200)))
        for step in (steps - 10, steps):
            (pipeline / f"rl{suffix}" / "checkpoints" / str(step)).mkdir(parents=True)
        lines.append(f"rl{suffix} {seconds} s")
    (pipeline / "timings.txt").write_text("\n".join(["data 15 s", *lines]) + "\n")


def test_mini_ocr_algorithms_collects_each_arm_over_its_pipelines(tmp_path):
    fake_mini_ocr_run(tmp_path / "p0", 0.5, {"": (0.7, 100, 540), "_nft": (0.9, 60, 600), "_guard": (0.6, 90, 530),
                                             "_cfgfree": (0.55, 100, 540)})
    fake_mini_ocr_run(tmp_path / "p1", 0.4, {"": (0.5, 110, 480), "_nft": (0.8, 70, 480), "_dropzero": (0.55, 120, 480)})
    results = collect([tmp_path / "p0", tmp_path / "p1"])
    assert list(results) == ["mini_ocr_algorithms"]  # no omni arm ran: no mini_ocr_fp8
    figures = results["mini_ocr_algorithms"]
    assert figures["nft/rise"] == pytest.approx((0.5 + 0.5) / 2)  # from the CFG-free "before"
    assert figures["cfgfree/before"] == pytest.approx(0.4) and figures["cfgfree/rise"] == pytest.approx(0.15)
    assert figures["nft/before"] == pytest.approx(0.35) and figures["nft/after"] == pytest.approx(0.85)
    assert figures["flowgrpo/before"] == pytest.approx(0.45)
    assert figures["nft/rise_min"] == pytest.approx(0.5) and figures["nft/pipelines"] == 2
    assert figures["nft/rise_se"] == pytest.approx((2 * (0.03 ** 2 + 0.04 ** 2)) ** 0.5 / 2)
    assert figures["nft/steps"] == 65 and figures["nft/minutes"] == pytest.approx(9.0)
    assert figures["nft/p1/rise"] == pytest.approx(0.5)
    assert figures["nft/rise_vs_flowgrpo"] == pytest.approx(((0.5 - 0.2) + (0.5 - 0.1)) / 2)
    assert figures["guard/pipelines"] == 1 and figures["guard/rise_vs_flowgrpo"] == pytest.approx(0.1 - 0.2)
    # paired: guard shares FlowGRPO's "before", which cancels; NFT's CFG-free one does not
    assert figures["guard/rise_vs_flowgrpo_se"] == pytest.approx((2 * 0.04 ** 2) ** 0.5)
    assert figures["nft/rise_vs_flowgrpo_se"] == pytest.approx((2 * (2 * 0.04 ** 2 + 2 * 0.03 ** 2)) ** 0.5 / 2)
    assert not any(k.startswith("corrected/") for k in figures)
    assert figures["dropzero/pipelines"] == 1 and figures["dropzero/rise_vs_flowgrpo"] == pytest.approx(0.15 - 0.1)
    without = collect([tmp_path / "p0", tmp_path / "p1"], exclude=("p0/nft",))["mini_ocr_algorithms"]
    assert without["nft/pipelines"] == 1 and without["nft/rise"] == pytest.approx(0.5) and "nft/p0/rise" not in without
    with pytest.raises(ValueError, match="PIPELINE/ARM"):
        collect([tmp_path / "p0"], exclude=("p9/nft",))
    with pytest.raises(ValueError, match="run experiments/mini_ocr/run.sh first"):
        collect([tmp_path / "nothing"])


def test_mini_ocr_collectors_read_the_evals_at_other_steps_into_their_own_results(tmp_path):
    fake_mini_ocr_run(tmp_path / "p0", 0.5, {"": (0.7, 100, 540), "_nft": (0.9, 60, 600),
                                             "_sweep_nft_lr2x": (0.92, 60, 600)})
    with pytest.raises(ValueError, match="with EVAL_ALSO_STEPS=40"):
        collect([tmp_path / "p0"], eval_steps=40)
    for name, ocr in (("before", 0.55), ("before_nft", 0.45), ("after", 0.8), ("after_nft", 0.97),
                      ("after_sweep_nft_lr2x", 0.96)):  # the same runs evaluated at 40 steps
        (tmp_path / "p0" / "eval" / f"{name}_s40.json").write_text(json.dumps(dict(mean=ocr, se=0.02, n=200)))
    results = collect([tmp_path / "p0"], eval_steps=40)
    assert list(results) == ["mini_ocr_algorithms_s40"]
    figures = results["mini_ocr_algorithms_s40"]
    assert figures["nft/before"] == pytest.approx(0.45) and figures["nft/after"] == pytest.approx(0.97)
    assert figures["flowgrpo/rise"] == pytest.approx(0.25) and figures["nft/rise_vs_flowgrpo"] == pytest.approx(0.27)
    assert figures["nft/steps"] == 60  # the run's own figures, whichever evals
    assert collect([tmp_path / "p0"])["mini_ocr_algorithms"]["nft/after"] == pytest.approx(0.9)  # the 10-step ones
    sweep = sweep_collect([tmp_path / "p0"], eval_steps=40)
    assert sweep["nft_lr2x/after"] == pytest.approx(0.96) and sweep["nft_lr2x/before"] == pytest.approx(0.45)
    assert sweep_collect([tmp_path / "p0"])["nft_lr2x/after"] == pytest.approx(0.92)


def test_the_fp8_result_pairs_the_fp8_rollout_arm_with_the_bf16_one_from_their_shared_bf16_before(tmp_path):
    fake_mini_ocr_run(tmp_path / "p0", 0.5,
                      {"": (0.7, 100, 540), "_omni": (0.75, 90, 540), "_omni_fp8": (0.65, 120, 530)})
    fake_mini_ocr_run(tmp_path / "p1", 0.4, {"_omni": (0.6, 80, 500), "_omni_fp8": (0.62, 110, 500)})
    results = collect([tmp_path / "p0", tmp_path / "p1"])
    assert set(results) == {"mini_ocr_algorithms", "mini_ocr_fp8"}
    flowgrpo_only = {k for k in results["mini_ocr_algorithms"] if k.startswith("flowgrpo/")}
    assert set(results["mini_ocr_algorithms"]) == flowgrpo_only
    fp8 = results["mini_ocr_fp8"]
    assert not any(k.startswith("flowgrpo/") for k in fp8)
    # both rise from the bf16 folder's "before" (0.55, 0.45), not the pipeline's (0.5, 0.4)
    assert fp8["omni/before"] == pytest.approx(0.5) and fp8["omni/rise"] == pytest.approx((0.2 + 0.15) / 2)
    assert fp8["omni_fp8/rise"] == pytest.approx((0.1 + 0.17) / 2) and fp8["omni_fp8/steps"] == 115
    assert fp8["omni_fp8/rise_se"] == pytest.approx((2 * (0.03 ** 2 + 0.04 ** 2)) ** 0.5 / 2)
    assert fp8["omni_fp8/rise_vs_omni"] == pytest.approx(((0.1 - 0.2) + (0.17 - 0.15)) / 2)
    # paired on one "before": only the two after-evals' errors remain
    assert fp8["omni_fp8/rise_vs_omni_se"] == pytest.approx((2 * 2 * 0.04 ** 2) ** 0.5 / 2)
    assert "omni/rise_vs_omni" not in fp8
    assert collect([tmp_path / "p1"]).keys() == {"mini_ocr_fp8"}
    assert collect([tmp_path / "p0", tmp_path / "p1"], exclude=("p0/omni_fp8",))["mini_ocr_fp8"][
        "omni_fp8/pipelines"] == 1


def test_the_mini_ocr_sweep_collects_each_variant_paired_with_the_baseline_and_every_variant_validates(tmp_path):
    from experiments.mini_ocr import sweep
    from jaxflow.config import validation
    fake_mini_ocr_run(tmp_path / "p0", 0.5, {"_sweep_baseline": (0.6, 50, 420), "_sweep_lr2x": (0.75, 52, 420),
                                             "_guard": (0.9, 50, 420), "_sweep_nft": (0.9, 90, 570),
                                             "_sweep_nft_decay1": (0.95, 90, 570)})
    fake_mini_ocr_run(tmp_path / "p1", 0.4, {"_sweep_baseline": (0.45, 50, 420), "_sweep_lr2x": (0.6, 48, 420),
                                             "_sweep_kl": (0.5, 49, 420)})
    figures = sweep.collect([tmp_path / "p0", tmp_path / "p1"])
    # NFT's variants: from the CFG-free "before" (0.4 on p0), paired with the NFT arm as configured
    assert figures["nft_decay1/rise"] == pytest.approx(0.55) and figures["nft/before"] == pytest.approx(0.4)
    assert figures["nft_decay1/rise_vs_nft"] == pytest.approx(0.05) and figures["nft_decay1/pipelines"] == 1
    assert not any(k.startswith("nft") and k.endswith("rise_vs_baseline") for k in figures)
    assert figures["lr2x/rise"] == pytest.approx(0.225) and figures["baseline/rise"] == pytest.approx(0.075)
    assert figures["lr2x/rise_vs_baseline"] == pytest.approx(0.15) and figures["lr2x/steps"] == 50
    assert figures["lr2x/rise_vs_baseline_se"] == pytest.approx((2 * 2 * 0.04 ** 2) ** 0.5 / 2)
    assert figures["kl/pipelines"] == 1 and figures["kl/rise_vs_baseline"] == pytest.approx(0.1 - 0.05)
    assert not any(k.startswith("guard/") for k in figures)  # an arm's run is no sweep variant
    assert not any(k.endswith(("train_reward_last", "approx_kl_late")) for k in figures)  # no metrics.jsonl
    # the train side from metrics.jsonl: rewards at both ends, medians from step 6 on (clipfrac logged from 7 on)
    rows = [dict(step=s, reward_mean=0.1 * s, approx_kl=1e-8 * s, **({"clipfrac": 0.5} if s >= 7 else {}))
            for s in range(1, 11)]
    (tmp_path / "p0" / "rl_sweep_lr2x" / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "p1" / "rl_sweep_lr2x" / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    figures = sweep.collect([tmp_path / "p0", tmp_path / "p1"])
    assert figures["lr2x/train_reward_first"] == pytest.approx(0.2) and figures["lr2x/train_reward_last"] == \
        pytest.approx(0.9)  # p1's one row is too few for either end: p0's alone
    assert figures["lr2x/approx_kl_late"] == pytest.approx(8e-8) and figures["lr2x/clipfrac_late"] == 0.5
    assert "baseline/train_reward_first" not in figures
    with pytest.raises(ValueError, match="run experiments/mini_ocr/sweep.sh first"):
        sweep.collect([tmp_path / "nothing"])
    assert set(sweep.FIRST) <= set(sweep.VARIANTS) and sweep.FIRST[0] == "baseline"
    assert sweep.overrides("window5") == ["--config.sample.window_size=5"]
    module = validation.config_module(ROOT / "configs" / "mini_ocr.py")
    assert set(sweep.REFERENCE.values()) <= set(sweep.VARIANTS)
    for name, (settings, why, arm) in sweep.VARIANTS.items():
        cfg = module.get_config(arm)
        cfg.model.path = "tiny"
        for key, value in settings.items():
            *path, field = key.split(".")
            section = functools.reduce(lambda c, k: c[k], path, cfg)
            assert section[field] != value, (name, key)  # a variant changes what it names
            section[field] = value
        validation.validate(cfg)
        assert why and not (settings and sweep.REFERENCE[arm] == name)


def test_scaling_figures_pick_the_better_layout_by_images_per_second_over_one_gpus():
    from jaxflow_bench.results import scaling_figures
    one = dict(img_per_gpu_s=1.0, gpus=1, step_s=32.0)
    layouts = {"2gpu_colocated": dict(img_per_gpu_s=0.95, gpus=2, step_s=33.7),
               "2gpu": dict(img_per_gpu_s=0.8, gpus=2, step_s=40.0)}
    figures = scaling_figures(one, layouts)
    assert figures["2gpu_colocated/scaling_vs_1gpu"] == pytest.approx(1.9)
    assert figures["2gpu/scaling_vs_1gpu"] == pytest.approx(1.6)
    assert figures["layout"] == "2gpu_colocated" and figures["scaling_vs_1gpu"] == pytest.approx(1.9)
    assert figures["img_per_gpu_s"] == 0.95 and figures["one_gpu_img_per_gpu_s"] == 1.0
    with pytest.raises(ValueError, match="no multi-GPU layout"):
        scaling_figures(one, {})


@pytest.mark.slow
def test_node_bench_refuses_a_micro_batch_that_does_not_divide_an_update(tmp_path):
    """jaxflow_bench.e2e's node layout before it starts anything: one line and exit 2 without nvidia-smi, and where
    --micro x the node's GPUs (a stand-in nvidia-smi listing 3) does not divide an update of the recipe (256 samples)."""
    import os
    script = [sys.executable, "-m", "jaxflow_bench.e2e", str(tmp_path / "out"), "--layout", "node"]
    bare = dict(os.environ, PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin")
    if subprocess.run(["bash", "-c", "command -v nvidia-smi"], env=bare, capture_output=True).returncode:
        got = subprocess.run(script, cwd=ROOT, env=bare, capture_output=True, text=True, timeout=HANG_S)
        assert got.returncode == 2 and "no nvidia-smi here" in got.stderr
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nprintf 'GPU 0\\nGPU 1\\nGPU 2\\n'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    got = subprocess.run([*script, "--micro", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert got.returncode == 2
    assert got.stderr.strip() == "error: --micro 2 x 3 GPUs does not divide an update's 256 samples"
    assert not (tmp_path / "out").exists()


def test_mini_ocr_eval_samples_as_the_configs_eval():
    """experiments.mini_ocr.evaluate samples as configs/mini_ocr.py's eval (the settings it wrote by hand before, but
    for sde_window_range, which an ODE run over every step ignores), --steps and --guidance replacing the eval's."""
    from experiments.mini_ocr.evaluate import eval_sampling  # the rollout engine's imports: only this test's
    by_hand = SamplingParams(height=64, width=128, num_inference_steps=10, true_cfg_scale=4.0, max_sequence_length=32,
                             sde_type="ode", noise_level=0.0, sde_window_size=None)
    assert eval_sampling() == dataclasses.replace(by_hand, sde_window_range=(0, 9))
    assert eval_sampling(4, 1.0) == dataclasses.replace(eval_sampling(), num_inference_steps=4, true_cfg_scale=1.0)


@pytest.mark.slow
def test_split_layout_bench_refuses_other_than_two_gpus(tmp_path):
    """jaxflow_bench.e2e's split layout takes its two GPUs from CUDA_VISIBLE_DEVICES (the actor the first, the trainer the
    second): anything but two ids is refused in one line, before a Ray head starts."""
    import os
    for given in ("3", "0,1,2"):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=given)
        got = subprocess.run([sys.executable, "-m", "jaxflow_bench.e2e", str(tmp_path / "out"), "--layout", "2gpu"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
        assert got.returncode == 2, got.stderr
        assert got.stderr.strip() == (f"error: --layout 2gpu needs two GPUs: set CUDA_VISIBLE_DEVICES to two ids such as 0,1 "
                                      f"(it is '{given}')")
        assert not (tmp_path / "out" / "ray_start.log").exists()


def test_scaling_bench_puts_together_layouts_already_measured(tmp_path):
    """jaxflow_bench.e2e --scaling runs no layout whose result OUT_DIR already holds (layouts run side by side on a larger
    host) and writes e2e_2gpu.json from them: the split layout's own file is e2e_2gpu_split.json."""
    import json
    from jaxflow_bench.results import write_result
    for layout, name, rate, gpus in (("1gpu", "e2e_1gpu", 1.0, 1), ("2gpu_colocated", "e2e_2gpu_colocated", 0.95, 2),
                                     ("2gpu", "e2e_2gpu_split", 0.8, 2)):
        write_result(tmp_path / layout, name, {"img_per_gpu_s": rate, "step_s": 30.0, "gpus": gpus}, command="by hand")
    got = subprocess.run([sys.executable, "-m", "jaxflow_bench.e2e", str(tmp_path), "--scaling"], cwd=ROOT,
                         capture_output=True, text=True, timeout=HANG_S)
    assert got.returncode == 0, got.stderr
    figures = json.loads((tmp_path / "e2e_2gpu.json").read_text())["figures"]
    assert figures["layout"] == "2gpu_colocated" and figures["scaling_vs_1gpu"] == pytest.approx(1.9)
    assert figures["2gpu/scaling_vs_1gpu"] == pytest.approx(1.6)
    assert not (tmp_path / "1gpu" / "train.log").exists()


def test_every_result_file_has_the_record_keys_and_every_one_named_exists():
    """benchmarks/results/*.json carry name, command, device, date and figures (a renamed earlier run keeps the name
    its script wrote); every result file BENCHMARKS.md names is there."""
    import json
    import re
    results = ROOT / "benchmarks" / "results"
    for path in results.glob("*.json"):
        record = json.loads(path.read_text())
        assert {"name", "command", "device", "date", "figures"} <= set(record), path.name
        assert isinstance(record["figures"], dict) and record["figures"], path.name
    named = set(re.findall(r"`([A-Za-z0-9_]+\.json)`", (ROOT / "BENCHMARKS.md").read_text()))
    assert named and not [name for name in named if not (results / name).exists()]


@pytest.mark.slow
def test_e2e_runner_sets_up_a_cpu_run_of_a_recipe_and_refuses_what_cannot_run(tmp_path):
    """jaxflow_bench.e2e --device cpu: the trainer gets jaxflow.train's CPU overrides and JAX the CPU, no memory is
    watched, and the recipe's micro-batch (16 samples for configs/tiny_ocr.py) is cut to an update's (2 prompts x 4 =
    8: one micro-batch, not 0); what a CPU run cannot be, or a micro-batch that does not divide an update, is refused
    in one line, exit 2, before anything is written."""
    import os
    from jaxflow.train import CPU_OVERRIDES
    from jaxflow_bench.e2e import parser, setup
    args, _ = parser().parse_known_args([str(tmp_path / "out"), "--device", "cpu", "--layout", "inproc", "--config",
                                         "configs/tiny_ocr.py"])
    cmd, env, gpus, watched = setup(args, dict(os.environ))
    assert cmd[:5] == [sys.executable, "-m", "jaxflow.train", "--config", "configs/tiny_ocr.py"]
    assert set(CPU_OVERRIDES.split()) <= set(cmd) and "--config.rollout.device=cuda" not in cmd
    assert "--config.train.num_micro_batches=1" in cmd and "--config.rollout.layout=in_process" in cmd
    assert not [a for a in cmd if a.startswith(("--config.model.path", "--config.model.init"))]  # the recipe's own
    assert env["JAX_PLATFORMS"] == "cpu" and gpus == 1 and watched is None
    script = [sys.executable, "-m", "jaxflow_bench.e2e", str(tmp_path / "out"), "--device", "cpu"]
    for extra, message in (
            (["--layout", "inproc"], "--device cpu runs a recipe of its own small model: --config configs/tiny_ocr.py"),
            (["--config", "configs/nothing.py"], "--config configs/nothing.py: no such file (a recipe such as "
                                                 "configs/tiny_ocr.py)"),
            (["--config", "configs/tiny_ocr.py", "--layout", "2gpu"],
             "--device cpu runs the diffusers engine in --layout inproc or 1gpu (its actor on the CPU)"),
            (["--config", "configs/tiny_ocr.py", "--layout", "inproc", "--micro", "3"],
             "--micro 3 x 1 device does not divide an update's 8 samples")):
        got = subprocess.run([*script, *extra], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
        assert (got.returncode, got.stderr.strip()) == (2, f"error: {message}")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_e2e_runner_on_the_cpu_writes_the_figures_of_a_gpu_run(tmp_path):
    """jaxflow_bench.e2e's generic path end to end on the tiny recipe (--device cpu: the trainer and its in-process
    diffusers engine on the CPU): exit 0, a result file with the record keys, the throughput and phase figures a GPU
    run writes (positive, finite), no peak_gib where no memory is read, and a command that parses back to this run."""
    import math
    import shlex
    from jaxflow_bench.e2e import parser
    argv = [str(tmp_path / "out"), "--device", "cpu", "--layout", "inproc", "--config", "configs/tiny_ocr.py",
            "--steps", "3", "--config.sample.group_size=2"]
    got = subprocess.run([sys.executable, "-m", "jaxflow_bench.e2e", *argv], cwd=ROOT, capture_output=True,
                         text=True, timeout=HANG_S)
    assert got.returncode == 0, got.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "e2e_cpu_inproc.json").read_text())
    assert {"name", "command", "device", "date", "figures"} <= set(record) and record["name"] == "e2e_cpu_inproc"
    figures = record["figures"]
    timed = ("img_per_gpu_s", "step_s", "rollout_s", "reward_s", "train_s", "to_device_s", "sync_s", "update_s")
    assert all(math.isfinite(figures[k]) and figures[k] > 0 for k in timed), figures
    assert figures["gpus"] == 1 and figures["steps_timed"] == 2 and figures["images_per_step"] == 4  # 2 prompts x 2
    assert 0 < figures["share_of_step_sync"] < 1 and "peak_gib" not in figures
    assert not (tmp_path / "out" / "gpu_mem.csv").exists()
    words = shlex.split(record["command"])
    assert words[:4] == ["python", "-m", "jaxflow_bench.e2e", "OUT"]
    assert parser().parse_known_args([argv[0], *words[4:]]) == parser().parse_known_args(argv)
