"""The layout's dependency rules, read from the imports: the contract imports neither framework nor either side,
nothing in jaxflow_bridge/ imports JAX or the trainer, and neither side imports the benchmarks (jaxflow_bench/)."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return names | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}


@pytest.mark.parametrize("path", sorted((ROOT / "jaxflow_bridge" / "contract").glob("*.py")), ids=lambda p: p.name)
def test_contract_imports_no_framework_and_neither_side(path):
    bad = {m for m in imported_modules(path)
           if m.split(".")[0] in {"jax", "flax", "optax", "torch", "jaxflow"} or m.startswith("jaxflow_bridge.rollout")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((ROOT / "jaxflow_bridge").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_bridge_imports_no_jax_and_no_trainer(path):
    """One rule for all of jaxflow_bridge/ (rollout, rewards, mini_ocr, contract): the trainer imports it, never the reverse."""
    bad = {m for m in imported_modules(path) if m.split(".")[0] in {"jax", "flax", "optax", "jaxflow"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted(p for d in ("jaxflow", "jaxflow_bridge") for p in (ROOT / d).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_neither_side_imports_the_benchmarks(path):
    bad = {m for m in imported_modules(path) if m.split(".")[0] == "jaxflow_bench"}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_checker_sees_an_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import jax.numpy as jnp\nfrom jaxflow.sde import sde_step\nfrom . import local\n")
    assert imported_modules(f) == {"jax.numpy", "jaxflow.sde"}
