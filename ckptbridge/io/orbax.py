"""Orbax checkpoints, written tensor by tensor and read leaf by leaf.

This is the one module that knows Orbax's extension points. Writing uses Orbax's own
PyTree handler with a registered type handler for :class:`LazyArray` leaves: each leaf is
produced (read + rearranged) only when Orbax serializes it, written, and dropped, so peak
memory is about one tensor. The leaves are recorded as ``np.ndarray``, so a plain
``StandardCheckpointer().restore(path)`` returns ordinary arrays. Reading opens the arrays with
TensorStore directly, the way Orbax's handlers do, when ``_METADATA`` describes a checkpoint of
arrays in OCDBT or zarr directories (what Orbax and Tunix write); anything else is restored
through Orbax, a few leaves at a time with ``partial_restore``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ckptbridge.errors import CorruptFileError, InputNotFoundError
from ckptbridge.io import storage
from ckptbridge.metadata import KEY as METADATA_KEY
from ckptbridge.metadata import Metadata

log = logging.getLogger(__name__)

Path = tuple[str, ...]


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
        ckptr.save(storage.absolute(path), args=ocp.args.PyTreeSave(tree), custom_metadata=custom_metadata or {})


def save_manager_step(root: str, step: int, tree: Mapping[str, Any], custom_metadata: dict | None = None,
                      item: str = "model_params") -> str:
    """Write ``root/<step>/<item>`` the way ``tunix.sft.checkpoint_manager.CheckpointManager`` does
    (an Orbax CheckpointManager with a PyTree item), with ``custom_metadata`` on the step."""
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(storage.absolute(root), item_handlers={item: _handler()}, options=options) as mngr:
        mngr.save(step, args=ocp.args.Composite(**{item: ocp.args.PyTreeSave(tree)}),
                  custom_metadata=custom_metadata or {}, force=True)
        mngr.wait_until_finished()
    return storage.join(root, str(step), item)


def _looks_like_checkpoint(path: str) -> bool:
    """``_METADATA`` is there: Orbax writes it once every array is written (on disk into a
    temporary directory renamed at the end; on Cloud Storage in place, then its commit file), and
    ckptbridge copies it last into a Cloud Storage destination."""
    return storage.isfile(storage.join(path, "_METADATA")) and ".orbax-checkpoint-tmp" not in storage.basename(path)


def resolve_checkpoint(path: str, step: int | None = None, item: str = "model_params") -> str:
    """Find the Orbax item directory in ``path`` (a local directory or ``gs://``): the path itself,
    ``path/<item>``, or, for a checkpoint-manager root, ``path/<step>/<item>`` (latest step by
    default)."""
    if not storage.exists(path):
        raise InputNotFoundError(f"{path}: no such directory")
    if not storage.isdir(path):
        raise InputNotFoundError(f"{path}: not a directory; give an Orbax checkpoint directory")
    if step is None and _looks_like_checkpoint(path):
        return storage.absolute(path) if storage.is_remote(path) else path
    if step is None and _looks_like_checkpoint(storage.join(path, item)):
        return storage.join(path, item)
    steps = sorted(int(n) for n in storage.listdir(path) if n.isdigit() and storage.isdir(storage.join(path, n)))
    if step is not None:
        if step not in steps:
            raise InputNotFoundError(
                f"{path}: no step {step}; steps present: {steps or 'none'}"
            )
        steps = [step]
    for s in reversed(steps):
        for candidate in (storage.join(path, str(s), item), storage.join(path, str(s))):
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


def _read_json(path: str):
    try:
        return json.loads(storage.read_bytes(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def step_custom_metadata(path: str) -> dict:
    """``custom_metadata`` of the ``_CHECKPOINT_METADATA`` JSON that Orbax writes into a checkpoint
    or checkpoint-manager step directory (``save(..., custom_metadata=...)``); {} when absent or damaged."""
    meta = _read_json(storage.join(path, "_CHECKPOINT_METADATA"))
    custom = meta.get("custom_metadata") if isinstance(meta, dict) else None
    return dict(custom) if isinstance(custom, dict) else {}


ARRAY_VALUE_TYPES = ("np.ndarray", "jax.Array")


class _TensorstoreLeaves:
    """Leaves of an Orbax PyTree checkpoint read with TensorStore directly, the way Orbax's own
    array handlers open them (``zarr``/``zarr3`` arrays named by their dot-joined key path, in
    the checkpoint's OCDBT database or in one directory each), without importing Orbax or jax:
    that import alone costs more than reading a rank-64 31B adapter. Many reads are in flight
    at once and decoded on TensorStore's threads. Only a checkpoint whose ``_METADATA`` is
    fully understood is read this way; anything else goes through Orbax (``_OrbaxLeaves``)."""

    CONTEXT = {"file_io_concurrency": {"limit": 128}, "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000}}

    def __init__(self, path: str, stores: dict):
        self.path = path
        self._stores = stores
        self.leaves = {p: (tuple(int(s) for s in st.shape), np.dtype(st.dtype.numpy_dtype))
                       for p, st in stores.items()}

    @classmethod
    def open(cls, path: str) -> "_TensorstoreLeaves | None":
        meta = _read_json(storage.join(path, "_METADATA"))
        tree = meta.get("tree_metadata") if isinstance(meta, dict) else None
        if not isinstance(tree, dict) or not tree:
            return None
        names: dict[Path, str] = {}
        for entry in tree.values():
            try:
                keys = tuple(str(k["key"]) for k in entry["key_metadata"])
                value = entry["value_metadata"]
                if value["value_type"] not in ARRAY_VALUE_TYPES or value.get("skip_deserialize") or not keys:
                    return None
            except (KeyError, TypeError):
                return None
            names[keys] = ".".join(keys)
            if "/" in names[keys] or names[keys].startswith("."):  # never a name Orbax writes; not a path to follow
                return None
        ocdbt = meta.get("use_ocdbt") is True
        if ocdbt != storage.isfile(storage.join(path, "manifest.ocdbt")):
            return None
        driver = "zarr3" if meta.get("use_zarr3") is True else "zarr"
        import tensorstore as ts  # imported here: a few hundred ms, only when reading Orbax

        context = ts.Context(cls.CONTEXT)
        base = storage.kvstore(path)

        def spec(name: str) -> dict:
            kv = ({"driver": "ocdbt", "base": base, "path": name, "cache_pool": "cache_pool#ocdbt"} if ocdbt
                  else storage.kvstore(storage.join(path, name)))
            return {"driver": driver, "kvstore": kv, "recheck_cached_data": False,
                    "recheck_cached_metadata": False, "fill_missing_data_reads": False}

        try:
            pending = {p: ts.open(spec(n), open=True, read=True, context=context) for p, n in names.items()}
            stores = {p: f.result() for p, f in pending.items()}
        except Exception as e:  # anything TensorStore cannot open is left to Orbax
            log.debug("%s: reading through Orbax (%s: %s)", path, type(e).__name__, e)
            return None
        return cls(path, stores)

    def start(self, paths: list[Path]) -> Callable[[], dict[Path, np.ndarray]]:
        futures = {p: self._stores[p].read() for p in paths}

        def result() -> dict[Path, np.ndarray]:
            out = {}
            for p, fut in futures.items():
                try:
                    out[p] = fut.result()
                except Exception as e:
                    raise CorruptFileError(
                        f"{self.path}: cannot read {'/'.join(p)} ({type(e).__name__}: {str(e)[:200]}); "
                        "the checkpoint is damaged"
                    ) from None
            return out

        return result

    def close(self) -> None:
        self._stores.clear()


class _OrbaxLeaves:
    """Leaves of any checkpoint Orbax can restore, a few at a time with ``partial_restore``."""

    def __init__(self, path: str):
        self.path = path
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
        self.leaves: dict[Path, tuple[tuple[int, ...], np.dtype]] = {}
        for p, v in _flatten(tree).items():
            shape = getattr(v, "shape", None)
            dtype = getattr(v, "dtype", None)
            if shape is None or dtype is None:
                raise CorruptFileError(f"{path}: leaf {'/'.join(p)} is not an array; not a weights checkpoint")
            self.leaves[p] = (tuple(int(s) for s in shape), np.dtype(dtype))

    def start(self, paths: list[Path]) -> Callable[[], dict[Path, np.ndarray]]:
        return lambda: self._restore(paths)

    def _restore(self, paths: list[Path]) -> dict[Path, np.ndarray]:
        ocp = _ocp()
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
        return {p: np.asarray(flat[p]) for p in paths}

    def close(self) -> None:
        self._ckptr.close()


class OrbaxCheckpoint:
    """Lazy reader of an Orbax PyTree checkpoint: tree metadata, custom metadata, leaves.

    ``reader`` says how leaves are read: ``"tensorstore"`` (directly, see
    :class:`_TensorstoreLeaves`) or ``"orbax"``."""

    def __init__(self, path: str):
        # Orbax resolves relative paths inconsistently (metadata of a relative path reads as None).
        self.path = path = storage.absolute(path)
        if not _looks_like_checkpoint(path):
            raise InputNotFoundError(f"{path}: not an Orbax checkpoint (no _METADATA file)")
        direct = _TensorstoreLeaves.open(path)
        self._impl = direct if direct is not None else _OrbaxLeaves(path)
        self.reader = "tensorstore" if direct is not None else "orbax"
        self.custom_metadata: dict = getattr(self._impl, "custom_metadata", None) or step_custom_metadata(path)
        if not self.custom_metadata:  # an item of a checkpoint-manager step: metadata sits on the step
            self.custom_metadata = step_custom_metadata(storage.dirname(path))
        self.leaves: dict[Path, tuple[tuple[int, ...], np.dtype]] = self._impl.leaves

    @property
    def value_suffix(self) -> tuple[str, ...]:
        """``("value",)`` when every leaf ends in nnx's ``value`` level (a saved nnx State), else ``()``."""
        return ("value",) if self.leaves and all(p[-1] == "value" for p in self.leaves) else ()

    @property
    def ckptbridge_metadata(self) -> dict:
        """The ckptbridge record as stored (a JSON object; {} when absent)."""
        m = self.custom_metadata.get(METADATA_KEY)
        return m if isinstance(m, dict) else {}

    @property
    def metadata(self) -> Metadata:
        """The ckptbridge record, typed."""
        return Metadata.from_json(self.custom_metadata.get(METADATA_KEY))

    def start_read(self, paths: Iterable[Path]) -> Callable[[], dict[Path, np.ndarray]]:
        """Begin reading the given leaves; call the result for them (numpy, stored dtype). With
        the direct reader the bytes are read and decoded in the background meanwhile."""
        paths = list(paths)
        pending = self._impl.start(paths)

        def result() -> dict[Path, np.ndarray]:
            got = pending()
            for p in paths:
                arr, (shape, dtype) = got[p], self.leaves[p]
                if arr.shape != shape or arr.dtype != dtype:
                    raise CorruptFileError(
                        f"{self.path}: leaf {'/'.join(p)} reads as {arr.dtype} {arr.shape}, "
                        f"metadata says {dtype} {shape}"
                    )
            return got

        return result

    def read(self, paths: Iterable[Path]) -> dict[Path, np.ndarray]:
        """Read only the given leaves, as numpy arrays in their stored dtype."""
        return self.start_read(paths)()

    def close(self) -> None:
        self._impl.close()

    def __enter__(self) -> "OrbaxCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
