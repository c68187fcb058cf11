"""The launchers for real on this machine. launch/slurm_train.sh: a stand-in SLURM (`srun` runs each task here,
`scontrol` names two nodes) starts a two-node Ray cluster on localhost (two raylets of one CPU each) and two JAX
processes (jax.distributed on CPU devices). launch/ray_train.sh: the trainer against a two-node cluster started
with `ray start`. In both the two rollout actors (one CPU each) can only run one on each node, and the run
finishes."""
import json
import os
import signal
import socket
import subprocess
from pathlib import Path
import pytest

from jaxflow_bridge.rollout.model_cache import cache_root
from tests.helpers import ROOT
from tests import HANG_S

SRUN = r"""#!/usr/bin/env bash
# stand-in srun: --nodes=N --ntasks=N [-w HOST] [...] CMD ARGS: N copies of CMD here, task i with SLURM_NODEID=i
n=1 host=""
while [[ $# -gt 0 && $1 == -* ]]; do
  case $1 in
    --nodes=*) n=${1#--nodes=} ;;
    -w) host=$2; shift ;;
  esac
  shift
done
if [ "$n" = 1 ]; then
  id=0; [ "$host" = node1 ] && id=1
  SLURM_NODEID=$id exec "$@"
fi
pids=()
for i in $(seq 0 $((n - 1))); do SLURM_NODEID=$i "$@" & pids+=($!); done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
SCONTROL = "#!/usr/bin/env bash\nprintf 'node0\\nnode1\\n'\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_slurm_launcher_runs_a_two_node_cluster_and_two_trainer_processes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    ray_port, jax_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "JAX_", "SLURM_"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", SLURM_JOB_NODELIST="node[0-1]", SLURM_NNODES="2",
               RAY_PORT=str(ray_port), JAX_PORT=str(jax_port), JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1",
               RAY_START_ARGS="--num-cpus=1 --disable-usage-stats",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", RAY_AUTH_MODE="token")
    run_dir, log = tmp_path / "run", open(tmp_path / "launcher.log", "w")
    proc = subprocess.Popen(
        ["bash", str(ROOT / "launch" / "slurm_train.sh"), str(ROOT / "configs" / "tiny_ocr.py"),
         f"--config.run_dir={run_dir}", "--config.train.num_steps=2", "--config.eval.every=1000",
         "--config.log.progress=False", "--config.log.tensorboard=False", "--config.rollout.num_servers=2",
         "--config.rollout.num_cpus=1", "--config.reward.fns={'jpeg_incompressibility': 1.0}"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # the raylets keep a pipe open
    try:  # each node has one CPU and each actor asks for one: the run can only go on with an actor on each node
        assert proc.wait(timeout=HANG_S) == 0, (tmp_path / "launcher.log").read_text()[-4000:]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _stop_cluster(ray_port)  # the raylets run on after the script: stop this cluster's processes only
        log.close()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and (run_dir / "lora_final").is_dir()


@pytest.mark.slow
def test_ray_launcher_runs_against_a_two_node_cluster(tmp_path):
    """A plain `ray start` (no RAY_AUTH_MODE: no token authentication) and ray_train.sh as the docs say, in a home
    of its own (no token file from other Ray sessions)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "JAX_", "SLURM_"))}
    env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1", HOME=str(tmp_path / "home"),
               JAXFLOW_CACHE=str(cache_root()))  # the tiny model built once, as elsewhere
    ray = ["python", "-m", "ray.scripts.scripts", "start", "--num-cpus=1", "--disable-usage-stats"]
    run_dir, log = tmp_path / "run", open(tmp_path / "launcher.log", "w")
    try:
        for args in (["--head", f"--port={port}"], [f"--address=127.0.0.1:{port}"]):  # the head node, a second one
            subprocess.run(ray + args, env=env, stdout=log, stderr=subprocess.STDOUT, check=True, timeout=HANG_S,
                           start_new_session=True)
        proc = subprocess.run(
            ["bash", str(ROOT / "launch" / "ray_train.sh"), str(ROOT / "configs" / "tiny_ocr.py"),
             f"--config.run_dir={run_dir}", "--config.train.num_steps=1", "--config.eval.every=0",
             "--config.log.progress=False", "--config.log.tensorboard=False", "--config.rollout.num_servers=2",
             "--config.rollout.num_cpus=1", "--config.reward.fns={'jpeg_incompressibility': 1.0}"],
            cwd=ROOT, env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, stdout=log, stderr=subprocess.STDOUT,
            timeout=HANG_S)
        assert proc.returncode == 0, (tmp_path / "launcher.log").read_text()[-4000:]
    finally:
        _stop_cluster(port)
        log.close()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1] and (run_dir / "lora_final").is_dir()


def _stop_cluster(port: int) -> None:
    """SIGKILL every process whose command line names this cluster's GCS port (gcs_server, raylets, their helpers,
    `ray start --block`) and forget its address (`ray start` leaves it for later `ray.init()`s, as `ray stop`
    would); other Ray instances on the machine (the test session's) are left alone."""
    current = Path("/tmp/ray/ray_current_cluster")
    if current.is_file() and current.read_text().strip().endswith(f":{port}"):
        current.unlink()
    needle = f":{port}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        words = cmdline.replace(b"\0", b" ")
        if needle in cmdline or any(f"--{flag}={port}".encode() in words for flag in ("gcs_server_port", "port")):
            try:
                os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass

