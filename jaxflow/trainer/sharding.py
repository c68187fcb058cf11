"""Device mesh and logical-axis rules: the only module that knows the mesh axis names.

Three layers (docs/design.md §4): the physical mesh ("data", "fsdp", "tensor"; one size may be -1 to take the
remaining devices), a rule table from logical names to mesh axes (config, not code), and the `logical_axes`
metadata the model puts on every variable. Stacked (scanned) block params carry one leading layer axis that their
`logical_axes` does not name: it is always replicated. A dimension whose size is not divisible by the product of
its mesh axes is replicated instead (logged once per case), as is a mesh axis already used by an earlier dim.
The batch axis has the logical name "batch".
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = "batch"
# Pure data parallelism: the batch over every device, the frozen base and the LoRA params replicated.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = ((BATCH, ("data", "fsdp")),)
# FSDP of the (frozen) base on the model width; add ("mlp", "tensor") / ("heads", "tensor") for tensor parallelism.
FSDP_RULES = DEFAULT_RULES + (("embed", "fsdp"),)

_warned: set = set()


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """Mesh axis sizes (at most one -1 = the remaining devices) and (logical name, mesh axes) rules."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: tuple = DEFAULT_RULES

    def mesh_shape(self, num_devices: int) -> tuple[int, ...]:
        sizes = [self.data, self.fsdp, self.tensor]
        if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes))}: each must be >= 1, at most one -1")
        known = math.prod(s for s in sizes if s != -1)
        if -1 in sizes:
            if num_devices % known:
                raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes))} cannot fill {num_devices} devices")
            sizes[sizes.index(-1)] = num_devices // known
        if math.prod(sizes) != num_devices:
            raise ValueError(f"mesh {dict(zip(MESH_AXES, sizes))} has {math.prod(sizes)} devices, "
                             f"but {num_devices} are available")
        return tuple(sizes)


def make_mesh(config: ShardingConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The (data, fsdp, tensor) mesh over `devices` (default: all), with Auto (GSPMD-propagated) axes."""
    devices = list(jax.devices() if devices is None else devices)
    shape = config.mesh_shape(len(devices))
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES), devices=devices)


def _as_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """A mesh plus logical-axis rules; turns logical axes into shardings for params, states and batches."""

    mesh: Mesh
    rules: tuple = DEFAULT_RULES

    def __post_init__(self):
        table = {}
        for name, axes in self.rules:
            unknown = set(_as_tuple(axes)) - set(self.mesh.axis_names)
            if unknown:
                raise ValueError(f"rule ({name!r}, {axes!r}) names mesh axes {sorted(unknown)} not in "
                                 f"{self.mesh.axis_names}")
            table.setdefault(name, _as_tuple(axes))  # the first rule for a name wins
        object.__setattr__(self, "_table", table)

    @classmethod
    def create(cls, config: ShardingConfig, devices: Sequence[jax.Device] | None = None) -> "Layout":
        return cls(make_mesh(config, devices), tuple(config.rules))

    def spec(self, logical_axes: Sequence[str | None] | None, shape: Sequence[int]) -> P:
        """PartitionSpec for an array of `shape`; unnamed leading dims (the stacked layer axis) are replicated."""
        logical_axes = tuple(logical_axes or ())
        if len(logical_axes) > len(shape):
            raise ValueError(f"logical axes {logical_axes} have more entries than shape {tuple(shape)}")
        names = (None,) * (len(shape) - len(logical_axes)) + logical_axes
        used, out = set(), []
        for name, dim in zip(names, shape):
            axes = tuple(a for a in self._table.get(name, ()) if self.mesh.shape[a] > 1)
            size = math.prod(self.mesh.shape[a] for a in axes)
            if used & set(axes) or (axes and dim % size):
                _warn_once(name, dim, axes, size, used)
                axes = ()
            used.update(axes)
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*out)

    def sharding(self, logical_axes, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical_axes, shape))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """Mesh axes (of size > 1) the batch rule shards the leading axis of per-sample arrays over."""
        return tuple(a for a in self._table.get(BATCH, ()) if self.mesh.shape[a] > 1)

    @property
    def batch_devices(self) -> int:
        """How many ways the batch is split: a global batch must be a multiple of it."""
        return math.prod(self.mesh.shape[a] for a in self.batch_axes)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Leading axis over `batch_axes`, the rest replicated: a valid sharding for any per-sample array."""
        axes = self.batch_axes
        return NamedSharding(self.mesh, P(axes if len(axes) > 1 else axes[0] if axes else None))

    def tree_shardings(self, tree):
        """Same tree with each nnx.Variable's value replaced by its sharding (from its `logical_axes`
        metadata and shape; a tuple of per-block arrays gets a tuple of shardings); other leaves (step counters,
        plain arrays) are replicated."""

        def one(x):
            if not isinstance(x, nnx.Variable):
                return self.replicated
            axes, value = x.get_metadata().get("logical_axes"), x.get_value()
            if isinstance(value, tuple):
                return x.replace(tuple(self.sharding(axes, piece.shape) for piece in value))
            return x.replace(self.sharding(axes, value.shape))

        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def sharding_fn(self, path: tuple[str, ...], logical_axes, shape) -> NamedSharding:
        """For a family's loader, e.g. `build_from_source(..., sharding=layout.sharding_fn)`."""
        del path
        return self.sharding(logical_axes, shape)

    def put_batch(self, batch: dict) -> dict:
        """Place a dict of per-sample host arrays (leading batch axis) on the mesh. Multi-host: each process
        passes its own rows and the global batch is their concatenation in process order."""

        def put(x):
            x = np.asarray(x)
            if not x.ndim:
                return jax.make_array_from_process_local_data(self.replicated, x, ())
            shape = (x.shape[0] * jax.process_count(),) + x.shape[1:]
            if shape[0] % self.batch_devices:
                raise ValueError(f"global batch {shape[0]} is not a multiple of the {self.batch_devices} "
                                 f"batch devices (mesh axes {self.batch_axes})")
            return jax.make_array_from_process_local_data(self.batch_sharding, x, shape)

        return {k: put(v) for k, v in batch.items()}


def _warn_once(name, dim, axes, size, used) -> None:
    key = (name, dim, axes)
    if key in _warned:
        return
    _warned.add(key)
    why = f"mesh axes {axes} already used by another dim" if used & set(axes) else \
        f"size {dim} is not divisible by mesh axes {axes} of size {size}"
    log.warning("logical axis %r: %s; replicating this dim", name, why)


def maybe_initialize_distributed() -> bool:
    """Start jax.distributed when the environment describes a multi-process job; True if it is running.

    Triggers: JAX_COORDINATOR_ADDRESS (with JAX_NUM_PROCESSES and JAX_PROCESS_ID), or a SLURM / Open MPI job
    with more than one task (JAX auto-detects the rest). Call it before any other JAX call; never at import.
    """
    if jax.distributed.is_initialized():
        return True
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]) if "JAX_NUM_PROCESSES" in env else None,
            process_id=int(env["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in env else None)
        return True
    if int(env.get("SLURM_NTASKS", "1")) > 1 or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        jax.distributed.initialize()
        return True
    return False
