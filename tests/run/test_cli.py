"""The command line's answers to user errors: one line naming the fix and exit 2, before anything heavy; --help
exits 0 and says how to list the config keys, which --print_config does, each with its value and help (every key
has help: jaxflow/config/recipes.py HELP)."""
import os
import re
import runpy
import subprocess
import sys
from types import SimpleNamespace

import pytest

from jaxflow.config.recipes import HELP, base, config_keys, config_value, tiny
from tests.helpers import ROOT
from tests import HANG_S
from tests.forked_cli import run_many


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "jaxflow.train", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=HANG_S, env=env)


# the tiny BAGEL recipe on the vllm_omni engine, as a GPU run sets it
BAGEL_OMNI = ["--config=configs/tiny_bagel_ocr.py", "--config.rollout.engine=vllm_omni", "--config.rollout.dtype=bfloat16",
              "--config.rollout.device=cuda"]


USER_ERRORS = [
    (["--config.train.lerning_rate=1e-3"], 'Did you mean "learning_rate"'),
    (["--config.train.learning_rate=abc"], "could not convert"),
    (["--config.sample.same_latent=maybe"], "--config.sample.same_latent: 'maybe' is not a bool; pass True or False"),
    (["--config.sample.same_latent=yes"], "'yes' is not a bool"),
    (["--config.train.algorithm=nft", "--config.sample.guidance=1", "--config.sample.sde_type=ode",
      "--config.sample.same_latent=True"], "same pixels and every advantage 0: pass --config.sample.same_latent=False"),
    (["--config=configs/nope.py"], "configs/nope.py"),
    (["--config.rollout.engine=bagel_torch"], "'bagel_torch' does not serve model.family='qwen_image'; choose "
                                               "diffusers or vllm_omni"),
    (["--config=configs/tiny_bagel_ocr.py", "--config.rollout.engine=diffusers"],
     "'diffusers' does not serve model.family='bagel'; choose bagel_torch or vllm_omni"),
    (["--config=configs/tiny_bagel_ocr.py", "--config.rollout.device=cuda"],
     "config.rollout.device: 'cuda': BAGEL runs with 'cpu' on the bagel_torch engine"),
    (["--config=configs/tiny_bagel_ocr.py", "--config.rollout.engine=vllm_omni"],
     "config.rollout.dtype: 'float32': BAGEL runs with 'bfloat16' on the vllm_omni engine"),
    (["--config=configs/tiny_bagel_ocr.py", "--config.rollout.engine=vllm_omni", "--config.rollout.dtype=bfloat16"],
     "config.rollout.device: 'cpu': BAGEL runs with 'cuda' on the vllm_omni engine"),
    ([*BAGEL_OMNI, "--config.model.init=random"],
     "config.model.init: 'random': BAGEL runs with 'checkpoint' on the vllm_omni engine (vLLM-Omni's BAGEL has no"),
    ([*BAGEL_OMNI, "--config.rollout.lora_apply=merged"],
     "config.rollout.lora_apply: 'merged': BAGEL runs with 'auto' or 'folder' on the vllm_omni engine (its one LoRA"),
    (["--config=configs/tiny_bagel_ocr.py", "--config.train.algorithm=nft", "--config.sample.guidance=1"],
     "config.train.algorithm: 'nft': BAGEL runs with 'flowgrpo' for now"),
    (["--config=configs/tiny_bagel_ocr.py", "--config.model.path=/nonexistent/bagel"],
     "has no llm_config.json: it must be a bagel folder; for a run without weights use configs/tiny_bagel_ocr.py"),
    (["--config=configs/tiny_bagel_ocr.py", "--config.sample.negative_prompt=blurry"],
     "config.sample.negative_prompt: 'blurry': BAGEL runs with '' (its text CFG's unconditional branch"),
    (["--config.model.family=flux"], "config.model.family: 'flux'; choose one of qwen_image, qwen_image_edit, bagel"),
    (["--config.sample.cfg_renorm_min=0.5"], "sample.cfg_renorm_min are BAGEL's text CFG"),
    (["--config.model.path=/nonexistent/qwen"], "configs/tiny_ocr.py"),
    (["--resme"], "resume"),
    (["configs/qwen_ocr.py"], "--config FILE"),
]


@pytest.fixture(scope="module")
def forked(tmp_path_factory):
    """Every command line of this module's parametrized error tests, each a child of one process that imported
    jaxflow.train (tests/forked_cli.py): ({argv tuple: result}, what that process wrote itself)."""
    root = tmp_path_factory.mktemp("cli")
    cases = [args for args, _ in USER_ERRORS]
    cases += [_broken_config(root, i, write=True) for i in range(len(BROKEN_CONFIGS))]
    cases += [_broken_transformer(root, i, write=True) for i in range(len(BROKEN_TRANSFORMERS))]
    runs, output = run_many(cases)
    return {tuple(args): SimpleNamespace(**run) for args, run in zip(cases, runs)}, root, output


