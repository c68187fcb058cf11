"""`python -m jaxflow_bench.e2e OUT --recipe qwen_image_edit --layout 1gpu --engine vllm_omni` on the CPU, up to the
GPU: the trainer's command (the edit recipe, its random full-size folder drawn with model.init=random, vLLM-Omni
colocated on the GPU), the command that writes that folder, the result's name, and that the command's config
validates and plans (on the tiny edit folder standing in for the random one: a random-init run reads its files)."""
import sys

from jaxflow.plan import main as plan_main
from jaxflow_bench.e2e import ensure_model, parser, result_name, setup
from jaxflow_bridge.engines import families
from jaxflow_bridge.families.qwen_image_edit.tiny import tiny_pipeline_path
from scripts import make_random_pipeline

COMMAND = ["--recipe", "qwen_image_edit", "--layout", "1gpu", "--engine", "vllm_omni"]


def test_the_edit_recipe_trains_its_random_folder_with_vllm_omni_on_one_gpu(tmp_path, monkeypatch, capsys):
    e2e = families.spec("qwen_image_edit").E2E
    assert e2e["folder"] == "/tmp/qwen_edit_random" and e2e["init"] == "random" and e2e["micro"] == 1
    folder = tiny_pipeline_path()  # the random folder's stand-in
    args, _ = parser().parse_known_args([str(tmp_path / "out"), *COMMAND, "--model-dir", str(folder)])
    cmd, env, gpus, watched = setup(args, {})
    assert cmd[:5] == [sys.executable, "-m", "jaxflow.train", "--config", "configs/qwen_edit_ocr.py"]
    for arg in (f"--config.model.path={folder}", "--config.model.init=random", "--config.rollout.engine=vllm_omni",
                "--config.rollout.dtype=bfloat16", "--config.rollout.device=cuda", "--config.rollout.layout=colocated",
                "--config.rollout.num_gpus=1", "--config.sample.prompts_per_step=2",
                "--config.train.num_micro_batches=16"):  # an update's 2 x 16 / 2 samples, 1 a micro-batch (E2E's)
        assert arg in cmd, arg
    assert gpus == 1 and env["XLA_CLIENT_MEM_FRACTION"] == "0.56"
    assert result_name(args) == "e2e_qwen_image_edit_1gpu"
    argv = ["jaxflow.plan", *cmd[3:], "--gpus", "1", "--gpu-memory", "141"]
    monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the --config.KEY overrides from sys.argv
    assert plan_main(argv) == 0, capsys.readouterr().err  # the command's config validates and plans


def test_the_writer_is_asked_for_the_edit_folder(tmp_path, monkeypatch):
    """ensure_model runs the spec's writer on a missing folder: the edit family, no transformer weights."""
    ran = []
    monkeypatch.setattr("subprocess.run", lambda cmd, **kw: ran.append(cmd))
    args, _ = parser().parse_known_args([str(tmp_path / "out"), *COMMAND, "--model-dir", str(tmp_path / "m")])
    ensure_model(args, {})
    (cmd,) = ran
    assert cmd[1:] == ["scripts/make_random_pipeline.py", "--out", str(tmp_path / "m"), "--family",
                       "qwen_image_edit", "--no-transformer-weights"]
    assert "qwen_image_edit" in make_random_pipeline.FAMILIES
