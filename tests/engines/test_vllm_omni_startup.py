"""The vllm_omni engine's start (jaxflow_bridge/engines/vllm_omni/startup.py and the engine's stamps), on the CPU over
the stand-in vLLM-Omni: the parts it reports in `info()`, the compile caches and Inductor's compile threads its
workers get, the caches' hits they report after the first rollout (the stand-in builds the pipeline inside AsyncOmni, where a spawned worker would: it sees the actor's
environment as vLLM-Omni's workers inherit it)."""
import collections
import logging
import os
import time
from types import SimpleNamespace

import pytest
import torch._dynamo.utils
import torch._inductor.config

from jaxflow_bridge.engines.vllm_omni import engine as vllm_omni_engine
from jaxflow_bridge.engines.vllm_omni.startup import compile_threads, export_compile_caches
from jaxflow_bridge.families.qwen_image import vllm_omni_pipeline as vop
from jaxflow_bridge.families.qwen_image.tiny import tiny_pipeline_path
from tests.helpers import ROOT
from tests.helpers_vllm_omni import FakeOmniQwenImagePipeline, FakeWorker, install_fake_vllm_omni

CACHE_VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@pytest.fixture
def clean_env(monkeypatch):
    """The variables the start sets, unset, and put back as they were after the test (the engine writes os.environ)."""
    for var in (*CACHE_VARS, "TORCHINDUCTOR_COMPILE_THREADS"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def start(monkeypatch, tmp_path, config=None):
    """The engine over the stand-in, with a clock the start's steps advance: importing vLLM-Omni 9 s (which sets
    TORCHINDUCTOR_COMPILE_THREADS=1, as `import vllm` does), building the pipeline in AsyncOmni 47 s, each reply to
    our RPCs 3 s. Returns the engine and the environment the worker saw, with Inductor's compile_threads after our
    pipeline's __init__."""
    now, seen = [100.0], {}
    base = vop.build_pipeline_class(FakeOmniQwenImagePipeline, SimpleNamespace)

    class Worker(base):
        def __init__(self, **kwargs):
            seen.update(os.environ)
            now[0] += 47
            torch._inductor.config.compile_threads = 1  # what a worker's Inductor reads after `import vllm`
            super().__init__(**kwargs)
            seen["compile_threads"] = torch._inductor.config.compile_threads  # torch's overrides are per thread

    install_fake_vllm_omni(monkeypatch, tmp_path, {vop.PIPELINE_CLASS: Worker})
    import_omni, rpc_replies = vllm_omni_engine.import_omni, vllm_omni_engine.rpc_replies

    def importing():
        now[0] += 9
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        return import_omni()

    def replies(results):
        now[0] += 3
        return rpc_replies(results)
    monkeypatch.setattr(vllm_omni_engine, "import_omni", importing)
    monkeypatch.setattr(vllm_omni_engine, "rpc_replies", replies)
    monkeypatch.setattr(vllm_omni_engine, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                                  perf_counter=time.perf_counter))
    engine = vllm_omni_engine.VllmOmniEngine({"engine": "vllm_omni", "model": str(tiny_pipeline_path()), **(config or {})})
    return engine, seen


def test_the_engine_reports_its_starts_parts(tmp_path, monkeypatch, clean_env):
    engine, _ = start(monkeypatch, tmp_path)
    assert engine.info()["start"] == {"imports": 9.0, "engine": 47.0, "checks": 3.0, "warmup": 0.0}  # the server's, not the engine's


