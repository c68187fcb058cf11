"""jaxflow_bench.rollout_profile: the categorisation of a profiler table by kernel / op name, the runner on the
CPU with the tiny model (CPU ops) writing every figure, and --engine vllm_omni: its figures from the workers' table
over the stand-in vLLM-Omni, and refused on the CPU."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from jaxflow_bench.rollout_profile import (
    WorkerProfiler,
    categorize,
    category,
    main,
    parser,
    profile,
    result_name,
    top_rows,
)
from tests import HANG_S
from tests.helpers import ROOT


def test_kernel_names_fall_in_their_categories():
    for name in ("flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "void pytorch_flash::flash_fwd_splitkv_kernel",
                 "fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "aten::_scaled_dot_product_flash_attention",
                 "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"):
        assert category(name) == "attention", name
    for name in ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "nvjet_hsh_128x256_64x4_1x2_h_bz_TNT",
                 "cutlass3x_sm90_tensorop_s64x128x32gemm_e4m3", "aten::addmm", "aten::mm", "aten::linear",
                 "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn", "_scaled_mm"):
        assert category(name) == "gemm", name
    for name in ("void vllm::scaled_fp8_quant_kernel<c10::BFloat16, c10::Float8_e4m3fn>",
                 "void vllm::segmented_max_reduction<c10::BFloat16>", "triton_red_fused_abs_amax_clamp_div_0",
                 "vllm::dynamic_per_token_scaled_fp8_quant_kernel",
                 "triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_gelu_lora_add_max_mul_reciprocal_select_0",
                 "triton_poi_fused__to_copy_clamp_clone_cutlass_scaled_mm_mul_reciprocal_slice_unsqueeze_view_2"):
        assert category(name) == "quant", name
    for name in ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>",
                 "aten::add", "aten::conv3d", "triton_poi_fused_mul_rsqrt_0", "aten::mmap_like",
                 "aten::amax"):
        assert category(name) == "other_kernels", name


def test_a_synthetic_profiler_table_per_image():
    """Own times summed by category over the images; the phase ranges never counted twice; the gaps the rest."""
    rows = [("flash_fwd_kernel", 0.4), ("nvjet_gemm", 1.0), ("aten::addmm", 0.2), ("elementwise_kernel", 0.2),
            ("scaled_fp8_quant_kernel", 0.2), ("sample", 5.0), ("vae_decode", 1.0), ("text_encoder", 0.5)]
    got = categorize(rows, wall_s=4.0, images=2)
    assert got == pytest.approx({"attention_s": 0.2, "gemm_s": 0.6, "quant_s": 0.1, "other_kernels_s": 0.1,
                                 "idle_gaps_s": 1.0})
    assert categorize(rows, wall_s=1.0, images=1)["idle_gaps_s"] == 0.0  # busier than the wall: no negative gap


@pytest.mark.slow
@pytest.mark.parametrize("lora", [[], ["--lora-rank", "4"]], ids=["base", "lora4"])
def test_the_runner_on_the_cpu_with_the_tiny_model(tmp_path, lora):
    got = subprocess.run([sys.executable, "-m", "jaxflow_bench.rollout_profile", str(tmp_path), "--model", "tiny",
                          "--device", "cpu", "--calls", "1", "--prompts", "1", "--n", "2", "--size", "32",
                          "--steps", "3", *lora], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S)
    assert got.returncode == 0, got.stderr[-3000:]
    record = json.loads((tmp_path / f"rollout_profile{'_lora4' if lora else ''}.json").read_text())
    f = record["figures"]
    assert record["engine"] == "diffusers" and f["images"] == 2 and record["lora_rank"] == (4 if lora else 0)
    if lora:  # the tiny model's blocks, each with the recipe's 12 targets
        bound = int(got.stdout.split("adapter bound to ")[1].split()[0])
        assert bound > 0 and bound % 12 == 0, got.stdout[-2000:]
    assert f["unprofiled_wall_s"] > 0 and f["no_cfg_wall_s"] > 0 and len(record["top_kernels"]) == 15
    for key in ("attention_s", "gemm_s", "other_kernels_s", "text_encoder_s", "vae_decode_s", "denoise_s", "wall_s"):
        assert f[key] > 0, (key, f)
    assert f["idle_gaps_s"] >= 0 and f["trajectory_export_s"] >= 0
    kernels = f["attention_s"] + f["gemm_s"] + f["quant_s"] + f["other_kernels_s"] + f["idle_gaps_s"]
    assert kernels == pytest.approx(f["wall_s"], rel=1e-3) or kernels > f["wall_s"]  # gaps clipped at 0
    assert f["text_encoder_s"] + f["vae_decode_s"] + f["denoise_s"] <= f["wall_s"] * 1.05


def test_the_top_rows_are_the_largest_without_the_phase_ranges():
    rows = [("sample", 9.0), ("nvjet_gemm", 1.0), ("elementwise_kernel", 0.4), ("flash_fwd_kernel", 0.6)]
    assert top_rows(rows, images=2, n=2) == [{"name": "nvjet_gemm", "category": "gemm", "s_per_image": 0.5},
                                             {"name": "flash_fwd_kernel", "category": "attention", "s_per_image": 0.3}]


def test_vllm_omni_on_the_cpu_is_refused_in_one_line(capsys):
    assert main(["/nonexistent/out", "--engine", "vllm_omni", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --engine vllm_omni runs its workers on a GPU") and err.count("\n") == 1


@pytest.mark.parametrize("argv, names", [
    (["--quantization", "fp8", "--lora-rank", "64"], "add --engine vllm_omni"),
    (["--engine", "vllm_omni", "--quantization", "fp8"], "add --lora-rank 64"),
    (["--engine", "vllm_omni", "--quantization", "fp8", "--lora-rank", "64", "--lora-apply", "merged"],
     "drop --lora-apply merged"),
    (["--lora-apply", "layers"], "--lora-apply needs an adapter"),
])
def test_variants_that_cannot_run_are_refused_in_one_line(capsys, tmp_path, argv, names):
    assert main([str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and names in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def stub_engine_and_profiler(monkeypatch, stop) -> dict:
    """`main`'s engine and profiler as stand-ins in this process: the engine records its config (returned) and takes
    0.1 s longer a call with CFG; the profiler's `stop` is `stop()`."""
    import jaxflow_bench.rollout_profile as rp
    from jaxflow_bridge.rollout import server

    seen = {}

    class Engine:
        device, pipeline = SimpleNamespace(type="cpu"), None

        def __init__(self, config):
            seen.update(config)

        def generate(self, prompts, n, settings, seeds):
            if settings["true_cfg_scale"] > 1:
                time.sleep(0.1)

    class Profiler:
        def __init__(self, pipeline, cuda):
            self.stop = stop

        def start(self):
            pass

    monkeypatch.setattr(server, "engine_class", lambda config: Engine)
    monkeypatch.setattr(rp, "PipelineProfiler", Profiler)
    return seen


