"""Compiled train-step executables kept across starts, looked up by a key computed without tracing, so a warm start
skips tracing and lowering as well as XLA's compile (JAX's persistent cache is keyed by the lowered program: it
serves the compile only). The key is a sha256 over everything the program could change with: the function's name and
what it closes over (`describe`: the step config, the model's graphdef, the layout, the XLA options), the abstract
signature of its arguments (tree, shapes, dtypes, shardings), the source of the jaxflow packages, the library
versions, the devices, XLA_FLAGS and the JAX flags that change tracing. A hit loads the serialized executable
(`jax.experimental.serialize_executable`); a miss is traced and lowered, compiled by XLA in a thread of its own
(`compile_times.compile_lowered`: the step's misses compile at once) and stored (temp file + rename). An unreadable
entry is a miss with one warning line, then replaced. A program with a custom-partitioned op (cuDNN's attention over
several devices) keeps its partitioner's Python callbacks alive on the executable; they run only inside XLA's compile
and hold local functions that cannot be pickled, so a stored executable holds None in their place
(`_drop_partitioner_callbacks`). On while the persistent cache is (`jaxflow.config.machine.compilation_cache` calls
`use`), on GPU and TPU backends only (`BACKENDS`: jaxlib 0.10's CPU executables load in a new process but fail to
run, "Function ... not found"); off in a multi-process run."""
from __future__ import annotations

import concurrent.futures
import copyreg
import dataclasses
import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import re
import tempfile
import time
import types
from pathlib import Path

import jax
from jax.experimental import serialize_executable

from jaxflow.trainer.compile_times import CompileTime, compile_lowered, lower_timed

log = logging.getLogger(__name__)
PACKAGES = ("jaxflow", "jaxflow_bridge")  # the source the traced programs come from (hashed whole)
LIBRARIES = ("jax", "jaxlib", "flax", "optax", "numpy")
JAX_FLAGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl", "jax_threefry_partitionable",
             "jax_numpy_dtype_promotion", "jax_numpy_rank_promotion", "jax_use_shardy_partitioner")
BACKENDS = ("gpu", "cuda", "rocm", "tpu")  # where a deserialized executable runs in a new process
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_folder: Path | None = None


def _drop_partitioner_callbacks() -> None:
    """Pickle custom partitioning's callback holders (JAX keeps them on the executable until XLA has partitioned it)
    as None: a loaded executable is partitioned already. Nothing where this JAX has no such holder."""
    try:
        from jax._src.custom_partitioning import _ShardingCallbackInfo
    except ImportError:
        return
    copyreg.pickle(_ShardingCallbackInfo, lambda _: (type(None), ()))


_drop_partitioner_callbacks()


class Unkeyable(ValueError):
    """A closed-over value has no stable description (its repr is its address): the program cannot be keyed."""


def use(folder: Path | None) -> None:
    """Keep executables in `folder` from now on (None: off)."""
    global _folder
    _folder = folder


def folder() -> Path | None:
    """The folder in use, or None when the cache is off."""
    return _folder


