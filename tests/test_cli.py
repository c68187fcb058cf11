"""The command line's answers to user errors: one line naming the fix and exit 2, before anything heavy; --help
exits 0 and says how to list the config keys, which --print_config does."""
import subprocess
import sys

import pytest

from tests.test_train import ROOT


def cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxflow.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["--config.train.lerning_rate=1e-3"], 'Did you mean "learning_rate"'),
    (["--config.train.learning_rate=abc"], "could not convert"),
    (["--config.sample.same_latent=maybe"], "--config.sample.same_latent: 'maybe' is not a bool; pass True or False"),
    (["--config.sample.same_latent=yes"], "'yes' is not a bool"),
    (["--config=configs/nope.py"], "configs/nope.py"),
    (["--config.model.path=/nonexistent/qwen"], "configs/tiny_ocr.py"),
    (["--resme"], "resume"),
    (["configs/qwen_ocr.py"], "--config FILE"),
])
def test_user_errors_are_one_line_and_exit_2(args, needle):
    out = cli(*args)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    assert needle in lines[0] and "\\n" not in lines[0] and "Traceback" not in out.stderr
    assert "('" not in lines[0]  # no raw Python tuple


def test_help_exits_0_and_names_print_config():
    out = cli("--help")
    assert out.returncode == 0 and "--print_config" in out.stdout and "--resume" in out.stdout


def test_print_config_lists_every_key_with_overrides():
    out = cli("--print_config", "--config.train.learning_rate=0.5")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "--config.train.learning_rate=0.5" in lines and "--config.run_dir='runs/tiny_ocr'" in lines
    assert len(lines) > 50