def test_a_variants_file_is_named_for_it():
    def name(*argv):
        return result_name(parser().parse_args(["OUT", *argv]))

    assert name() == "rollout_profile"
    assert name("--engine", "vllm_omni", "--quantization", "fp8", "--lora-rank", "64") == "rollout_profile_fp8_lora64"
    assert name("--lora-rank", "64", "--lora-apply", "merged") == "rollout_profile_lora64_merged"
    assert name("--cfg-forward", "batched") == "rollout_profile_batched"  # the recipe runs split
    assert name("--cfg-forward", "split") == "rollout_profile"


@pytest.mark.parametrize("argv, want", [([], "split"), (["--cfg-forward", "batched"], "batched")],
                         ids=["recipe", "batched"])
def test_the_engine_runs_true_cfg_as_the_recipe_does_unless_told(tmp_path, monkeypatch, argv, want):
    """The engine gets the recipe's rollout.cfg_forward ("split": no padded text, no masked attention in
    vLLM-Omni), or --cfg-forward's, and the result records it."""
    from jaxflow.config.recipes import base

    assert base().rollout.cfg_forward == "split"
    seen = stub_engine_and_profiler(monkeypatch, stop=lambda: {"rows": [["a kernel", 0.5]], "phases": {}})
    assert main([str(tmp_path), "--model", "tiny", "--device", "cpu", "--calls", "1", "--prompts", "1", "--n", "2",
                 *argv]) == 0
    assert seen["cfg_forward"] == want
    record = json.loads((tmp_path / f"rollout_profile{'' if want == 'split' else '_batched'}.json").read_text())
    assert record["cfg_forward"] == want and record["figures"]["images"] == 2


def test_a_profiler_that_never_stops_leaves_the_unprofiled_timings(tmp_path, monkeypatch):
    """The unprofiled timings are written, marked partial, before the profiler starts: a profiler whose stop never
    returns (cut short here by an error) leaves them; without CFG is the faster of the two."""
    from jaxflow_bench.results import finished

    def stuck():
        raise TimeoutError("the profiler's stop never returned")

    stub_engine_and_profiler(monkeypatch, stop=stuck)
    with pytest.raises(TimeoutError):
        main([str(tmp_path), "--model", "tiny", "--device", "cpu", "--calls", "2", "--prompts", "1", "--n", "3"])
    path = tmp_path / "rollout_profile.json"
    record = json.loads(path.read_text())
    assert record["partial"] is True and not finished(path)
    f = record["figures"]
    assert set(f) == {"cfg_overhead_s", "unprofiled_wall_s", "no_cfg_wall_s", "images"} and f["images"] == 6
    assert f["unprofiled_wall_s"] > f["no_cfg_wall_s"] > 0
    assert f["cfg_overhead_s"] == pytest.approx(f["unprofiled_wall_s"] - f["no_cfg_wall_s"], rel=1e-3)


@pytest.mark.slow
def test_vllm_omni_figures_from_its_workers_table(tiny_path, tmp_path, monkeypatch):
    """`profile` over the vllm_omni engine (the stand-in vLLM-Omni on the tiny model): the workers' table gives the
    same figures as the diffusers path's."""
    from jaxflow_bridge.engines.vllm_omni.engine import VllmOmniEngine
    from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
    from tests.helpers_vllm_omni import (
        FakeOmniQwenImagePipeline,
        install_fake_vllm_omni,
    )

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    install_fake_vllm_omni(monkeypatch, tmp_path, {
        vop.PIPELINE_CLASS: vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)})
    engine = VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_path)})
    sampling = {"height": 32, "width": 32, "num_inference_steps": 2, "true_cfg_scale": 4.0, "sde_window_size": 1,
                "sde_window_range": (0, 1)}
    f, top = profile(engine, ["a red fox"], 2, sampling, 1, WorkerProfiler(engine, cuda=False))
    assert top and all(t["s_per_image"] > 0 for t in top)
    assert f["images"] == 2
    for key in ("attention_s", "gemm_s", "other_kernels_s", "text_encoder_s", "vae_decode_s", "denoise_s", "wall_s"):
        assert f[key] > 0, (key, f)
    assert f["trajectory_export_s"] >= 0 and f["idle_gaps_s"] >= 0
    assert f["text_encoder_s"] + f["vae_decode_s"] + f["denoise_s"] <= f["wall_s"]
