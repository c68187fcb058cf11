"""Orbax checkpoints of the train state + run metadata, and the final PEFT export."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp


def _flat(tree) -> tuple[dict[str, jax.Array], list[str]]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {f"{i:05d}": v for i, (_, v) in enumerate(leaves)}, [jax.tree_util.keystr(p) for p, _ in leaves]


class Checkpointer:
    """Saves {state leaves, metadata json} under `directory/<step>`; keeps the last `keep`.

    Saves are synchronous and orbax writes each one into a temporary folder renamed on completion, so a process
    killed mid-save leaves the previous checkpoints readable.
    """

    def __init__(self, directory: str | Path, keep: int):
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self.directory = Path(directory).resolve()
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state, meta: dict) -> None:
        arrays, paths = _flat(state)
        args = ocp.args.Composite(state=ocp.args.StandardSave(arrays),
                                  meta=ocp.args.JsonSave({**meta, "state_paths": paths}))
        self.manager.save(step, args=args, force=True)
        self.manager.wait_until_finished()

    def restore(self, abstract_state, step: int | None = None):
        """(state, meta) of `step` (default: the latest); the state comes back with `abstract_state`'s shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}: start without --resume")
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        target, paths = _flat(abstract_state)
        if meta["state_paths"] != paths:
            raise ValueError(f"checkpoint {self.directory}/{step} was written for a different train state "
                             f"(LoRA targets/rank, EMA or optimizer changed): {len(meta['state_paths'])} leaves "
                             f"saved, {len(paths)} expected")
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=getattr(v, "sharding", None))
                    for k, v in target.items()}
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))
        leaves = [restored["state"][k] for k in sorted(restored["state"])]
        return jax.tree.unflatten(jax.tree.structure(abstract_state), leaves), meta


def config_json(cfg) -> str:
    """The config as JSON (tuples become lists), stored with every checkpoint."""
    return json.dumps(cfg.to_dict(), default=lambda o: list(o) if isinstance(o, tuple) else str(o), sort_keys=True)


def assert_finite(tree) -> None:
    bad = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]
           if not np.all(np.isfinite(np.asarray(v)))]
    if bad:
        raise ValueError(f"non-finite values in {bad[:5]}")
