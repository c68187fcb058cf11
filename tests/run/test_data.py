"""Prompt loading, the committed OCR prompt set, and GroupSampler determinism/partitioning."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest

from jaxflow.run.data import GroupSampler, PromptItem, load_prompts
from tests import HANG_S
from tests.forked_cli import run_many

ROOT = pathlib.Path(__file__).resolve().parents[2]


# --- loading -------------------------------------------------------------------------------------

def test_load_txt(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text('a sign that reads "Fresh Bread"\n\n  a mug with "Hi" and "x"  \n')
    assert load_prompts(path) == [PromptItem('a sign that reads "Fresh Bread"', "Fresh Bread"),
                                  PromptItem('a mug with "Hi" and "x"', "Hi")]


def test_load_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "a cake", "target": "Happy Birthday"}, {"prompt": 'a sign "Open"'}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_prompts(str(path)) == [PromptItem("a cake", "Happy Birthday"),
                                       PromptItem('a sign "Open"', "Open")]


@pytest.mark.parametrize("name,content,line", [
    ("p.txt", '"ok"\n\nno target here\n', 3),
    ("p.txt", '"ok"\nempty "" quotes\n', 2),
    ("p.jsonl", '{"prompt": "\\"ok\\""}\n{"prompt": "no quotes"}\n', 2),
    ("p.jsonl", "{not json\n", 1),
    ("p.jsonl", '{"prompt": "x", "target": " "}\n', 1),
])
def test_load_errors_name_file_and_line(tmp_path, name, content, line):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=f"{path.name}:{line}:"):
        load_prompts(path)


def test_prompts_without_a_target_load_when_no_reward_needs_one(tmp_path):
    """PickScore-style prompt files (no quoted text): refused for the OCR rewards, read with target None otherwise."""
    path = tmp_path / "pickscore.txt"
    path.write_text('a cat on a sofa\na sign "Open"\n')
    with pytest.raises(ValueError, match="pickscore.txt:1: no target"):
        load_prompts(path)
    assert load_prompts(path, need_target=False) == [PromptItem("a cat on a sofa", None),
                                                     PromptItem('a sign "Open"', "Open")]


def test_load_unknown_extension(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text('"x"\n')
    with pytest.raises(ValueError, match="extension"):
        load_prompts(path)


# --- committed OCR prompt set -------------------------------------------------------------------

@pytest.mark.parametrize("split,count", [("train", 2000), ("test", 200)])
def test_ocr_prompt_files(split, count):
    path = ROOT / "data" / "ocr" / f"{split}.txt"
    items = load_prompts(path)
    assert len(items) == count == len(path.read_text().splitlines())
    assert all(item.prompt.count('"') == 2 and 2 <= len(item.target) <= 30 for item in items)
    assert len({item.prompt for item in items}) == count


def test_ocr_prompt_script_reproduces_files(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_ocr_prompts.py"),
                    "--out-dir", str(tmp_path)], check=True, capture_output=True)
    for split in ("train", "test"):
        assert (tmp_path / f"{split}.txt").read_text() == \
            (ROOT / "data" / "ocr" / f"{split}.txt").read_text()
    train = {i.target.lower() for i in load_prompts(tmp_path / "train.txt")}
    test = {i.target.lower() for i in load_prompts(tmp_path / "test.txt")}
    assert not train & test


# --- GroupSampler --------------------------------------------------------------------------------

def _prompts(samples):
    return [p for p, _ in samples]


def test_sampler_deterministic_and_seeded():
    a, b = GroupSampler(50, 8, 4, seed=3), GroupSampler(50, 8, 4, seed=3)
    assert [a.sample(s) for s in range(20)] == [b.sample(s) for s in reversed(range(20))][::-1]
    assert GroupSampler(50, 8, 4, seed=4).sample(0) != a.sample(0)


@pytest.mark.parametrize("num_prompts,per_step", [(10, 3), (7, 7), (5, 4), (50, 8)])
def test_sampler_distinct_groups_and_epochs(num_prompts, per_step):
    group = 3
    sampler = GroupSampler(num_prompts, per_step, group, seed=0)
    visits = []
    for step in range(40):
        samples = sampler.sample(step)
        assert len(samples) == per_step * group
        for g in range(per_step):  # group members adjacent, one prompt per group id
            members = samples[g * group: (g + 1) * group]
            assert {gid for _, gid in members} == {g} and len(set(_prompts(members))) == 1
        step_prompts = _prompts(samples)[::group]
        assert len(set(step_prompts)) == per_step
        visits += step_prompts
    for e in range(len(visits) // num_prompts):  # each epoch visits every prompt exactly once
        assert sorted(visits[e * num_prompts: (e + 1) * num_prompts]) == list(range(num_prompts))


def test_sampler_host_split():
    full = GroupSampler(20, 6, 4, seed=1).sample(5)
    parts = [GroupSampler(20, 6, 4, seed=1, num_hosts=3, host_index=h).sample(5) for h in range(3)]
    assert [len(p) for p in parts] == [8, 8, 8] and sum(parts, []) == full
    with pytest.raises(ValueError, match="24.*5 hosts"):
        GroupSampler(20, 6, 4, seed=1, num_hosts=5)


def test_sampler_resume():
    sampler = GroupSampler(30, 4, 2, seed=7)
    for _ in range(9):
        sampler.sample()
    state = sampler.state_dict()
    expected = [sampler.sample() for _ in range(5)]
    resumed = GroupSampler(30, 4, 2, seed=7)
    resumed.load_state_dict(state)
    assert state["step"] == 9 and [resumed.sample() for _ in range(5)] == expected
    with pytest.raises(ValueError, match="seed"):
        GroupSampler(30, 4, 2, seed=8).load_state_dict(state)


def test_sampler_rejects_bad_sizes():
    with pytest.raises(ValueError, match="prompts_per_step"):
        GroupSampler(3, 4, 2, seed=0)


def test_sampler_uniform_coverage():
    sampler = GroupSampler(9, 4, 1, seed=0)
    counts = Counter(p for s in range(90) for p, _ in sampler.sample(s))
    assert set(counts.values()) == {40}


BAD_PROMPT_FILES = [
    ("empty.txt", "", "{path}: no prompts (the file is empty or blank): write one prompt a line"),
    ("blank.txt", "\n  \n\n", "{path}: no prompts (the file is empty or blank)"),
    ("plain.txt", '"OPEN"\nno quotes here\n', '{path}:2: no target text in double quotes: \'no quotes here\'; the '
                                                'OCR rewards score the text'),
    ("prompts.csv", 'prompt\n"OPEN"\n', "{path}: unknown prompt file extension; expected one of ['.jsonl', '.txt']: "
                                        "write the prompts one a line to a .txt"),
    ("latin1.txt", '"caf\xe9"\n', "{path}: not UTF-8 text"),
    ("few.txt", '"A"\n"B"\n', "{path} holds 2 prompts, fewer than a step's sample.prompts_per_step=4 (distinct "
                              "prompts): add prompts or pass --config.sample.prompts_per_step=2"),
]


@pytest.fixture(scope="module")
def bad_prompt_runs(tmp_path_factory):
    """The command line of each BAD_PROMPT_FILES case, its file and run_dir in a folder of its own, all run by
    tests/forked_cli.py (test_cli.py checks that its runs are what fresh processes do): [(folder, result)]."""
    root, cases = tmp_path_factory.mktemp("prompts"), []
    for i, (name, text, _) in enumerate(BAD_PROMPT_FILES):
        (root / str(i)).mkdir()
        (root / str(i) / name).write_bytes(text.encode("latin-1"))
        cases.append(["--config=configs/tiny_ocr.py", f"--config.data.train={root / str(i) / name}",
                      "--config.sample.prompts_per_step=4", f"--config.run_dir={root / str(i) / 'run'}"])
    runs, _ = run_many(cases)
    return [(root / str(i), SimpleNamespace(**run)) for i, run in enumerate(runs)]


@pytest.mark.parametrize("case", range(len(BAD_PROMPT_FILES)), ids=[name for name, _, _ in BAD_PROMPT_FILES])
def test_a_bad_prompt_file_is_one_line_before_any_work(bad_prompt_runs, case):
    """Each problem of data.train is one line naming the file (and line) and the fix, exit 2, from the command
    line's checks (no model, no Ray)."""
    (tmp_path, out), (name, _, needle) = bad_prompt_runs[case], BAD_PROMPT_FILES[case]
    path = tmp_path / name
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-3000:]
    assert lines[0].startswith("error: config.data.train: " + needle.format(path=path)), lines[0]
    assert not (tmp_path / "run").exists()
