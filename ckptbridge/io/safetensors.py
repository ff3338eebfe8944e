"""Safetensors without torch: a validating lazy reader and a streaming sharded writer.

The format: 8 bytes little-endian header length ``N``, ``N`` bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end of
the header) plus an optional ``"__metadata__"`` string map, then the tensor bytes. Opening a
file reads only its header; each tensor is read when asked for, into memory of its own that
is freed with it (a memory map of the whole file would keep every page read so far resident),
and bf16/fp8 come through ``ml_dtypes`` bit for bit. Every header field is checked before any
byte is trusted.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from ckptbridge.errors import CorruptFileError, InputNotFoundError, MismatchError
from ckptbridge.io.files import close_on_error
from ckptbridge.io.output import FileRange, OutputFile

# safetensors dtype code -> (numpy type name, or ml_dtypes type name, item size)
_TYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2),
    "BF16": ("ml_dtypes.bfloat16", 2), "F8_E4M3": ("ml_dtypes.float8_e4m3fn", 1),
    "F8_E5M2": ("ml_dtypes.float8_e5m2", 1),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U64": ("uint64", 8), "U32": ("uint32", 4), "U16": ("uint16", 2), "U8": ("uint8", 1), "BOOL": ("bool", 1),
}
ITEMSIZE = {code: size for code, (_, size) in _TYPES.items()}


class _Dtypes(Mapping):
    """safetensors dtype code -> numpy dtype; ml_dtypes (about 1 s to import) is imported only
    when a bfloat16/float8 dtype is asked for, so reading headers and float32 files needs none."""

    def __init__(self) -> None:
        self._cache: dict[str, np.dtype] = {}

    def __getitem__(self, code: str) -> np.dtype:
        if code not in self._cache:
            name = _TYPES[code][0]
            if name.startswith("ml_dtypes."):
                import ml_dtypes

                self._cache[code] = np.dtype(getattr(ml_dtypes, name.split(".", 1)[1]))
            else:
                self._cache[code] = np.dtype(name)
        return self._cache[code]

    def __contains__(self, code) -> bool:
        return code in _TYPES

    def __iter__(self):
        return iter(_TYPES)

    def __len__(self) -> int:
        return len(_TYPES)


DTYPES: Mapping[str, np.dtype] = _Dtypes()


def dtype_code(dtype) -> str:
    """numpy/ml_dtypes dtype -> safetensors dtype code (``"BF16"``...)."""
    dtype = np.dtype(dtype)
    for code, (name, _) in _TYPES.items():
        if name.split(".")[-1] == dtype.name and DTYPES[code] == dtype:
            return code
    raise MismatchError(f"dtype {dtype} cannot be stored in safetensors")


MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit


def numpy_dtype(code: str) -> np.dtype:
    return DTYPES[code]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors code
    shape: tuple[int, ...]
    begin: int  # absolute file offsets
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """A validated, memory-mapped safetensors file. Use as a context manager or call close()."""

    def __init__(self, path: str):
        self.path = path
        self._map: mmap.mmap | None = None
        self._lock = threading.Lock()
        if not os.path.isfile(path):
            raise InputNotFoundError(f"{path}: no such file")
        size = os.path.getsize(path)
        with close_on_error(open(path, "rb")) as self._file:
            self.infos, self.metadata = self._read_header(size)

    def _read_header(self, size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
        p = self.path
        fix = "the file is damaged or not safetensors; re-download or re-export it"
        if size < 8:
            raise CorruptFileError(f"{p}: {size} bytes, too short for a safetensors header; {fix}")
        (n,) = struct.unpack("<Q", self._file.read(8))
        if n > MAX_HEADER or 8 + n > size:
            raise CorruptFileError(
                f"{p}: header length {n} runs past the end of the {size}-byte file (truncated?); {fix}"
            )
        raw = self._file.read(n)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise CorruptFileError(f"{p}: header is not valid JSON; {fix}") from None
        if not isinstance(header, dict):
            raise CorruptFileError(f"{p}: header is not a JSON object; {fix}")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise CorruptFileError(f"{p}: __metadata__ must map strings to strings; {fix}")
        base = 8 + n
        infos: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            where = f"{p}: tensor {name!r}"
            if not isinstance(entry, dict):
                raise CorruptFileError(f"{where}: header entry is not an object; {fix}")
            code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
            if code not in DTYPES:
                raise CorruptFileError(f"{where}: unknown dtype {code!r}; {fix}")
            if not isinstance(shape, list) or not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
            ):
                raise CorruptFileError(f"{where}: shape {shape!r} is not a list of sizes; {fix}")
            if (
                not isinstance(offsets, list)
                or len(offsets) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]
            ):
                raise CorruptFileError(f"{where}: data_offsets {offsets!r} are invalid; {fix}")
            code = str(code)
            nbytes = math.prod(shape) * ITEMSIZE[code]
            if offsets[1] - offsets[0] != nbytes:
                raise CorruptFileError(
                    f"{where}: {code} {tuple(shape)} needs {nbytes} bytes but data_offsets span "
                    f"{offsets[1] - offsets[0]}; {fix}"
                )
            if base + offsets[1] > size:
                raise CorruptFileError(
                    f"{where}: data ends at byte {base + offsets[1]} past the end of the {size}-byte "
                    f"file (truncated?); {fix}"
                )
            infos[name] = TensorInfo(name, code, tuple(shape), base + offsets[0], base + offsets[1])
        spans = sorted((i.begin, i.end, i.name) for i in infos.values() if i.end > i.begin)
        for (_, e0, n0), (b1, _, n1) in zip(spans, spans[1:], strict=False):
            if b1 < e0:
                raise CorruptFileError(f"{p}: tensors {n0!r} and {n1!r} overlap in the file; {fix}")
        return infos, meta

    def keys(self) -> list[str]:
        return list(self.infos)

    def __contains__(self, name: str) -> bool:
        return name in self.infos

    def info(self, name: str) -> TensorInfo:
        return self.infos[name]

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name``, read from disk into a new array."""
        i = self.infos[name]
        out = np.empty(i.shape, DTYPES[i.dtype])
        self._read_into(i, out.reshape(-1).view(np.uint8))
        return out

    def mapped(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a read-only array over the file mapped into memory: nothing is copied
        until the array is used, and then its pages come straight from the page cache (a transfer
        to a device reads them there; no fresh host memory is filled first, which on a sandboxed
        TPU VM was most of a base load). The array stays valid after :meth:`close`; the file
        must not be truncated while it is in use."""
        i = self.infos[name]
        if i.nbytes == 0:
            return np.empty(i.shape, DTYPES[i.dtype])
        with self._lock:
            if self._map is None:
                self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            m = self._map
        return np.frombuffer(m, DTYPES[i.dtype], count=math.prod(i.shape), offset=i.begin).reshape(i.shape)

    def rows(self, name: str, start: int, stop: int, *, matrix: bool = False) -> np.ndarray:
        """Rows ``start:stop`` (along the first axis) of tensor ``name``, read from disk; with
        ``matrix``, of the tensor seen as ``(prod(shape[:-1]), shape[-1])``."""
        i = self.infos[name]
        row_shape = i.shape[-1:] if matrix else i.shape[1:]
        n = math.prod(i.shape[:-1]) if matrix else i.shape[0]
        row_bytes = math.prod(row_shape) * DTYPES[i.dtype].itemsize
        stop = min(stop, n)
        out = np.empty((max(stop - start, 0), *row_shape), DTYPES[i.dtype])
        part = TensorInfo(name, i.dtype, out.shape, i.begin + start * row_bytes, i.begin + stop * row_bytes)
        self._read_into(part, out.reshape(-1).view(np.uint8))
        return out

    def byte_range(self, name: str) -> FileRange:
        """Where tensor ``name``'s bytes lie in this file, for :func:`write_file` to copy them
        file to file without reading them into memory."""
        i = self.infos[name]
        return FileRange(self._file.fileno(), i.begin, i.end, self.path, name)

    def raw_chunks(self, name: str, chunk_bytes: int = 64 << 20):
        """The stored bytes of tensor ``name`` in pieces of at most ``chunk_bytes``."""
        i = self.infos[name]
        for begin in range(i.begin, i.end, chunk_bytes):
            end = min(begin + chunk_bytes, i.end)
            buf = bytearray(end - begin)
            self._read_into(TensorInfo(name, i.dtype, (), begin, end), memoryview(buf))
            yield buf

    def raw(self, name: str) -> bytes:
        """The stored bytes of tensor ``name``."""
        i = self.infos[name]
        buf = bytearray(i.nbytes)
        self._read_into(i, memoryview(buf))
        return bytes(buf)

    def _read_into(self, info: TensorInfo, buf) -> None:
        view = memoryview(buf).cast("B")
        done, fd = 0, self._file.fileno()
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.begin + done)
            if n <= 0:
                raise CorruptFileError(f"{self.path}: tensor {info.name!r} ends early (file changed or truncated)")
            done += n

    def close(self) -> None:
        self._map = None  # arrays over it keep it mapped until they go
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclasses.dataclass
class PlannedTensor:
    """A tensor to write: its name, dtype and shape now, its values when ``produce`` is called."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray] | None = None
    # Alternative to produce: the tensor's bytes (buffers, arrays or FileRanges), in order, piece by piece.
    chunks: Callable[[], Iterable] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def value(self) -> np.ndarray:
        """The whole tensor, from ``produce``."""
        if self.produce is None:
            raise ValueError(f"{self.name}: a planned tensor needs produce or chunks")
        return self.produce()


def _header_bytes(entries: Iterable[PlannedTensor], metadata: Mapping[str, str]) -> bytes:
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for t in entries:
        header[t.name] = {
            "dtype": dtype_code(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _checked(path: str, t: PlannedTensor, arr: np.ndarray) -> np.ndarray:
    if tuple(arr.shape) != tuple(t.shape) or np.dtype(arr.dtype) != np.dtype(t.dtype):
        raise MismatchError(
            f"{path}: tensor {t.name!r} came out as {arr.dtype} {tuple(arr.shape)}, "
            f"planned {np.dtype(t.dtype)} {tuple(t.shape)}"
        )
    return arr


def _bytes_of(piece) -> memoryview:
    if isinstance(piece, np.ndarray):
        return np.ascontiguousarray(piece).reshape(-1).view(np.uint8).data
    return memoryview(piece).cast("B")


def write_file(path: str, tensors: list[PlannedTensor], metadata: Mapping[str, str] | None = None,
               on_tensor: Callable[[PlannedTensor], None] | None = None) -> int:
    """Write one safetensors file tensor by tensor (the header is known up front). Returns bytes."""
    metadata = {"format": "pt", **(metadata or {})}
    out = OutputFile(path)
    ok = False
    try:
        out.write(memoryview(_header_bytes(tensors, metadata)))
        for t in tensors:
            pieces = t.chunks() if t.chunks is not None else [_checked(path, t, t.value())]
            start = out.pos
            for piece in pieces:
                if isinstance(piece, FileRange):
                    out.copy(piece)
                else:
                    out.write(_bytes_of(piece))
            del pieces
            if out.pos - start != t.nbytes:
                raise MismatchError(
                    f"{path}: tensor {t.name!r} came out as {out.pos - start} bytes, planned {t.nbytes}"
                )
            if on_tensor is not None:
                on_tensor(t)
        ok = True
        return out.pos
    finally:
        out.close(sync=ok)


def plan_shards(tensors: list[PlannedTensor], max_shard_size: int) -> list[list[PlannedTensor]]:
    """Split tensors, in order, into shards of at most ``max_shard_size`` bytes (a larger
    tensor gets a shard of its own), as transformers does."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_sharded(directory: str, tensors: list[PlannedTensor], max_shard_size: int,
                  metadata: Mapping[str, str] | None = None,
                  on_tensor: Callable[[PlannedTensor], None] | None = None,
                  stem: str = "model") -> list[str]:
    """Write ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index. Returns files."""
    shards = plan_shards(tensors, max_shard_size)
    if len(shards) == 1:
        names = [f"{stem}.safetensors"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_file(os.path.join(directory, name), shard, metadata, on_tensor)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: name for name, shard in zip(names, shards) for t in shard},
        }
        with open(os.path.join(directory, f"{stem}.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        names.append(f"{stem}.safetensors.index.json")
    return names


def iter_tensors(f: SafetensorsFile) -> Iterator[tuple[str, np.ndarray]]:
    for name in f.keys():
        yield name, f.array(name)