@pytest.mark.slow
def test_a_forked_command_line_is_what_a_fresh_process_writes(forked):
    """The forked runs stand for fresh processes: the same exit status and output, and the process they are forked
    from writes nothing while it imports jaxflow.train."""
    results, _, output = forked
    args = USER_ERRORS[0][0]
    fresh, child = cli(*args), results[tuple(args)]
    assert (child.returncode, child.stdout, child.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr) and \
        fresh.returncode == 2
    assert output == ""


@pytest.mark.parametrize("args, needle", USER_ERRORS)
def test_user_errors_are_one_line_and_exit_2(forked, args, needle):
    out = forked[0][tuple(args)]
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
    assert needle in lines[0] and "\\n" not in lines[0] and "Traceback" not in out.stderr
    assert "('" not in lines[0]  # no raw Python tuple


@pytest.mark.slow
def test_bagel_on_vllm_omni_passes_the_config_checks(tmp_path):
    """BAGEL on the vllm_omni engine, bfloat16 on cuda, is a valid config: the run gets past every config check to
    the first one that needs the GPU (JAX is held to the CPU here, so that one refuses it)."""
    out = cli(*BAGEL_OMNI, f"--config.run_dir={tmp_path / 'run'}", env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("error: JAX found no GPU but rollout.device is cuda")


def test_help_exits_0_and_names_print_config():
    out = cli("--help")
    assert out.returncode == 0 and "--print_config" in out.stdout and "--resume" in out.stdout


@pytest.fixture(scope="module")
def printed():
    out = cli("--print_config", "--config.train.learning_rate=0.5")
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_print_config_lists_every_key_with_overrides(printed):
    rows = [re.match(r"(\S+) += (.*?)(?:  # (.*))?$", line) for line in printed.splitlines()]
    assert all(rows), printed
    values = {row[1]: row[2].rstrip() for row in rows}
    assert values["train.learning_rate"] == "0.5" and values["run_dir"] == "'runs/tiny_ocr'"
    assert [row[1] for row in rows] == config_keys(tiny(base())) and len(rows) > 50  # every key, the config's order


def test_print_config_shows_each_keys_help(printed):
    line = next(line for line in printed.splitlines() if line.startswith("train.learning_rate "))
    assert re.fullmatch(rf"train\.learning_rate += 0\.5 +  # {re.escape(HELP['train.learning_rate'])}", line), line
    assert HELP["train.learning_rate"].startswith("AdamW learning rate")
    assert sum("  # " in line for line in printed.splitlines()) == len(HELP)  # every line has its help


def test_every_config_key_has_help():
    """A key added to base() without a line in jaxflow/config/recipes.py HELP fails here, and so does help for a key that
    base() no longer has."""
    keys = config_keys(base())
    assert len(keys) == len(set(keys)) and {"train.nft.beta", "reward.options", "sharding.rules"} <= set(keys)
    missing, stale = [k for k in keys if not HELP.get(k, "").strip()], sorted(set(HELP) - set(keys))
    assert not missing, f"keys without help in jaxflow/config/recipes.py HELP: {missing}"
    assert not stale, f"HELP names keys that base() lacks: {stale}"
    assert all("\n" not in text and len(text) <= 120 for text in HELP.values())  # one line each


def _spellings(value) -> set[str]:
    """How a help line could write a number: 2.0, 2, 2e-06, 2e-6."""
    forms = {repr(value), str(value), f"{value:g}"}
    if isinstance(value, float) and value.is_integer():
        forms.add(str(int(value)))
    return forms | {re.sub(r"e([+-])0+(\d)", r"e\1\2", f) for f in forms}


def test_no_help_line_repeats_its_keys_default():
    """A default lives once, in base() (--print_config shows it beside the help): a help line may name its key's
    value only as a bound (>= 1, in [0, 1], exit 0) or as the meaning of a special value ("0: off")."""
    cfg, repeats = base(), []
    for key, text in HELP.items():
        value = config_value(cfg, key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        for form in _spellings(value):
            for hit in re.finditer(rf"(?<![\w.\-]){re.escape(form)}(?![\w.])", text):
                before, after = text[:hit.start()].rstrip(), text[hit.end():]
                if not (after.startswith(":") or before.endswith((">=", ">", "<", "[", "(", "in", "exit"))):
                    repeats.append(f"{key}: {text!r} repeats {form}")
    assert not repeats, repeats


@pytest.mark.parametrize("config", sorted(p.name for p in (ROOT / "configs").glob("*.py")))
def test_shipped_configs_add_no_key_without_help(config):
    cfg = runpy.run_path(str(ROOT / "configs" / config))["get_config"]()
    assert not sorted(set(config_keys(cfg)) - set(HELP)), "keys without help in jaxflow/config/recipes.py HELP"


BROKEN_CONFIGS = [
    ("def get_config(:\n    pass\n", "{path}:1: SyntaxError: invalid syntax"),
    ("X = 1\nimport no_such_module_here\n", "{path}:2: ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("def get_config():\n    return {{}}['missing']\n", "{path}:2: KeyError: 'missing'"),
    ("X = 1\n", "{path} has no get_config(): define get_config() returning a ConfigDict"),
    ("def get_config():\n    return {{'a': 1}}\n", "{path}: get_config() returned dict, not a ConfigDict"),
    ("def get_config():\n    pass\n", "{path}: get_config() returned NoneType, not a ConfigDict"),
]


def _broken_config(root, case: int, write=False) -> list[str]:
    """The command line of BROKEN_CONFIGS[case], its file under `root` (written if `write`)."""
    path = root / f"config{case}" / "my_config.py"
    if write:
        path.parent.mkdir()
        path.write_text(BROKEN_CONFIGS[case][0].format())
    return [f"--config={path}", "--config.train.num_steps=3"]


@pytest.mark.parametrize("case", range(len(BROKEN_CONFIGS)), ids=[needle for _, needle in BROKEN_CONFIGS])
def test_broken_config_file_is_one_line_naming_it(forked, case):
    """A --config file that does not compile, import or give a ConfigDict: its path, line and error on one line."""
    results, root, _ = forked
    args = _broken_config(root, case)
    out, path, needle = results[tuple(args)], args[0].removeprefix("--config="), BROKEN_CONFIGS[case][1]
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0] == "error: --config: " + needle.format(path=path)


@pytest.mark.slow
def test_unwritable_jaxflow_cache_is_one_line_naming_it(tmp_path):
    """The tiny model's cache cannot be made (JAXFLOW_CACHE under a regular file: refused also to root): one line
    naming the variable and the path, exit 2."""
    (tmp_path / "a_file").write_text("")
    cache = tmp_path / "a_file" / "cache"
    out = cli("--config=configs/tiny_brightness.py", "--config.rollout.layout=in_process",
              f"--config.run_dir={tmp_path / 'run'}", env={**os.environ, "JAXFLOW_CACHE": str(cache)})
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"error: JAXFLOW_CACHE={cache}: cannot build qwen_image_tiny") and \
        "Not a directory" in lines[0] and "set JAXFLOW_CACHE to a writable folder" in lines[0]


BROKEN_TRANSFORMERS = [
    ('{"num_layers": 2,', "is not valid JSON (Expecting"),
    ("", "is not valid JSON (empty file)"),
    ("[1, 2]", "holds a list, not a JSON object"),
    ('{"attention_head_dim": 32, "axes_dims_rope": [16, 56, 56]}', ": axes_dims_rope (16, 56, 56) sums to 128 but "
                                                                   "attention_head_dim is 32"),
    ('{"num_layers": "two"}', ": '<' not supported"),
]


def _broken_transformer(root, case: int, write=False) -> list[str]:
    """The command line of BROKEN_TRANSFORMERS[case], its model folder under `root` (written if `write`)."""
    folder = root / f"model{case}"
    if write:
        (folder / "transformer").mkdir(parents=True)
        (folder / "model_index.json").write_text("{}")
        (folder / "transformer" / "config.json").write_text(BROKEN_TRANSFORMERS[case][0])
    return [f"--config.model.path={folder}", "--config.model.init=random", f"--config.run_dir={folder / 'run'}"]


@pytest.mark.parametrize("case", range(len(BROKEN_TRANSFORMERS)), ids=[needle for _, needle in BROKEN_TRANSFORMERS])
def test_broken_transformer_config_is_one_line_naming_the_file(forked, case):
    """A model folder whose transformer/config.json does not read (bad JSON, empty, inconsistent shapes): one line
    naming the file and what is wrong, exit 2, before any model loads."""
    results, root, _ = forked
    tmp_path, needle = root / f"model{case}", BROKEN_TRANSFORMERS[case][1]
    out = results[tuple(_broken_transformer(root, case))]
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith(f"error: config.model.path: {tmp_path / 'transformer' / 'config.json'}") and \
        needle in lines[0], lines[0]
