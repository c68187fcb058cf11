"""vLLM-Omni's rollout under torch.profiler in its workers (jaxflow_bridge/rollout/profiling.py through the workers'
`rollout_profile_start` / `rollout_profile_stop` RPCs), on the CPU: a stand-in worker, then the engine over the
stand-in vLLM-Omni on the tiny model; the rows come back as plain lists that jaxflow_bench.rollout_profile's
categoriser reads."""
from types import SimpleNamespace

import pytest
import torch

from jaxflow_bench.rollout_profile import categorize
from tests.helpers import ROOT
from tests.helpers_vllm_omni import FakeWorker, install_fake_vllm_omni


class Pipeline:
    """A pipeline's phases as CPU ops: attention, GEMMs and an elementwise op."""

    def encode(self, x):
        return x @ x.T

    def decode(self, x):
        return torch.tanh(x) * 2

    def generate(self, x):
        q = self.encode(x)[None, None]
        return self.decode(torch.nn.functional.scaled_dot_product_attention(q, q, q)[0, 0])


def plain(value) -> bool:
    """Only lists, dicts, strings and numbers: what an RPC's reply carries."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(plain(v) for v in value)
    return isinstance(value, (str, int, float))


def test_the_worker_rpcs_record_the_requests_in_between():
    pipeline = Pipeline()
    worker = FakeWorker(pipeline)
    assert worker.rollout_profile_stop()["error"] is True  # nothing recording
    assert worker.rollout_profile_start(False) == {"recording": True}
    assert worker.rollout_profile_start(False)["error"] is True  # one recording at a time
    for _ in range(2):
        pipeline.generate(torch.randn(48, 64))
    table = worker.rollout_profile_stop()
    assert plain(table)
    assert set(table["phases"]) == {"text_encoder", "vae_decode", "sample"}
    assert table["phases"]["sample"] >= table["phases"]["text_encoder"] + table["phases"]["vae_decode"] > 0
    names = {name for name, _ in table["rows"]}
    assert "aten::mm" in names and not names & set(table["phases"])  # ops, never the ranges
    figures = categorize(table["rows"], wall_s=sum(s for _, s in table["rows"]), images=2)
    assert figures["gemm_s"] > 0 and figures["attention_s"] > 0 and figures["other_kernels_s"] > 0
    assert vars(pipeline) == {}  # unwrapped: the class's methods again
    pipeline.generate(torch.randn(4, 4))
    assert worker.rollout_profile_stop()["error"] is True


def test_the_engine_profiles_its_workers_rollout(tiny_path, tmp_path, monkeypatch):
    """profile_start / generate / profile_stop over the stand-in vLLM-Omni: the pipeline's phases and the transformer's
    ops of one rollout request, from the diffusion stage's worker; a second start is the engine's RuntimeError."""
    from jaxflow_bridge.engines.vllm_omni import engine as vllm_omni_engine
    from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
    from tests.helpers_vllm_omni import FakeOmniQwenImagePipeline

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pipeline = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)
    omni = install_fake_vllm_omni(monkeypatch, tmp_path, {vop.PIPELINE_CLASS: pipeline})
    engine = vllm_omni_engine.VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_path)})
    engine.profile_start(cuda=False)
    with pytest.raises(RuntimeError, match="recording already"):
        engine.profile_start(cuda=False)
    sampling = {"height": 32, "width": 32, "num_inference_steps": 2, "true_cfg_scale": 4.0, "sde_window_size": 1,
                "sde_window_range": (0, 1)}
    engine.generate(["a red fox"], 2, sampling, seeds=[0, 1])
    table = engine.profile_stop()
    assert ("rollout_profile_stop", [0]) in omni.started[-1].rpcs
    assert set(table["phases"]) == {"text_encoder", "vae_decode", "sample"}
    figures = categorize(table["rows"], wall_s=table["phases"]["sample"], images=2)
    assert figures["gemm_s"] > 0 and figures["attention_s"] > 0
    assert vars(omni.started[-1].worker.model_runner.pipeline).keys().isdisjoint({"encode", "decode", "generate"})