def describe(obj) -> str:
    """A repr of `obj` that is the same in every process: dataclasses by field, functions by module, name, closure
    and defaults (their code is in `source_digest`), containers by item; Unkeyable for what only has an address."""
    if isinstance(obj, functools.partial):
        return f"partial({describe(obj.func)}, {describe(obj.args)}, {describe(obj.keywords)})"
    if isinstance(obj, (types.FunctionType, types.MethodType)):
        fn = getattr(obj, "__func__", obj)
        cells = tuple(c.cell_contents for c in fn.__closure__ or ())
        bound = describe(obj.__self__) if isinstance(obj, types.MethodType) else ""
        return (f"{fn.__module__}.{fn.__qualname__}({bound}; {describe(cells)}; {describe(fn.__defaults__)}; "
                f"{describe(fn.__kwdefaults__)})")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = ", ".join(f"{f.name}={describe(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{type(obj).__module__}.{type(obj).__qualname__}({fields})"
    if isinstance(obj, dict):
        return "{" + ", ".join(f"{describe(k)}: {describe(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (list, tuple)):
        return f"{type(obj).__name__}(" + ", ".join(describe(x) for x in obj) + ")"
    text = repr(obj)
    if _ADDRESS.search(text):
        raise Unkeyable(f"{type(obj).__qualname__} has no stable repr: {text[:200]}")
    return text


def describe_graphdef(graphdef) -> str:
    """An nnx graphdef's nodes and static attributes (its repr leaves the attributes' values out)."""
    return describe((graphdef.nodes, graphdef.attributes, graphdef.num_leaves))


@functools.cache
def source_digest() -> str:
    """sha256 over every .py file of the jaxflow packages (path and bytes), once a process."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def environment() -> str:
    """The libraries, the devices, XLA_FLAGS and the JAX flags a compiled program depends on beside its inputs."""
    devices = jax.devices()
    versions = [f"{name} {importlib.metadata.version(name)}" for name in LIBRARIES]
    flags = [f"{name}={getattr(jax.config, name, None)!r}" for name in JAX_FLAGS]
    return "; ".join(versions + [f"{jax.default_backend()} {devices[0].client.platform_version}",
                                 f"{len(devices)} x {devices[0].device_kind}",
                                 f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}"] + flags)


def signature(args) -> str:
    """The abstract signature of `args` (arrays or ShapeDtypeStructs): tree, and each leaf's shape, dtype, weak type
    and sharding."""
    leaves, tree = jax.tree.flatten(args)
    return describe((str(tree), [(tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                                  repr(getattr(x, "sharding", None))) for x in leaves]))


def key(name: str, program: str, args) -> str:
    """The executable's key: sha256 over the name, `program` (what the function closes over, `describe`d), the
    arguments' signature, `source_digest` and `environment`."""
    parts = (name, program, signature(args), source_digest(), environment())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def compile_cached(calls: dict, program: str | None) -> dict[str, tuple[jax.stages.Compiled, CompileTime]]:
    """Each of `calls` ({name: (jit, *args)}) compiled for its args, as {name: (compiled, CompileTime)}: loaded from
    the cache where an entry has its key (in a thread each; a CompileTime of trace 0, lower 0 and the load's
    seconds, `loaded`), else traced and lowered here, one after the other (they hold the GIL), and compiled by XLA
    in a thread each, all at once (`compile_times.compile_lowered`), then stored. `program`: `describe` of what the
    jits close over; None: not cached."""
    where = _folder
    on = (where is not None and program is not None and jax.process_count() == 1
          and jax.default_backend() in BACKENDS)
    paths = {name: where / f"{name}-{key(name, program, args)}.exe" for name, (_, *args) in calls.items()} if on else {}
    out = {}
    with concurrent.futures.ThreadPoolExecutor(len(calls), thread_name_prefix="compile") as pool:
        loads = {name: pool.submit(_load_timed, name, path) for name, path in paths.items() if path.exists()}
        compiles = {name: pool.submit(_compile_stored, lower_timed(name, fn, *args), paths.get(name))
                    for name, (fn, *args) in calls.items() if name not in loads}
        for name, future in loads.items():
            out[name] = future.result()
            if out[name] is None:  # unreadable: compiled anew and replaced
                fn, *args = calls[name]
                compiles[name] = pool.submit(_compile_stored, lower_timed(name, fn, *args), paths[name])
        out.update({name: future.result() for name, future in compiles.items()})
    return {name: out[name] for name in calls}


def _load_timed(name: str, path: Path) -> tuple[jax.stages.Compiled, CompileTime] | None:
    """`_load` timed as a CompileTime (trace 0, lower 0, `loaded`); None where it is a miss."""
    began = time.perf_counter()
    compiled = _load(path)
    done = time.perf_counter()
    if compiled is None:
        return None
    return compiled, CompileTime(name, 0.0, 0.0, 0.0, False, loaded=True, load=done - began, span=(began, done))


def _compile_stored(lowered, path: Path | None) -> tuple[jax.stages.Compiled, CompileTime]:
    """`compile_times.compile_lowered`, the result stored at `path` (None: not stored)."""
    compiled, took = compile_lowered(lowered)
    if path is not None:
        _store(path, compiled)
    return compiled, took


def _load(path: Path) -> jax.stages.Compiled | None:
    """The executable stored at `path`; None when there is none, or (with a warning line) when it cannot be read."""
    try:
        blob = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        entry = pickle.loads(blob)
        devices = {d.id: d for d in jax.devices()}
        return serialize_executable.deserialize_and_load(
            entry["payload"], entry["in_tree"], entry["out_tree"],
            execution_devices=[devices[i] for i in entry["devices"]])
    except Exception as exc:  # noqa: BLE001 - any unreadable entry is a miss, compiled anew and replaced
        log.warning("executable cache: %s is unreadable (%s: %s); compiling anew", path.name, type(exc).__name__,
                    str(exc)[:200])
        return None


def _store(path: Path, compiled: jax.stages.Compiled) -> None:
    """Write `compiled` to `path` atomically (temp file + rename); one warning line where it cannot be."""
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        devices = [d.id for d in compiled.runtime_executable().local_devices()]
        blob = pickle.dumps(dict(payload=payload, in_tree=in_tree, out_tree=out_tree, devices=devices))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(temp, path)
        except BaseException:
            os.unlink(temp)
            raise
    except Exception as exc:  # noqa: BLE001 - the run goes on with the executable it has
        log.warning("executable cache: cannot store %s (%s: %s)", path.name, type(exc).__name__, str(exc)[:200])
