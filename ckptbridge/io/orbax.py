"""Orbax checkpoints, written tensor by tensor and read leaf by leaf.

This is the one module that knows Orbax's extension points. Writing uses Orbax's own
PyTree handler with a registered type handler for :class:`LazyArray` leaves: each leaf is
produced (read + rearranged) only when Orbax serializes it, written, and dropped, so peak
memory is about one tensor. The leaves are recorded as ``np.ndarray``, so a plain
``StandardCheckpointer().restore(path)`` returns ordinary arrays. Reading restores a few
leaves at a time with ``partial_restore``.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ckptbridge.errors import CorruptFileError, InputNotFoundError

log = logging.getLogger(__name__)

Path = tuple[str, ...]
METADATA_KEY = "ckptbridge"
FORMAT_VERSION = 1


class LazyArray:
    """A checkpoint leaf whose values are computed only when Orbax writes it."""

    def __init__(self, shape: Iterable[int], dtype, produce: Callable[[], np.ndarray],
                 on_written: Callable[[], None] | None = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.produce = produce
        self.on_written = on_written

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


def _ocp():
    import orbax.checkpoint as ocp  # imported lazily: it pulls in jax

    return ocp


def _lazy_handler():
    ocp = _ocp()

    class LazyArrayHandler(ocp.type_handlers.NumpyHandler):
        """Writes LazyArray leaves one at a time, recorded as plain numpy arrays."""

        def __init__(self):
            super().__init__(deepcopy_host_arrays=False)

        async def _background_serialize(self, values, infos, args=None):
            args = args or [None] * len(values)
            for value, info, arg in zip(values, infos, args):
                arr = np.ascontiguousarray(value.produce())
                if arr.shape != value.shape or arr.dtype != value.dtype:
                    raise ValueError(
                        f"leaf {info.name}: produced {arr.dtype} {arr.shape}, planned {value.dtype} {value.shape}"
                    )
                await super()._background_serialize([arr], [info], [arg or ocp.SaveArgs()])
                del arr
                if value.on_written is not None:
                    value.on_written()

    return LazyArrayHandler()


def _registry():
    ocp = _ocp()
    import jax

    return ocp.type_handlers.create_type_handler_registry(
        (LazyArray, _lazy_handler()),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, ocp.type_handlers.ArrayHandler()),
    )


def _handler():
    return _ocp().PyTreeCheckpointHandler(type_handler_registry=_registry(), save_concurrent_gb=1)


def save_tree(path: str, tree: Mapping[str, Any], custom_metadata: dict | None = None) -> None:
    """Write a nested dict of :class:`LazyArray` / numpy leaves as an Orbax checkpoint at ``path``."""
    ocp = _ocp()
    with ocp.Checkpointer(_handler()) as ckptr:
        ckptr.save(os.path.abspath(path), args=ocp.args.PyTreeSave(tree), custom_metadata=custom_metadata or {})


def save_manager_step(root: str, step: int, tree: Mapping[str, Any], custom_metadata: dict | None = None,
                      item: str = "model_params") -> str:
    """Write ``root/<step>/<item>`` the way ``tunix.sft.checkpoint_manager.CheckpointManager`` does
    (an Orbax CheckpointManager with a PyTree item), with ``custom_metadata`` on the step."""
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(os.path.abspath(root), item_handlers={item: _handler()}, options=options) as mngr:
        mngr.save(step, args=ocp.args.Composite(**{item: ocp.args.PyTreeSave(tree)}),
                  custom_metadata=custom_metadata or {}, force=True)
        mngr.wait_until_finished()
    return os.path.join(root, str(step), item)


def step_custom_metadata(step_dir: str) -> dict:
    """Custom metadata of a checkpoint-manager step (``CheckpointManager.save(custom_metadata=...)``)."""
    if not os.path.isfile(os.path.join(step_dir, "_CHECKPOINT_METADATA")):
        return {}
    ocp = _ocp()
    try:
        meta = ocp.Checkpointer(ocp.PyTreeCheckpointHandler()).metadata(os.path.abspath(step_dir))
    except Exception:  # the step metadata file is JSON written by Orbax; damaged means none
        return {}
    return dict(getattr(meta, "custom_metadata", None) or {})


def _looks_like_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "_METADATA"))


def resolve_checkpoint(path: str, step: int | None = None, item: str = "model_params") -> str:
    """Find the Orbax item directory in ``path``: the path itself, ``path/<item>``, or, for a
    checkpoint-manager root, ``path/<step>/<item>`` (latest step by default)."""
    if not os.path.exists(path):
        raise InputNotFoundError(f"{path}: no such directory")
    if not os.path.isdir(path):
        raise InputNotFoundError(f"{path}: not a directory; give an Orbax checkpoint directory")
    if step is None and _looks_like_checkpoint(path):
        return path
    if step is None and _looks_like_checkpoint(os.path.join(path, item)):
        return os.path.join(path, item)
    steps = sorted(int(n) for n in os.listdir(path) if n.isdigit() and os.path.isdir(os.path.join(path, n)))
    if step is not None:
        if step not in steps:
            raise InputNotFoundError(
                f"{path}: no step {step}; steps present: {steps or 'none'}"
            )
        steps = [step]
    for s in reversed(steps):
        for candidate in (os.path.join(path, str(s), item), os.path.join(path, str(s))):
            if _looks_like_checkpoint(candidate):
                return candidate
    raise InputNotFoundError(
        f"{path}: not an Orbax checkpoint (no _METADATA here, in {item}/ or in a step directory)"
    )


def _flatten(tree: Any, prefix: Path = ()) -> dict[Path, Any]:
    out: dict[Path, Any] = {}
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            out.update(_flatten(v, prefix + (str(k),)))
    else:
        out[prefix] = tree
    return out


def nest(flat: Mapping[Path, Any]) -> dict:
    root: dict = {}
    for path, value in flat.items():
        node = root
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return root


class OrbaxCheckpoint:
    """Lazy reader of an Orbax PyTree checkpoint: tree metadata, custom metadata, leaves."""

    def __init__(self, path: str):
        # Orbax resolves relative paths inconsistently (metadata of a relative path reads as None).
        self.path = path = os.path.abspath(path)
        if not _looks_like_checkpoint(path):
            raise InputNotFoundError(f"{path}: not an Orbax checkpoint (no _METADATA file)")
        ocp = _ocp()
        self._ckptr = ocp.PyTreeCheckpointer()
        try:
            meta = self._ckptr.metadata(path)
            item_meta = meta.item_metadata
            tree = item_meta.tree if hasattr(item_meta, "tree") else item_meta
            if not isinstance(tree, Mapping):
                raise TypeError(f"tree metadata is {type(tree).__name__}")
        except Exception as e:  # orbax raises many types for damaged metadata
            raise CorruptFileError(
                f"{path}: Orbax metadata cannot be read ({type(e).__name__}: {str(e)[:200]}); the checkpoint is damaged"
            ) from None
        self.custom_metadata: dict = dict(getattr(meta, "custom_metadata", None) or {})
        if not self.custom_metadata:  # an item of a checkpoint-manager step: metadata sits on the step
            self.custom_metadata = step_custom_metadata(os.path.dirname(path))
        self.leaves: dict[Path, tuple[tuple[int, ...], np.dtype]] = {}
        for p, v in _flatten(tree).items():
            shape = getattr(v, "shape", None)
            dtype = getattr(v, "dtype", None)
            if shape is None or dtype is None:
                raise CorruptFileError(f"{path}: leaf {'/'.join(p)} is not an array; not a weights checkpoint")
            self.leaves[p] = (tuple(int(s) for s in shape), np.dtype(dtype))

    @property
    def value_suffix(self) -> tuple[str, ...]:
        """``("value",)`` when every leaf ends in nnx's ``value`` level (a saved nnx State), else ``()``."""
        return ("value",) if self.leaves and all(p[-1] == "value" for p in self.leaves) else ()

    @property
    def ckptbridge_metadata(self) -> dict:
        m = self.custom_metadata.get(METADATA_KEY)
        return m if isinstance(m, dict) else {}

    def read(self, paths: Iterable[Path]) -> dict[Path, np.ndarray]:
        """Restore only the given leaves, as numpy arrays in their stored dtype."""
        ocp = _ocp()
        paths = list(paths)
        item = nest({p: np.zeros(0) for p in paths})
        restore_args = nest({p: ocp.RestoreArgs(restore_type=np.ndarray) for p in paths})
        try:
            out = self._ckptr.restore(
                self.path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
            )
        except Exception as e:
            raise CorruptFileError(
                f"{self.path}: cannot read {'/'.join(paths[0])}"
                f"{' and others' if len(paths) > 1 else ''} ({type(e).__name__}: {str(e)[:200]}); "
                "the checkpoint is damaged"
            ) from None
        flat = _flatten(out)
        result = {}
        for p in paths:
            arr = np.asarray(flat[p])
            shape, dtype = self.leaves[p]
            if arr.shape != shape or arr.dtype != dtype:
                raise CorruptFileError(
                    f"{self.path}: leaf {'/'.join(p)} reads as {arr.dtype} {arr.shape}, metadata says {dtype} {shape}"
                )
            result[p] = arr
        return result

    def close(self) -> None:
        self._ckptr.close()

    def __enter__(self) -> "OrbaxCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def metadata_json(obj: Any) -> Any:
    """Round-trip through JSON so what we store is exactly what will be read back."""
    return json.loads(json.dumps(obj))
