"""Many command lines of `python -m jaxflow.train` for the price of one start: `run_many` starts one process that
imports jaxflow.train and the tiny model's module (JAX, Flax, orbax, torch, transformers: most of a fresh process's
2-5 s), then runs each command line in a child forked from it, the child's stdout and stderr (the file descriptors)
captured and its exit status kept. A child is what a fresh `python -m jaxflow.train ARGS` is once its imports are
done; what the parent process itself writes (its imports) is returned too, for the caller to check it is nothing.

Run as `python -m tests.forked_cli RESULT_FILE` with a JSON list of argument lists on stdin (what `run_many` does)."""
import atexit
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests import HANG_S

ROOT = Path(__file__).resolve().parents[1]


def run_many(arg_lists: list[list[str]]) -> tuple[list[dict], str]:
    """Each argument list's {'returncode', 'stdout', 'stderr'}, in order, and what the parent wrote (its imports)."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        driver = subprocess.run([sys.executable, "-m", "tests.forked_cli", str(result)], cwd=ROOT, text=True,
                                input=json.dumps(arg_lists), capture_output=True, timeout=HANG_S)
        assert driver.returncode == 0, driver.stderr[-3000:]
        return json.loads(result.read_text()), driver.stdout + driver.stderr


def _child(argv: list[str], out: str, err: str) -> None:
    """In the forked child: stdout and stderr to the files, run the command line, exit as `python -m` would."""
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    code = 1
    try:
        from jaxflow import train
        from jaxflow.run import cli
        sys.argv = [train.__file__, *argv]
        code = cli.main(train.Trainer, sys.argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (exc.code is not None)
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def _main(result_file: str) -> None:
    arg_lists = json.load(sys.stdin)
    import jaxflow.train  # noqa: F401  (what `python -m jaxflow.train` imports before its main)
    import jaxflow_bridge.families.qwen_image.tiny  # noqa: F401  (torch and transformers: the tiny model's checks)
    runs = []
    out, err = f"{result_file}.out", f"{result_file}.err"  # in run_many's folder: a child's exit handlers leave it
    for argv in arg_lists:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, out, err)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        runs.append({"returncode": code, "stdout": Path(out).read_text(), "stderr": Path(err).read_text()})
    Path(result_file).write_text(json.dumps(runs))


if __name__ == "__main__":
    _main(sys.argv[1])
