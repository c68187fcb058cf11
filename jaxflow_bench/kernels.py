"""GPU kernel time by class (attention, matmul, convolution, collective, copy, other), by the block's named scope and
by HLO op, read from a torch.profiler or jax.profiler trace (scripts/profile_step.py, bench_rollout_lora.py). JAX
only inside `xplane_kernels`; no torch.
"""
from __future__ import annotations

import collections
import re
from pathlib import Path

CLASSES = (("attention", ("sdpa", "fmha", "flash", "attention", "cudnn")), ("collective", ("nccl",)),
           ("copy", ("memcpy", "memset")),
           ("convolution", ("convolution", "conv2d", "conv3d", "winograd", "xmma_fprop", "dgrad", "wgrad")),
           ("matmul", ("gemm", "cublas", "nvjet", "xmma", "cutlass", "matmul", "mosaic_gpu")))


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CLASSES if any(k in low for k in keys)), "other")


SCOPES = ("modulation", "attention", "mlp")


def gpu_kernels(trace: dict) -> list[tuple[str, float, dict]]:
    """(name, microseconds, args) of every GPU kernel: torch marks them cat=kernel; JAX/XLA traces put them on the
    "Stream #N" threads of the process named for the GPU (its "XLA Ops"/"XLA Modules" lines repeat them)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    meta = [e for e in events if e.get("ph") == "M"]
    gpu_pids = {e["pid"] for e in meta if e.get("name") == "process_name"
                and "gpu" in str(e.get("args", {}).get("name", "")).lower()}
    streams = {(e["pid"], e["tid"]) for e in meta if e.get("name") == "thread_name" and e.get("pid") in gpu_pids
               and str(e.get("args", {}).get("name", "")).startswith("Stream")}
    return [(e["name"], float(e["dur"]), e.get("args") or {}) for e in events if e.get("ph") == "X" and "dur" in e
            and (e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") or
                 (e.get("pid") in gpu_pids and (not streams or (e["pid"], e.get("tid")) in streams)))]


OP_NAME = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?metadata=\{[^}]*op_name="([^"]+)"')


def hlo_op_names(dump_dir: Path | None) -> dict[str, str]:
    """HLO instruction -> its op_name path (named scopes included), from an XLA dump's optimized HLO
    (XLA_FLAGS=--xla_dump_to=DIR --xla_dump_hlo_as_text); the trace names kernels by instruction only."""
    names = {}
    for path in sorted(dump_dir.glob("*after_optimizations.txt")) if dump_dir else ():
        for line in path.read_text(errors="replace").splitlines():
            m = OP_NAME.match(line)
            if m:
                names.setdefault(m.group(1), m.group(2))
    return names


def with_hlo_dump(xla_flags: str, folder: Path) -> str:
    """XLA_FLAGS plus a text dump of the train step's optimized HLO into `folder` (what `hlo_op_names` reads), unless
    the flags already dump somewhere. Set before JAX starts its backend."""
    if "--xla_dump_to" in xla_flags:
        return xla_flags
    return f"{xla_flags} --xla_dump_to={folder} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*update.*".strip()


def scope_of(args: dict, op_names: dict[str, str]) -> str:
    """The block's named scope a kernel ran under: its HLO op's name path from the dump (or its trace args)."""
    text = op_names.get(str(args.get("hlo_op")), "") or " ".join(str(v) for v in args.values())
    # "/mlp/dot_general" in a scan's body; "jvp(mlp)/dot_general" where the blocks are unrolled
    return next((s for s in SCOPES if re.search(rf"[/(]{s}(?:[/)]|$)", text)), "outside the scopes")


def breakdown(title: str, kernels, wall_s: float, top: int = 12, op_names: dict | None = None) -> dict:
    total = sum(d for _, d, _ in kernels) or 1.0
    by_class, by_name, by_scope, by_op, by_kind = (collections.Counter() for _ in range(5))
    for name, d, args in kernels:
        by_class[kernel_class(name)] += d
        by_name[name] += d
        scope = scope_of(args, op_names or {})
        by_scope[scope] += d
        op = args.get("hlo_op") or args.get("name")
        if op:
            by_op[f"{kernel_class(name)}: {op} {(op_names or {}).get(op, '')}"] += d
            # the op's kind (its name without the instance number): unrolled blocks spread one kind over many ops
            by_kind[f"{kernel_class(name)}: {re.sub(r'[.0-9]+$', '', str(op))} [{scope}]"] += d
    print(f"\n{title}: wall {wall_s * 1e3:.0f} ms, GPU kernel time {total / 1e3:.0f} ms "
          f"({total / 1e6 / wall_s:.0%} of wall), {len(kernels)} kernels")
    for c, d in by_class.most_common():
        print(f"  {c:12s} {d / 1e3:9.1f} ms {d / total:6.1%}")
    print("  top kernels:")
    for name, d in by_name.most_common(top):
        print(f"    {d / total:6.1%} [{kernel_class(name)}] {name[:110]}")
    print("  named scopes: " + ", ".join(f"{s} {d / total:.1%}" for s, d in by_scope.most_common()))
    if by_op:
        print("  top HLO ops:")
        for op, d in by_op.most_common(2 * top):
            print(f"    {d / total:6.1%} {op[:110]}")
        print("  top HLO op kinds:")
        for kind, d in by_kind.most_common(2 * top):
            print(f"    {d / total:6.1%} {kind[:110]}")
    return {"wall_ms": wall_s * 1e3, "kernel_ms": total / 1e3,
            "classes": {c: d / 1e3 for c, d in by_class.items()},
            "scopes": {s: d / 1e3 for s, d in by_scope.items()},
            "top": [(n, d / 1e3) for n, d in by_name.most_common(top)],
            "top_ops": [(n, d / 1e3) for n, d in by_op.most_common(4 * top)],
            "top_op_kinds": [(n, d / 1e3) for n, d in by_kind.most_common(4 * top)]}


def xplane_kernels(trace_dir: Path) -> list[tuple[str, float, dict]]:
    """(name, microseconds, stats) of every GPU kernel in the newest jax.profiler trace under `trace_dir`, read from
    its *.xplane.pb: the JSON trace the profiler also writes is capped in events, and a step with an in-process
    torch rollout overflows it (an earlier run's JSON held only the rollout's kernels). Stream lines only: the
    "XLA Ops"/"XLA Modules" lines repeat the kernels, and name their HLO op's path (named scopes) in `tf_op`."""
    from jax.profiler import ProfileData

    paths = sorted(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not paths:
        raise SystemExit(f"no *.xplane.pb under {trace_dir}: run with --config.profile.num_steps=1 first")
    out = []
    for plane in ProfileData.from_file(str(paths[-1])).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if line.name.startswith("Stream"):
                out += [(e.name, e.duration_ns / 1e3, dict(e.stats)) for e in line.events]
    return out
