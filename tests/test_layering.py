"""The layout's dependency rules, read from the imports: the contract imports neither framework nor either side,
nothing in jaxflow_bridge/ imports JAX or the trainer, the torch side's folders import only the folders below them
(docs/design.md §1), jaxflow/nn/ imports no family, a family's spec.py and keymap.py no framework, neither side
imports the benchmarks (jaxflow_bench/) or the experiments (experiments/), and no
module under tests/ imports a test module (shared helpers live in tests/helpers*.py, tests/bagel_helpers.py, ...)."""
import ast
import re
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
           if m.split(".")[0] in {"jax", "flax", "optax", "torch", "jaxflow"}
           or m.startswith("jaxflow_bridge.") and not m.startswith("jaxflow_bridge.contract")}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("path", sorted((ROOT / "jaxflow_bridge").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_bridge_imports_no_jax_and_no_trainer(path):
    """One rule for all of jaxflow_bridge/ (rollout, rewards, contract): the trainer imports it, never the reverse."""
    bad = {m for m in imported_modules(path) if m.split(".")[0] in {"jax", "flax", "optax", "jaxflow"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


BRIDGE = ROOT / "jaxflow_bridge"
# The torch side's folders, bottom up: contract, rollout/kernels, sync, rollout, families, engines. Each folder's forbidden
# imports: the folders above it. A family's vLLM-Omni pipeline runs in vLLM-Omni's workers and uses that engine's
# worker-side helpers (engines/vllm_omni/fa_version.py; the LoRA slots in sync/vllm_omni_slots.py), never an engine the server names.
SERVED = tuple(m.split(":")[0] for m in re.findall(r'"(jaxflow_bridge\.[\w.]+:\w+)"',
                                                   (ROOT / "jaxflow_bridge/rollout/server.py").read_text()))
ABOVE = {
    "rollout/kernels": ("jaxflow_bridge",),  # torch ops alone
    # LoRA sync's sinks: on contract, rollout/kernels and the numpy<->torch handoff (rollout/tensors) only
    "sync": ("jaxflow_bridge.engines", "jaxflow_bridge.families", "jaxflow_bridge.rewards",
             "jaxflow_bridge.rollout.engine", "jaxflow_bridge.rollout.sampling", "jaxflow_bridge.rollout.server",
             "jaxflow_bridge.rollout.sde", "jaxflow_bridge.rollout.shared_weights",
             "jaxflow_bridge.rollout.random_weights", "jaxflow_bridge.rollout.fingerprint"),
    "rollout": ("jaxflow_bridge.engines", "jaxflow_bridge.families"),
    "families": ("jaxflow_bridge.engines.diffusers", "jaxflow_bridge.engines.vllm_omni.engine",
                 "jaxflow_bridge.engines.vllm_omni.kinds"),
}


def under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("folder, path", sorted((f, p) for f in ABOVE for p in (BRIDGE / f).rglob("*.py")),
                         ids=lambda x: x if isinstance(x, str) else str(x.relative_to(ROOT)))
def test_torch_side_folders_import_no_folder_above(folder, path):
    bad = {m for m in imported_modules(path) if under(m, ABOVE[folder])}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}, above {folder}/"


def test_the_server_names_each_engine():
    assert set(SERVED) == {"jaxflow_bridge.engines.diffusers", "jaxflow_bridge.engines.vllm_omni.engine",
                           "jaxflow_bridge.families.bagel.engine"}


@pytest.mark.parametrize("path", sorted(p for d in ("jaxflow", "jaxflow_bridge", "jaxflow_bench")
                                        for p in (ROOT / d).rglob("*.py")
                                        if BRIDGE / "engines" not in p.parents
                                        and p != BRIDGE / "families/bagel/engine.py"),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_server_reaches_the_engines(path):
    """The packages reach an engine through rollout/server.py's table of import paths, never by an import."""
    bad = {m for m in imported_modules(path) if under(m, SERVED)}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: go through jaxflow_bridge.rollout.server"


@pytest.mark.parametrize("path", sorted(p for d in ("jaxflow", "jaxflow_bridge") for p in (ROOT / d).rglob("*.py")),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_neither_side_imports_the_benchmarks_or_the_experiments(path):
    bad = {m for m in imported_modules(path) if m.split(".")[0] in {"jaxflow_bench", "experiments"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def imported_test_modules(path: Path) -> set[str]:
    """The tests/test_*.py modules `path` imports: `tests.test_x` / `test_x` (import or from-import), `from tests
    import test_x`, and relative `from .test_x import ...` / `from . import test_x`."""
    tree = ast.parse(path.read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            module = ("tests." if n.level else "") + (n.module or "")
            names.add(module)
            if module.rstrip(".") == "tests":
                names |= {f"tests.{a.name}" for a in n.names}
    return {m for m in names if any(part.startswith("test_") for part in m.split("."))}


@pytest.mark.parametrize("path", sorted((ROOT / "tests").rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_test_module_imports_another(path):
    """A helper shared by several test modules lives in a helper module, not in one of the tests (pytest would
    import that test module a second time under another name, and a test module's edit would break another's)."""
    bad = imported_test_modules(path)
    assert not bad, f"{path.relative_to(ROOT)} imports the test module(s) {sorted(bad)}: move the helper to a helper module"


def test_the_checker_sees_an_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import jax.numpy as jnp\nfrom jaxflow.algorithms.sde import sde_step\nfrom . import local\n")
    assert imported_modules(f) == {"jax.numpy", "jaxflow.algorithms.sde"}


def test_the_test_module_checker_sees_each_form(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import tests.test_a\nfrom tests.test_b import x\nfrom tests import test_c, helpers\n"
                 "from test_d import y\nfrom .test_e import z\nfrom . import test_f\nfrom tests.helpers import RANK\n"
                 "from tests import bagel_ref\nimport pytest\n")
    assert imported_test_modules(f) == {"tests.test_a", "tests.test_b", "tests.test_c", "test_d", "tests.test_e",
                                        "tests.test_f"}


# jaxflow/nn/ holds the family-free building blocks: below every family, never importing one or torch.
NN = ROOT / "jaxflow" / "nn"


@pytest.mark.parametrize("path", sorted(NN.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_nn_imports_no_family_and_no_torch(path):
    bad = {m for m in imported_modules(path)
           if m.split(".")[0] == "torch" or under(m, ("jaxflow.families", "jaxflow_bridge.families"))}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: jaxflow/nn/ is below the families"


@pytest.mark.parametrize("path", sorted([*(p for d in ("jaxflow", "jaxflow_bridge") for p in (ROOT / d).rglob("*.py")
                                           if p.name in ("spec.py", "keymap.py", "weight_keys.py")),
                                         ROOT / "jaxflow_bridge" / "engines" / "vllm_omni" / "rules.py"]),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_family_specs_and_key_maps_import_no_framework(path):
    """A family's spec.py and keymap.py, and the vllm_omni engine's rules, are read by both sides: plain Python and
    numpy."""
    bad = {m for m in imported_modules(path) if m.split(".")[0] in {"jax", "flax", "optax", "torch", "jaxflow"}}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_spec_checker_sees_every_family():
    found = {p.parent.name for p in (ROOT / "jaxflow_bridge" / "families").glob("*/spec.py")}
    assert found == {p.parent.name for p in (ROOT / "jaxflow" / "families").glob("*/family.py")}


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "jaxflow").rglob("*.py") if ROOT / "jaxflow" / "sync" not in p.parents),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_jax_side_reaches_torch_only_through_sync(path):
    """jaxflow/sync/ is where JAX meets torch (DLPack views, the shared file's page-locked copy); nothing else in
    jaxflow/ imports torch or the torch side's sinks."""
    bad = {m for m in imported_modules(path) if m.split(".")[0] == "torch" or under(m, ("jaxflow_bridge.sync",))}
    assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}: go through jaxflow/sync/"