def test_the_workers_compile_caches_go_under_compile_cache_unless_the_user_set_them(tmp_path, monkeypatch, clean_env):
    _, seen = start(monkeypatch, tmp_path / "off")
    assert not {var for var in CACHE_VARS if seen.get(var)}  # train.compile_cache=False: torch's defaults
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    _, seen = start(monkeypatch, tmp_path / "on", {"compile_cache": str(tmp_path / "cache")})
    assert seen["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    assert seen["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert export_compile_caches(None) == {}


@pytest.mark.parametrize("user, want", [(None, 1), ("1", 1), ("3", 3)])
def test_the_worker_compiles_with_the_users_threads_where_vllms_import_forced_one(tmp_path, monkeypatch, clean_env, user, want):
    if user is not None:
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", user)
    _, seen = start(monkeypatch, tmp_path)
    assert seen["TORCHINDUCTOR_COMPILE_THREADS"] == "1" and seen["compile_threads"] == want


def test_compile_threads_rule():
    assert compile_threads({}) is None and compile_threads({"TORCHINDUCTOR_COMPILE_THREADS": "1"}) is None
    assert compile_threads({"TORCHINDUCTOR_COMPILE_THREADS": "12"}) == 12
    with pytest.raises(ValueError, match=r"^TORCHINDUCTOR_COMPILE_THREADS='many': set it to a whole number"):
        compile_threads({"TORCHINDUCTOR_COMPILE_THREADS": "many"})


def test_a_worker_reports_its_compile_cache_lookups_as_plain_ints(monkeypatch):
    counters = collections.defaultdict(collections.Counter, inductor=collections.Counter(fxgraph_cache_hit=5))
    monkeypatch.setattr(torch._dynamo.utils, "counters", counters)
    counts = FakeWorker(None).rollout_compile_cache_counts()
    assert counts == {"fxgraph_cache_hit": 5, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 0,
                      "autograd_cache_hit": 0, "autograd_cache_miss": 0, "autograd_cache_bypass": 0}
    assert all(type(v) is int for v in counts.values())


SAMPLING = {"height": 16, "width": 16, "num_inference_steps": 2, "true_cfg_scale": 1.0, "sde_window_size": 1,
            "sde_window_range": (0, 1)}


def test_the_engine_logs_the_compile_cache_hits_once_after_its_first_rollout(tmp_path, monkeypatch, clean_env,
                                                                            caplog):
    """The first forward compiles (here: a warm cache's lookups counted, as torch counts them); the engine reads the
    workers' counts after that rollout, once in its life."""
    counters = collections.defaultdict(collections.Counter)
    monkeypatch.setattr(torch._dynamo.utils, "counters", counters)
    engine, _ = start(monkeypatch, tmp_path)
    pipeline = engine.omni.worker.model_runner.pipeline
    forward = pipeline.forward

    def compiling(req):
        if not counters:
            counters["inductor"].update(fxgraph_cache_hit=12, fxgraph_cache_bypass=1)
            counters["aot_autograd"].update(autograd_cache_hit=11, autograd_cache_miss=1)
        return forward(req)
    pipeline.forward = compiling

    def asked():
        return [m for m, _ in engine.omni.rpcs].count("rollout_compile_cache_counts")
    assert engine.info()["compile_cache_hits"] is None and asked() == 0
    with caplog.at_level(logging.INFO, logger=vllm_omni_engine.__name__):
        engine.generate(["a red fox"], 1, SAMPLING, seeds=[0])
        engine.generate(["a red fox"], 1, SAMPLING, seeds=[1])
    assert asked() == 1
    assert engine.info()["compile_cache_hits"] == {
        "fxgraph_cache_hit": 12, "fxgraph_cache_miss": 0, "fxgraph_cache_bypass": 1,
        "autograd_cache_hit": 11, "autograd_cache_miss": 1, "autograd_cache_bypass": 0}
    lines = [r.getMessage() for r in caplog.records if "compile caches" in r.getMessage()]
    assert lines == [("vllm_omni: torch compile caches after the first rollout: fx-graph 12 hit / 0 miss / 1 bypass, "
                      "aot-autograd 11 hit / 1 miss / 0 bypass")]


def test_a_failed_compile_cache_read_is_said_and_never_fails_the_rollout(tmp_path, monkeypatch, clean_env, caplog):
    engine, _ = start(monkeypatch, tmp_path)

    def broken(self):
        raise RuntimeError("no counters here")
    monkeypatch.setattr(FakeWorker, "rollout_compile_cache_counts", broken)
    with caplog.at_level(logging.WARNING, logger=vllm_omni_engine.__name__):
        batch = engine.generate(["a red fox"], 1, SAMPLING, seeds=[0])
        engine.generate(["a red fox"], 1, SAMPLING, seeds=[1])
    assert batch["images"].shape[0] == 1 and engine.info()["compile_cache_hits"] == {}
    assert [m for m, _ in engine.omni.rpcs].count("rollout_compile_cache_counts") == 1
    assert [r.getMessage() for r in caplog.records if "compile caches" in r.getMessage()] == [(
        "vllm_omni: could not read the workers' torch compile caches: vLLM-Omni RPC rollout_compile_cache_counts "
        "failed: [{'supported': False, 'error': 'no counters here'}]")]
