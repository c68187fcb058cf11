"""Each model family is a folder per side (jaxflow/families/<name>/, jaxflow_bridge/families/<name>/) behind one
registry per side, with its identity in a framework-free spec.py both sides read (docs/design.md, "Adding a model
family"). Outside the family folders and the registries no module names a family, in code, strings or comments."""
import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JAX_FAMILIES, TORCH_FAMILIES = ROOT / "jaxflow" / "families", ROOT / "jaxflow_bridge" / "families"
REGISTRIES = {"jaxflow/families/__init__.py", "jaxflow_bridge/engines/families.py",
              "jaxflow_bridge/rollout/server.py"}  # the server's engine table names BAGEL's engine by import path
# Modules that still name a family, each with the part of redesign-3 that rewrites it; the test fails when one of
# them stops naming a family (drop it here) or when any other module starts to.
PENDING: dict[str, str] = {}
FAMILY_WORDS = ("bagel", "qwen", "qwen_image", "qwenimage")  # as `grep -wi`: bagel_deploy, qwen_image_tiny are other words


def family_words(text: str) -> set[str]:
    return {m.group(0).lower() for w in FAMILY_WORDS for m in re.finditer(rf"(?<!\w){w}(?!\w)", text, re.I)}


def generic_modules() -> list[str]:
    paths = (p for d in ("jaxflow", "jaxflow_bridge", "jaxflow_bench") for p in (ROOT / d).rglob("*.py"))
    return sorted(str(p.relative_to(ROOT)) for p in paths
                  if JAX_FAMILIES not in p.parents and TORCH_FAMILIES not in p.parents
                  and str(p.relative_to(ROOT)) not in REGISTRIES)


def test_no_generic_module_names_a_family_but_the_pending_ones():
    naming = {m: sorted(family_words((ROOT / m).read_text())) for m in generic_modules()}
    naming = {m: w for m, w in naming.items() if w}
    new = {m: w for m, w in naming.items() if m not in PENDING}
    assert not new, f"{new}: ask the family (its Family hooks, spec.py, or the registries) instead of naming it"
    done = sorted(set(PENDING) - set(naming))
    assert not done, f"{done} name no family any more: drop them from PENDING"


def test_the_family_word_checker_sees_a_name():
    assert family_words("from jaxflow.families.bagel import x  # Qwen-Image's, BAGEL's, QwenImage") == {
        "bagel", "qwen", "qwenimage"}
    assert family_words("cfg.rollout.bagel_deploy, 'qwen_image_tiny', bagel_keymap") == set()
    assert family_words("model.family='qwen_image'") == {"qwen_image"}


def folders(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}


def test_the_registries_list_exactly_the_family_folders():
    import jaxflow.families
    from jaxflow_bridge.engines import families as torch_families

    assert set(jaxflow.families.FAMILIES) == folders(JAX_FAMILIES) == folders(TORCH_FAMILIES)
    assert set(torch_families.FAMILIES) == folders(TORCH_FAMILIES)
    assert all(torch_families.FAMILIES[n] == f"jaxflow_bridge.families.{n}" for n in torch_families.FAMILIES)
    for name in torch_families.FAMILIES:
        spec = torch_families.spec(name)
        assert spec.NAME == name == jaxflow.families.by_name(name).name
        assert spec.TINY == jaxflow.families.by_name(name).tiny and spec.ENGINES == jaxflow.families.by_name(name).engines


def test_the_torch_side_family_packages_are_empty():
    """So that the JAX side imports a spec without pulling in torch."""
    inits = [TORCH_FAMILIES / "__init__.py", *(TORCH_FAMILIES / n / "__init__.py" for n in folders(TORCH_FAMILIES))]
    assert [p.read_text() for p in inits] == [""] * len(inits)


BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "flax", "optax", "torch"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import importlib
for m in sys.argv[1:]:
    importlib.import_module(m)
print("imported", len(sys.argv) - 1)
"""


def test_each_spec_imports_neither_jax_nor_torch():
    specs = [f"jaxflow_bridge.families.{n}.spec" for n in sorted(folders(TORCH_FAMILIES))]
    run = subprocess.run([sys.executable, "-c", BLOCK, *specs], cwd=ROOT, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0 and run.stdout.strip() == f"imported {len(specs)}", run.stderr[-2000:]


def test_the_blocker_refuses_a_framework():
    run = subprocess.run([sys.executable, "-c", BLOCK, "jaxflow.nn.attention"], cwd=ROOT, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode != 0 and "blocked: jax" in run.stderr


@pytest.mark.parametrize("name", sorted(folders(TORCH_FAMILIES)))
def test_a_family_module_names_no_other_family_in_its_spec(name):
    """spec.py (and the key map beside it) import only the contract and their own family's plain modules, or those of
    the family it builds on where its spec names one (`BASE`: Qwen-Image-Edit's is Qwen-Image)."""
    from jaxflow_bridge.engines import families as torch_families

    own = {name, getattr(torch_families.spec(name), "BASE", name)}
    allowed = ("jaxflow_bridge.contract", *(f"jaxflow_bridge.families.{n}.{p}" for n in own for p in ("spec", "keymap")))
    for part in ("spec.py", "keymap.py"):
        path = TORCH_FAMILIES / name / part
        tree = ast.parse(path.read_text())
        mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        bad = {m for m in mods if m.startswith("jaxflow") and not m.startswith(allowed)}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"
