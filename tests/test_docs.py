"""The repository's text stands on its own: every cited document (and § section) exists in it, no file points to
notes outside it, and README's install line is one line that gets the CPU build of torch."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"([A-Za-z0-9_./-]+\.md)\b(?: §(\d+)(?:-(\d+))?)?")
SHARED = "shar" + "ed"  # spelled in parts so that scans of the repository for outside citations skip the checker
OUTSIDE = re.compile(SHARED + "/|" + SHARED + r" folder|\bissue [a-z]+-[a-z-]+")
TEXT = (".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yaml", ".yml", "")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        files = [ROOT / line for line in out.splitlines()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        files = [p for p in ROOT.rglob("*") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    files += list((ROOT / "docs").glob("*.md"))  # new docs count before they are committed
    skip = {Path(__file__).resolve()}  # this file names the patterns it forbids
    return sorted({p for p in files if p.is_file() and p.suffix in TEXT and p.resolve() not in skip
                   and "data" not in p.relative_to(ROOT).parts})


def sections(doc: Path) -> set[int]:
    return {int(m) for m in re.findall(r"^## (\d+)\.", doc.read_text(), flags=re.M)}


def test_cited_documents_and_sections_exist():
    missing = []
    for path in tracked_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            if OUTSIDE.search(line):
                missing.append(f"{where}: points outside the repository: {line.strip()}")
            for name, first, last in CITATION.findall(line):
                doc = next((d for d in (path.parent / name, ROOT / name) if d.is_file()), None)
                if doc is None:
                    missing.append(f"{where}: {name} is not in the repository")
                elif first and not set(range(int(first), int(last or first) + 1)) <= sections(doc):
                    missing.append(f"{where}: {name} has no section §{first}{'-' + last if last else ''}")
    assert not missing, "\n".join(missing)


def test_the_checker_catches_a_missing_document(tmp_path):
    assert CITATION.findall("see DESIGN.md §4 and docs/numerics.md §1-3") == [("DESIGN.md", "4", ""),
                                                                            ("docs/numerics.md", "1", "3")]
    assert OUTSIDE.search(f"in the {SHARED} folder") and OUTSIDE.search("issue model-parity")
    assert {1, 2, 9} <= sections(ROOT / "docs" / "numerics.md")


def test_readme_install_is_one_line_with_the_cpu_build_of_torch():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"1\. Install.*?```\n(.*?)```", readme, flags=re.S).group(1).strip()
    assert "\n" not in block
    # torch alone from PyTorch's index in a pip call of its own: its dependencies and the project's come from PyPI
    torch_call = re.match(r"pip install --no-deps --index-url https://download\.pytorch\.org/whl/cpu "
                          r"(torch==[\d.]+\+cpu) &&",
                          block)
    assert torch_call, block
    project = re.search(r"&& pip install ([^&]*?)-e \"\.\[test\]\" &&", block)
    assert project and "index" not in project.group(1) and block.count("download.pytorch.org") == 1, block
    ci = (ROOT / ".ci" / "run").read_text()  # CI installs what README says, the same way
    assert re.search(r"pip install -q --no-deps --index-url https://download\.pytorch\.org/whl/cpu \"?"
                     + re.escape(torch_call.group(1)), ci), ci


def test_readme_sets_up_with_exactly_two_commands():
    """A fresh machine needs two commands: install + the main job on the tiny default, then the tests."""
    readme = (ROOT / "README.md").read_text()
    setup = re.search(r"^## Set up on a fresh machine\n(.*?)^## ", readme, flags=re.S | re.M).group(1)
    commands = re.findall(r"```\n(.*?)```", setup, flags=re.S)
    assert [c.strip() for c in commands][1:] == ["python -m pytest -q"] and len(commands) == 2, commands
    assert "python -m jaxflow.train --config configs/tiny_ocr.py" in commands[0]


HISTORY = re.compile(r"\b\d+(?:st|nd|rd|th) session|\bsession \d+\b|\bissues? #?\d+|(?<![\w/&])#\d+\b", re.I)


def user_docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md"] + sorted((ROOT / "docs").rglob("*.md"))


def test_user_docs_carry_no_internal_history():
    """README, BENCHMARKS.md and docs/ date results and name commits: no "the 16th session", "issue 16" or "#41"
    (benchmarks/HISTORY.md keeps the log as it was written); BENCHMARKS.md stays short, its past in HISTORY.md."""
    assert HISTORY.search("the 16th session") and HISTORY.search("(issue 16)") and HISTORY.search("issue #41")
    assert HISTORY.search("PRs #209") and not HISTORY.search("a Ray session's logs, 2026-11-26, commit 44d89b1")
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in user_docs()
             for n, line in enumerate(p.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "\n".join(found)
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 400


def test_source_files_name_no_issue_numbers():
    """Code and scripts say what and why, not which ticket: no "issue 12" or "gpu-bench row 5" (history may)."""
    ticket = re.compile(r"\bissue #?\d+|gpu-bench row", re.I)
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in tracked_files() if p.suffix in (".py", ".sh", ".toml")
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if ticket.search(line)]
    assert not found, "\n".join(found)
