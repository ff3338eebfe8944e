"""Orbax checkpoints, written tensor by tensor and read leaf by leaf.

This is the one module that knows Orbax's extension points. Writing uses Orbax's own
PyTree handler with a registered type handler for :class:`LazyArray` leaves, recorded as
``np.ndarray``, so a plain ``StandardCheckpointer().restore(path)`` returns ordinary arrays.
Two writers, chosen once per process by :func:`orbax_writer`:

* ``streaming``: a subclass of Orbax's ``NumpyHandler`` that overrides two of its private
  steps (``_background_serialize``, ``_open_and_write``), so that each leaf is produced (read +
  rearranged) only when Orbax writes it, in row blocks stored as chunks of their own, on the
  workers of a :class:`~ckptbridge.stream.Engine` within its memory budget. Used where those
  steps have the signatures it was written against (:data:`PRIVATE_CONTRACT`; each of
  orbax-checkpoint 0.12.0 to 0.12.8 tested with scripts/orbax_versions.sh: same contract,
  outputs identical to the pinned environment's).
* ``public``: Orbax's ``NumpyHandler`` as it is, through its public interface only. Each leaf
  is produced into a memory-mapped scratch file beside the output and handed to Orbax as an
  array; slower (every byte is written twice) but independent of Orbax's internals. Used when
  the contract does not hold, or with ``CKPTBRIDGE_ORBAX_WRITER=public``.

Both give the same arrays (tests/test_orbax_contract.py). Reading opens the arrays with
TensorStore directly, the way Orbax's handlers do, when ``_METADATA`` describes a checkpoint of
arrays in OCDBT or zarr directories (what Orbax and Tunix write); anything else is restored
through Orbax, a few leaves at a time with ``partial_restore`` (tests/test_orbax_reader.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ckptbridge import deps
from ckptbridge.errors import CkptBridgeError, ConfigError, CorruptFileError, InputNotFoundError
from ckptbridge.io import storage
from ckptbridge.io.files import read_json_object
from ckptbridge.metadata import KEY as METADATA_KEY
from ckptbridge.metadata import Metadata
from ckptbridge.stream import Engine, Stream

log = logging.getLogger(__name__)

Path = tuple[str, ...]


Region = tuple[slice, ...]


class LazyArray:
    """A checkpoint leaf whose values are computed only when Orbax writes it.

    Either whole (``produce``) or, with ``pieces`` and ``chunks``, box by box: ``pieces`` is a
    list of ``(region, make)`` covering the array, each region a whole chunk of shape ``chunks``
    (the last ones cut by the array's edge) and ``make()`` its values. Pieces are made on the
    workers of a :class:`~ckptbridge.stream.Engine` ahead of the writer, within its memory
    budget, each counted as ``held`` times its bytes (what it holds at its peak: with TensorStore's
    encoded copy of it, 2), the first as ``first_held`` bytes where given (a first piece that
    computes what the others are cut from). ``on_written(nbytes)`` is called as bytes are stored."""

    def __init__(self, shape: Iterable[int], dtype, produce: Callable[[], np.ndarray] | None = None,
                 on_written: Callable[[int], None] | None = None, *,
                 chunks: tuple[int, ...] | None = None,
                 pieces: Sequence[tuple[Region, Callable[[], np.ndarray]]] | None = None, held: int = 1,
                 first_held: int | None = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.on_written = on_written
        self.held = held
        self.first_held = first_held
        self.chunks = tuple(int(c) for c in chunks) if chunks is not None else None
        if (produce is None) == (pieces is None) or (pieces is None) != (chunks is None):
            raise ValueError("a LazyArray needs produce, or pieces with chunks")
        self.pieces: Sequence[tuple[Region, Callable[[], np.ndarray]]] = (
            pieces if pieces is not None else [((), produce)])  # type: ignore[list-item]  # produce is set

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def region_shape(self, region: Region) -> tuple[int, ...]:
        """The shape of the box ``region`` (``()``: the whole array)."""
        if not region:
            return self.shape
        return tuple(len(range(*r.indices(n))) for r, n in zip(region, self.shape))

    def region_bytes(self, region: Region) -> int:
        return math.prod(self.region_shape(region)) * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of the largest piece produced at once."""
        return math.prod(self.chunks) * self.dtype.itemsize if self.chunks is not None else self.nbytes

    def __deepcopy__(self, memo) -> LazyArray:
        # A recipe, not data: Orbax before 0.12.5 deep-copies every value it is handed.
        return self

    def jobs(self) -> Iterator[tuple[int, Callable[[], np.ndarray]]]:
        """``(bytes held, make)`` of each piece, in order, for a stream."""
        for n, (region, make) in enumerate(self.pieces):
            held = self.held * self.region_bytes(region)
            yield (max(held, self.first_held) if n == 0 and self.first_held is not None else held), make

    def checked(self, region: Region, arr) -> np.ndarray:
        """``arr`` as the contiguous values of ``region``, or a ValueError naming the mismatch."""
        return _checked("leaf", self.region_shape(region), self.dtype, np.ascontiguousarray(arr).reshape(np.shape(arr)))

    def produce_into(self, out: np.ndarray, engine: Engine) -> None:
        """Write every value into ``out`` (an array of this shape and dtype), piece by piece."""
        for (region, _), arr in zip(self.pieces, engine.stream(self.jobs())):
            out[region] = self.checked(region, arr)


def _ocp():
    return deps.load("orbax.checkpoint", "orbax")  # imported lazily: it pulls in jax


# The private steps of orbax's NumpyHandler that the streaming writer overrides, with the
# parameters it calls them with: its _background_serialize builds each leaf's write spec from
# the value's shape and dtype and awaits self._open_and_write(value, tspec, ts_context).
# Unchanged in orbax-checkpoint 0.12.0 to 0.12.8 (tests/test_orbax_contract.py).
PRIVATE_CONTRACT = {
    "_background_serialize": ("self", "values", "infos", "args"),
    "_open_and_write": ("self", "value", "tspec", "ts_context"),
}
WRITERS = ("streaming", "public")


def private_contract_holds(handler_cls) -> bool:
    """Whether ``handler_cls`` (orbax's NumpyHandler) has the private steps of
    :data:`PRIVATE_CONTRACT` as coroutines with those parameters."""
    for name, params in PRIVATE_CONTRACT.items():
        fn = getattr(handler_cls, name, None)
        if fn is None or not inspect.iscoroutinefunction(fn):
            return False
        try:
            if tuple(inspect.signature(fn).parameters) != params:
                return False
        except (TypeError, ValueError):
            return False
    return True


def orbax_writer() -> str:
    """``"streaming"`` or ``"public"`` (see the module's docstring): ``CKPTBRIDGE_ORBAX_WRITER``
    if set, else streaming where the installed Orbax keeps :data:`PRIVATE_CONTRACT`."""
    forced = os.environ.get("CKPTBRIDGE_ORBAX_WRITER", "").strip().lower()
    if forced:
        if forced not in WRITERS:
            raise ConfigError(f"CKPTBRIDGE_ORBAX_WRITER={forced!r}: choose one of {', '.join(WRITERS)}")
        return forced
    if private_contract_holds(_ocp().type_handlers.NumpyHandler):
        return "streaming"
    log.info("orbax-checkpoint %s: NumpyHandler's private steps differ from those the streaming writer was "
             "written for; writing through Orbax's public interface (slower)",
             deps.installed_version("orbax-checkpoint"))
    return "public"


def _lazy_handler(engine: Engine):
    ocp = _ocp()
    numpy_handler = ocp.type_handlers.NumpyHandler
    # orbax-checkpoint >= 0.12.5 copies host arrays unless told not to; before, LazyArray's
    # __deepcopy__ makes the copy free.
    options = ({"deepcopy_host_arrays": False}
               if "deepcopy_host_arrays" in inspect.signature(numpy_handler.__init__).parameters else {})

    class LazyArrayHandler(numpy_handler):  # type: ignore[valid-type, misc]  # Orbax's class, found at run time
        """Writes LazyArray leaves in turn (whole, or piece by piece into chunks of their block
        shape), recorded as plain numpy arrays. The pieces of every leaf, in write order, are
        one stream of ``engine``: made on its workers ahead of the writer, handed to TensorStore
        (which encodes and stores them on its own threads) without waiting for each to be
        stored, and counted against the engine's memory budget until they are."""

        def __init__(self, engine: Engine):
            super().__init__(**options)
            self._engine = engine
            self._pending: deque = deque()  # (write future, release, bytes, leaf)
            self._stream: Stream | None = None

        async def _background_serialize(self, values, infos, args=None):
            args = args or [None] * len(values)
            lazy = [v for v in values if isinstance(v, LazyArray)]
            self._stream = self._engine.stream(job for v in lazy for job in v.jobs())
            try:
                for value, info, arg in zip(values, infos, args):
                    # the parent builds the spec from shape and dtype alone and calls _open_and_write
                    await super()._background_serialize([value], [info], [arg or ocp.SaveArgs()])
                while self._pending:
                    await self._retire()
            finally:
                self._stream.close()
                while self._pending:  # after an error: the bytes of writes never awaited
                    self._pending.popleft()[1]()

        async def _retire(self) -> None:
            future, release, nbytes, value = self._pending[0]
            await future
            self._pending.popleft()
            release()
            if self._stream is not None:
                self._stream.prefetch()
            if value.on_written is not None:
                value.on_written(nbytes)

        async def _open_and_write(self, value, tspec, ts_context):
            if not isinstance(value, LazyArray):
                return await super()._open_and_write(value, tspec, ts_context)
            import tensorstore as ts

            if self._stream is None:
                raise RuntimeError("LazyArrayHandler: values written outside serialize")
            spec = _with_chunks(tspec, value.chunks) if value.chunks is not None else tspec
            store = await ts.open(ts.Spec(spec), create=True, open=True, context=ts_context)
            for region, _ in value.pieces:
                # stored writes give their bytes back to the budget, so the next pieces can start
                while self._pending and (self._pending[0][0].done() or not self._stream.started()):
                    await self._retire()
                arr = value.checked(region, next(self._stream))
                release = self._stream.hand_over()
                target = store[region] if region else store
                self._pending.append((target.write(arr, can_reference_source_data_indefinitely=True),
                                      release, arr.nbytes, value))
                del arr

    return LazyArrayHandler(engine)


def _checked(name: str, shape: tuple, dtype, arr: np.ndarray) -> np.ndarray:
    if arr.shape != tuple(shape) or arr.dtype != dtype:
        raise ValueError(f"leaf {name}: produced {arr.dtype} {arr.shape}, planned {dtype} {tuple(shape)}")
    return arr


def _with_chunks(tspec: dict, chunks: tuple[int, ...]) -> dict:
    """Orbax's write spec with the chunk shape ``chunks`` (zarr or zarr3, under a cast if any).
    A spec of another shape is left as it is: the blocks are then written into Orbax's own
    chunks, the same bytes with more memory (tests/test_orbax_contract.py checks the chunks)."""
    import copy

    new = copy.deepcopy(tspec)
    try:
        spec = new["base"] if new.get("driver") == "cast" else new
        meta = spec["metadata"]
        if spec["driver"] == "zarr3":
            meta["chunk_grid"]["configuration"]["chunk_shape"] = list(chunks)
            for codec in meta.get("codecs", []):
                if codec.get("name") == "sharding_indexed":
                    codec["configuration"]["chunk_shape"] = list(chunks)
        elif spec["driver"] == "zarr":
            meta["chunks"] = list(chunks)
        else:
            return tspec
    except (KeyError, TypeError, AttributeError):
        log.debug("orbax write spec not understood; keeping its chunks: %s", tspec)
        return tspec
    return new


def _registry(engine: Engine):
    ocp = _ocp()
    import jax

    return ocp.type_handlers.create_type_handler_registry(
        (LazyArray, _lazy_handler(engine)),
        (np.ndarray, ocp.type_handlers.NumpyHandler()),
        (jax.Array, ocp.type_handlers.ArrayHandler()),
    )


def _handler(engine: Engine, compression: bool = True, writer: str = "streaming"):
    ocp = _ocp()
    if writer == "public":
        return ocp.PyTreeCheckpointHandler(save_concurrent_gb=1, use_compression=compression)
    return ocp.PyTreeCheckpointHandler(type_handler_registry=_registry(engine), save_concurrent_gb=1,
                                       use_compression=compression)


class _ScratchArray(np.memmap):
    """A leaf produced into a scratch file for the public writer: Orbax before 0.12.5
    deep-copies the arrays it is handed, which for these would read the file into memory."""

    def __deepcopy__(self, memo) -> _ScratchArray:
        return self


def _produced(tree: Mapping[str, Any], scratch: str, engine: Engine) -> tuple[dict, dict]:
    """The public writer's input: every :class:`LazyArray` of ``tree`` produced into a
    memory-mapped file under ``scratch`` (page cache, not process memory), and the SaveArgs
    that give a leaf produced in blocks chunks of about a block."""
    ocp = _ocp()
    flat, save_args = {}, {}
    for i, (path, leaf) in enumerate(_flatten(tree).items()):
        if isinstance(leaf, LazyArray):
            arr = _ScratchArray(os.path.join(scratch, str(i)), dtype=leaf.dtype, mode="w+", shape=leaf.shape)
            leaf.produce_into(arr, engine)
            arr.flush()  # clean pages: the kernel may drop them
            if leaf.on_written is not None:
                leaf.on_written(leaf.nbytes)
            flat[path] = arr
            save_args[path] = ocp.SaveArgs(chunk_byte_size=leaf.block_bytes if leaf.chunks else None)
        else:
            flat[path] = leaf
            save_args[path] = ocp.SaveArgs()
    return nest(flat), nest(save_args)


class _Writer:
    """Save args for one checkpoint: the streaming writer hands the tree to Orbax as it is; the
    public one first produces it into a scratch directory beside ``path``, removed at the end."""

    def __init__(self, path: str, tree: Mapping[str, Any], engine: Engine):
        self.kind = orbax_writer()
        self.path, self.tree, self.engine = path, tree, engine
        self.scratch: str | None = None

    def __enter__(self) -> _Writer:
        return self

    def args(self):
        ocp = _ocp()
        if self.kind == "streaming":
            return ocp.args.PyTreeSave(self.tree)
        parent = None if storage.is_remote(self.path) else os.path.dirname(os.path.abspath(self.path))
        self.scratch = tempfile.mkdtemp(prefix=".ckptbridge-scratch-", dir=parent)
        item, save_args = _produced(self.tree, self.scratch, self.engine)
        return ocp.args.PyTreeSave(item, save_args=save_args)

    def __exit__(self, *exc) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def save_tree(path: str, tree: Mapping[str, Any], custom_metadata: dict | None = None, *,
              compression: bool = True, engine: Engine | None = None) -> str:
    """Write a nested dict of :class:`LazyArray` / numpy leaves as an Orbax checkpoint at ``path``
    (zstd-compressed chunks, as Orbax writes by default, unless ``compression`` is False), the
    pieces made on ``engine``'s workers within its memory budget (default: an engine of every
    usable core and the default budget). Returns the writer used (:func:`orbax_writer`)."""
    ocp = _ocp()
    with _engine(engine) as eng, _Writer(path, tree, eng) as w, \
            ocp.Checkpointer(_handler(eng, compression, w.kind)) as ckptr:
        ckptr.save(storage.absolute(path), args=w.args(), custom_metadata=custom_metadata or {})
    return w.kind


def save_manager_step(root: str, step: int, tree: Mapping[str, Any], custom_metadata: dict | None = None,
                      item: str = "model_params", *, compression: bool = True, engine: Engine | None = None) -> str:
    """Write ``root/<step>/<item>`` the way ``tunix.sft.checkpoint_manager.CheckpointManager`` does
    (an Orbax CheckpointManager with a PyTree item), with ``custom_metadata`` on the step
    (``compression``: as in :func:`save_tree`)."""
    ocp = _ocp()
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with _engine(engine) as eng, _Writer(root, tree, eng) as w, ocp.CheckpointManager(
            storage.absolute(root), item_handlers={item: _handler(eng, compression, w.kind)}, options=options) as mngr:
        mngr.save(step, args=ocp.args.Composite(**{item: w.args()}), custom_metadata=custom_metadata or {}, force=True)
        mngr.wait_until_finished()
    return storage.join(root, str(step), item)


@contextlib.contextmanager
def _engine(engine: Engine | None) -> Iterator[Engine]:
    """``engine``, or a default one for the duration."""
    if engine is not None:
        yield engine
        return
    with Engine(name="orbax-write") as own:
        yield own


def _looks_like_checkpoint(path: str) -> bool:
    """``_METADATA`` is there: Orbax writes it once every array is written (on disk into a
    temporary directory renamed at the end; on Cloud Storage in place, then its commit file), and
    ckptbridge copies it last into a Cloud Storage destination."""
    return storage.isfile(storage.join(path, "_METADATA")) and ".orbax-checkpoint-tmp" not in storage.basename(path)


def resolve_checkpoint(path: str, step: int | None = None, item: str = "model_params") -> str:
    """Find the Orbax item directory in ``path`` (a local directory or ``gs://``): the path itself,
    ``path/<item>``, or, for a checkpoint-manager root, ``path/<step>/<item>`` (latest step by
    default)."""
    deps.require("orbax")
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


def _read_json(path: str) -> dict | None:
    """The JSON object in ``path`` (local or remote), None when it is missing or not one."""
    try:
        return read_json_object(path, "", read=storage.read_bytes)
    except (CkptBridgeError, OSError):
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
    def open(cls, path: str) -> _TensorstoreLeaves | None:
        meta = _read_json(storage.join(path, "_METADATA")) or {}
        tree = meta.get("tree_metadata")
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
        ts = deps.load("tensorstore", "orbax")  # imported here: a few hundred ms, only when reading Orbax

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

    def chunks(self, path: Path) -> tuple[int, ...] | None:
        return tuple(int(c) for c in self._stores[path].chunk_layout.read_chunk.shape)

    def start(self, paths: list[Path], region: tuple[slice, ...] | None = None) -> Callable[[], dict[Path, np.ndarray]]:
        futures = {p: (self._stores[p][region] if region is not None else self._stores[p]).read() for p in paths}

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
        self._lock = threading.Lock()  # one restore at a time: a checkpointer is not documented as thread-safe
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

    def chunks(self, path: Path) -> None:
        return None  # read whole leaves only

    def start(self, paths: list[Path], region: tuple[slice, ...] | None = None) -> Callable[[], dict[Path, np.ndarray]]:
        if region is not None:
            raise ValueError("regions are read with the direct reader only")
        return lambda: self._restore(paths)

    def _restore(self, paths: list[Path]) -> dict[Path, np.ndarray]:
        ocp = _ocp()
        item = nest({p: np.zeros(0) for p in paths})
        restore_args = nest({p: ocp.RestoreArgs(restore_type=np.ndarray) for p in paths})
        try:
            with self._lock:
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
        deps.require("orbax")
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

    def chunks(self, path: Path) -> tuple[int, ...] | None:
        """The stored chunk shape of leaf ``path``, when boxes of it can be read on their own
        (:meth:`start_read` with ``region``); None when only whole leaves can."""
        return self._impl.chunks(path)

    def start_read(self, paths: Iterable[Path], region: tuple[slice, ...] | None = None
                   ) -> Callable[[], dict[Path, np.ndarray]]:
        """Begin reading the given leaves (or the box ``region`` of each, where :meth:`chunks`
        allows); call the result for them (numpy, stored dtype). With the direct reader the
        bytes are read and decoded in the background meanwhile."""
        paths = list(paths)
        pending = self._impl.start(paths, region)

        def result() -> dict[Path, np.ndarray]:
            got = pending()
            for p in paths:
                arr, (shape, dtype) = got[p], self.leaves[p]
                if region is not None:
                    shape = tuple(len(range(*r.indices(n))) for r, n in zip(region, shape))
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

    def __enter__(self) -> OrbaxCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
