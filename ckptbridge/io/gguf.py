"""GGUF files, the format of ggml's runtimes (and of Ollama and LM Studio, built on them): written
tensor by tensor, read back as metadata and a tensor table, and the Q8_0 quantization ggml's
converter writes.

The layout (GGUF version 3, little-endian, as ``gguf-py``'s ``GGUFWriter`` writes it): the magic
``GGUF``, the version (uint32), the tensor and key-value counts (uint64); the key-value pairs
(key as a string, value type as uint32, the value; strings are a uint64 length and UTF-8 bytes,
arrays an item type, a uint64 count and the items); one entry per tensor (name, number of
dimensions as uint32, the dimensions innermost first as uint64, tensor type as uint32, offset
from the start of the data as uint64); padding to ``general.alignment`` (32 unless the file says
otherwise); then each tensor's bytes, each starting at a multiple of the alignment.

Shapes here are numpy's (outermost first); the file stores them reversed, as ggml counts
dimensions. Metadata values carry their GGUF type (:class:`Value`): ggml reads counts as
uint32, token types as int32 arrays and so on, and a Python ``int`` alone does not say which.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, BinaryIO

import numpy as np

from ckptbridge.errors import CorruptFileError, InputNotFoundError, MismatchError
from ckptbridge.io.atomic import atomic_directory, check_destination
from ckptbridge.io.output import FileRange, OutputFile
from ckptbridge.io.safetensors import DTYPES

MAGIC = b"GGUF"
VERSION = 3
ALIGNMENT = 32  # general.alignment when a file does not set it
QK8_0 = 32  # values per Q8_0 block
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
Q8_PIECE = 8192  # Q8_0 blocks quantized at once (1 MiB of float32)


class ValueType(enum.IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALARS = {ValueType.UINT8: "<B", ValueType.INT8: "<b", ValueType.UINT16: "<H", ValueType.INT16: "<h",
            ValueType.UINT32: "<I", ValueType.INT32: "<i", ValueType.FLOAT32: "<f", ValueType.BOOL: "<?",
            ValueType.UINT64: "<Q", ValueType.INT64: "<q", ValueType.FLOAT64: "<d"}


class TensorType(enum.IntEnum):
    """ggml tensor types written here (numbers as in ggml's ``enum ggml_type``)."""

    F32 = 0
    F16 = 1
    Q8_0 = 8
    BF16 = 30

    @property
    def block(self) -> tuple[int, int]:
        """(values per block, bytes per block)."""
        return _BLOCKS[self]

    def nbytes(self, shape: tuple[int, ...]) -> int:
        values, size = self.block
        count = int(np.prod(shape, dtype=np.int64))
        if shape and shape[-1] % values:
            raise ValueError(f"{self.name}: the innermost dimension ({shape[-1]}) is not a multiple of {values}")
        return count // values * size

    def storage(self, shape: tuple[int, ...]) -> tuple[np.dtype, tuple[int, ...]]:
        """The numpy dtype and shape of this type's bytes for a tensor of ``shape``: the values
        themselves for float types, ``uint8`` blocks (innermost dimension in bytes) for Q8_0."""
        if self is TensorType.Q8_0:
            return np.dtype(np.uint8), (*shape[:-1], shape[-1] // QK8_0 * _BLOCKS[self][1])
        return DTYPES[self.name], tuple(shape)  # F32, F16, BF16: the safetensors codes of the same dtypes


_BLOCKS = {TensorType.F32: (1, 4), TensorType.F16: (1, 2), TensorType.BF16: (1, 2), TensorType.Q8_0: (QK8_0, 34)}


@dataclasses.dataclass(frozen=True)
class Value:
    """A metadata value and its GGUF type (``item`` for the items of an ARRAY)."""

    type: ValueType
    value: Any
    item: ValueType | None = None

    def __post_init__(self) -> None:
        if self.type is ValueType.ARRAY:
            if self.item is None or self.item is ValueType.ARRAY:
                raise ValueError("an ARRAY value needs the type of its items (not ARRAY)")
            if not len(self.value):
                raise ValueError("GGUF readers refuse empty arrays in metadata")


def u32(v: int) -> Value:
    return Value(ValueType.UINT32, int(v))


def f32(v: float) -> Value:
    return Value(ValueType.FLOAT32, float(v))


def string(v: str) -> Value:
    return Value(ValueType.STRING, str(v))


def boolean(v: bool) -> Value:
    return Value(ValueType.BOOL, bool(v))


def array(values: Iterable[Any], item: ValueType) -> Value:
    return Value(ValueType.ARRAY, list(values), item)


def _pack_string(s: str | bytes) -> bytes:
    b = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return struct.pack("<Q", len(b)) + b


def _pack_item(t: ValueType, v: Any) -> bytes:
    if t is ValueType.STRING:
        return _pack_string(v)
    return struct.pack(_SCALARS[t], v)


def _pack_value(v: Value) -> bytes:
    out = struct.pack("<I", v.type)
    if v.type is not ValueType.ARRAY:
        return out + _pack_item(v.type, v.value)
    item = v.item
    assert item is not None  # checked in Value
    out += struct.pack("<IQ", item, len(v.value))
    if item is ValueType.STRING:
        return out + b"".join(_pack_string(s) for s in v.value)
    return out + np.asarray(v.value, dtype=np.dtype(_SCALARS[item])).tobytes()


def _padding(n: int, alignment: int) -> int:
    return (-n) % alignment


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """A tensor to write: its name, numpy shape (of the values, not of Q8_0's bytes), type, and
    a function that makes its stored form when its turn comes (:meth:`TensorType.storage`): the
    whole array, or an iterable of its pieces in order (runs of its outermost rows, any shape, or
    :class:`~ckptbridge.io.output.FileRange` objects of another file's bytes, copied file to file),
    whose bytes together are the tensor's."""

    name: str
    shape: tuple[int, ...]
    type: TensorType
    produce: Callable[[], np.ndarray | Iterable[np.ndarray | FileRange]]

    @property
    def nbytes(self) -> int:
        return self.type.nbytes(self.shape)


def header_bytes(metadata: Mapping[str, Value], tensors: list[PlannedTensor], alignment: int = ALIGNMENT) -> bytes:
    """Everything before the tensor data: header, metadata, tensor table and padding."""
    out = bytearray(MAGIC + struct.pack("<IQQ", VERSION, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _pack_string(key) + _pack_value(value)
    offset = 0
    for t in tensors:
        out += _pack_string(t.name) + struct.pack("<I", len(t.shape))
        out += struct.pack(f"<{len(t.shape)}Q", *reversed(t.shape)) + struct.pack("<IQ", t.type, offset)
        offset += t.nbytes + _padding(t.nbytes, alignment)
    out += b"\0" * _padding(len(out), alignment)
    return bytes(out)


def _alignment(metadata: Mapping[str, Value]) -> int:
    v = metadata.get("general.alignment")
    if v is None:
        return ALIGNMENT
    if v.type is not ValueType.UINT32 or v.value <= 0 or v.value & (v.value - 1):
        raise ValueError(f"general.alignment must be a UINT32 power of two, not {v}")
    return int(v.value)


def write_gguf(dst: str, metadata: Mapping[str, Value], tensors: Iterable[PlannedTensor], *,
               overwrite: bool = False, sources: Iterable[str] = (),
               on_written: Callable[[int], None] | None = None) -> int:
    """Write a GGUF file at ``dst``: the tensors' stored forms made one at a time, in order (peak
    memory about the largest one), into a temporary name renamed into place at the end (a
    failure leaves nothing). Returns the file's size."""
    return write_gguf_files([(dst, metadata, tensors)], overwrite=overwrite, sources=sources,
                            on_written=on_written)[0]


def write_gguf_files(files: Sequence[tuple[str, Mapping[str, Value], Iterable[PlannedTensor]]], *,
                     overwrite: bool = False, sources: Iterable[str] = (),
                     on_written: Callable[[int], None] | None = None) -> list[int]:
    """Write several GGUF files (a model's text file and its projector file) as :func:`write_gguf`
    writes one, in order, each under a temporary name; all are renamed into place only when every
    one is written (a failure leaves none). Returns their sizes."""
    plans = []
    for dst, metadata, tensors in files:
        planned = list(tensors)
        names = [t.name for t in planned]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"tensor {dup!r} is planned twice")
        alignment = _alignment(metadata)
        plans.append((dst, header_bytes(metadata, planned, alignment), planned, alignment))
    for dst, *_ in plans:
        check_destination(dst, list(sources), overwrite)
    sizes = []
    with contextlib.ExitStack() as stack:
        for dst, head, planned, alignment in plans:
            tmp = stack.enter_context(atomic_directory(dst, overwrite))
            out = OutputFile(tmp)
            ok = False
            try:
                out.write(memoryview(head))
                for t in planned:
                    _write_tensor(out, t, alignment)
                    if on_written is not None:
                        on_written(t.nbytes)
                ok = True
            finally:
                out.close(sync=ok)
            sizes.append(out.pos)
    return sizes


def _write_tensor(f: OutputFile, t: PlannedTensor, alignment: int) -> None:
    want_dtype, want_shape = t.type.storage(t.shape)
    data = t.produce()
    if isinstance(data, np.ndarray):
        if data.dtype != want_dtype or tuple(data.shape) != want_shape:
            raise MismatchError(f"{t.name}: produced {data.dtype} {tuple(data.shape)}, a {t.type.name} tensor of "
                                f"shape {t.shape} is stored as {want_dtype} {want_shape}")
        data = [data]
    written = 0
    for piece in data:
        if isinstance(piece, FileRange):  # stored bytes, copied file to file
            f.copy(piece)
            written += piece.nbytes
            continue
        if piece.dtype != want_dtype:
            raise MismatchError(f"{t.name}: produced a piece of {piece.dtype}, a {t.type.name} tensor is stored as "
                                f"{want_dtype}")
        f.write(np.ascontiguousarray(piece).reshape(-1).view(np.uint8).data)
        written += piece.nbytes
    if written != t.nbytes:
        raise MismatchError(f"{t.name}: produced {written} bytes, a {t.type.name} tensor of shape {t.shape} has "
                            f"{t.nbytes}")
    f.write(memoryview(b"\0" * _padding(t.nbytes, alignment)))


GGML_QUANT_VERSION = 2  # general.quantization_version as ggml's converter writes it


def store(values: np.ndarray, t: TensorType) -> np.ndarray:
    """``values`` in the stored form of ``t`` (float16 and bfloat16 rounded to nearest even from
    float32, as gguf-py's quantizer does; Q8_0 as ggml's reference)."""
    if t is TensorType.Q8_0:
        return quantize_q8_0(values)
    want = t.storage(values.shape)[0]
    if values.dtype == want:
        return values
    return values.astype(np.float32).astype(want)


def spec_value(value: tuple[str, Any]) -> Value:
    """A metadata value as a family's spec writes it (plain data: ``(type name, value)``) as GGUF stores it."""
    kind, v = value
    if kind == "array":
        item, items = v
        return array(items, ValueType[item.upper()])
    return Value(ValueType[kind.upper()], v)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """``x`` (any float dtype; innermost dimension a multiple of 32) as Q8_0 blocks, bit for bit
    what ggml's reference quantizer (and gguf-py's) writes: per block of 32 values, d = max|x| /
    127 in float32, q = x * (1 / d) rounded half away from zero (0 where d is 0), stored as d in
    float16 followed by the 32 q as int8."""
    if x.shape[-1] % QK8_0:
        raise ValueError(f"Q8_0 needs an innermost dimension that is a multiple of {QK8_0}, not {x.shape[-1]}")
    flat = np.ascontiguousarray(x).reshape(-1, QK8_0)
    n = flat.shape[0]
    out = np.empty((n, 34), np.uint8)
    # in pieces of Q8_PIECE blocks through buffers made once: no allocation per piece (the allocator
    # handing back and faulting in fresh pages for every temporary cost as much as the arithmetic)
    per = min(n, Q8_PIECE)
    b, q = np.empty((per, QK8_0), np.float32), np.empty((per, QK8_0), np.float32)
    d, inv = np.empty((per, 1), np.float32), np.empty((per, 1), np.float32)
    q8, half = np.empty((per, QK8_0), np.int8), np.empty((per, QK8_0), np.bool_)
    for start in range(0, n, per):
        m = min(per, n - start)
        bm, qm, dm, im, q8m, hm = b[:m], q[:m], d[:m], inv[:m], q8[:m], half[:m]
        np.copyto(bm, flat[start:start + m], casting="unsafe")
        np.abs(bm, out=qm)
        np.max(qm, axis=1, keepdims=True, out=dm)
        dm /= np.float32(127)
        with np.errstate(divide="ignore"):
            np.divide(np.float32(1), dm, out=im)
        im[dm == 0] = 0
        bm *= im
        np.trunc(bm, out=qm)
        bm -= qm  # the fraction, exact, with the value's sign
        np.copyto(q8m, qm, casting="unsafe")  # then rounded half away from zero, as ggml's roundf
        np.greater_equal(bm, np.float32(0.5), out=hm)
        q8m += hm.view(np.int8)
        np.less_equal(bm, np.float32(-0.5), out=hm)
        q8m -= hm.view(np.int8)
        with np.errstate(over="ignore"):  # d beyond float16 becomes inf, as in ggml
            out[start:start + m, :2] = dm.astype(np.float16).view(np.uint8)
        out[start:start + m, 2:] = q8m.view(np.uint8)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK8_0 * 34)


def dequantize_q8_0(blocks: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Q8_0 bytes -> float32 values of ``shape``."""
    b = np.asarray(blocks, np.uint8).reshape(-1, 34)
    d = b[:, :2].copy().view(np.float16).astype(np.float32)
    return (b[:, 2:].view(np.int8).astype(np.float32) * d).reshape(shape)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (the file's dimensions reversed)
    type: TensorType | int  # an int for a ggml type this module does not write
    offset: int  # absolute, in the file
    nbytes: int | None  # None for a type this module does not know


@dataclasses.dataclass
class GGUFFile:
    """What a GGUF file holds: metadata (Python values and their GGUF types) and its tensor table."""

    path: str
    version: int
    metadata: dict[str, Any]
    types: dict[str, ValueType]
    tensors: dict[str, TensorInfo]
    alignment: int
    data_offset: int

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name``'s stored form (:meth:`TensorType.storage`) over the file mapped
        into memory (read-only)."""
        t = self.tensors[name]
        if not isinstance(t.type, TensorType):
            raise CorruptFileError(f"{self.path}: {name} is of ggml type {t.type}, which ckptbridge does not read")
        dtype, shape = t.type.storage(t.shape)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=t.offset, shape=shape)

    def values(self, name: str) -> np.ndarray:
        """Tensor ``name``'s values (float32 for Q8_0, the stored dtype otherwise)."""
        t = self.tensors[name]
        data = self.array(name)
        return dequantize_q8_0(data, t.shape) if t.type is TensorType.Q8_0 else data


class _Reader:
    def __init__(self, path: str, f: BinaryIO, size: int):
        self.path, self.f, self.size = path, f, size

    def take(self, n: int, what: str) -> bytes:
        b = self.f.read(n)
        if len(b) != n:
            raise CorruptFileError(f"{self.path}: ends inside {what} at byte {self.f.tell()} (truncated?); "
                                   "write or download it again")
        return b

    def unpack(self, fmt: str, what: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def string(self, what: str) -> str:
        (n,) = self.unpack("<Q", what)
        if n > self.size:
            raise CorruptFileError(f"{self.path}: {what} claims {n} bytes, more than the file holds")
        return self.take(n, what).decode("utf-8", errors="replace")

    def item(self, t: ValueType, what: str) -> Any:
        if t is ValueType.STRING:
            return self.string(what)
        return self.unpack(_SCALARS[t], what)[0]

    def value(self, what: str) -> tuple[ValueType, Any]:
        t = self.value_type(self.unpack("<I", what)[0], what)
        return t, (self.items(what) if t is ValueType.ARRAY else self.item(t, what))

    def items(self, what: str) -> list:
        """An array's items: their type, count and values (an array of arrays holds each inner
        array's type, count and values in turn)."""
        item_t = self.value_type(self.unpack("<I", what)[0], what)
        (count,) = self.unpack("<Q", what)
        if item_t is ValueType.ARRAY:
            return [self.items(what) for _ in range(count)]
        if item_t is ValueType.STRING:
            return [self.string(what) for _ in range(count)]
        fmt = np.dtype(_SCALARS[item_t])
        if count * fmt.itemsize > self.size:
            raise CorruptFileError(f"{self.path}: {what} claims {count} items, more than the file holds")
        return np.frombuffer(self.take(count * fmt.itemsize, what), fmt).tolist()

    def value_type(self, code: int, what: str) -> ValueType:
        try:
            return ValueType(code)
        except ValueError:
            raise CorruptFileError(f"{self.path}: {what} has value type {code}, which GGUF does not define") from None


def read_gguf(path: str) -> GGUFFile:
    """The metadata and tensor table of the GGUF file ``path`` (no tensor data is read)."""
    if not os.path.isfile(path):
        raise InputNotFoundError(f"{path}: no such file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        r = _Reader(path, f, size)
        magic = f.read(4)
        if magic != MAGIC:
            raise CorruptFileError(f"{path}: not a GGUF file (starts with {magic!r}, not {MAGIC!r})")
        version, n_tensors, n_kv = r.unpack("<IQQ", "the header")
        if version not in (2, 3):
            raise CorruptFileError(f"{path}: GGUF version {version}; ckptbridge reads versions 2 and 3")
        metadata, types = {}, {}
        for n in range(n_kv):
            key = r.string(f"metadata key {n}")
            types[key], metadata[key] = r.value(f"metadata {key!r}")
        alignment = metadata.get("general.alignment", ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0:
            raise CorruptFileError(f"{path}: general.alignment is {alignment!r}, not a positive integer")
        table = []
        for n in range(n_tensors):
            name = r.string(f"tensor entry {n}")
            (dims,) = r.unpack("<I", f"tensor {name!r}")
            if dims > MAX_DIMS:
                raise CorruptFileError(f"{path}: tensor {name!r} has {dims} dimensions; ggml allows {MAX_DIMS}")
            shape = tuple(reversed(r.unpack(f"<{dims}Q", f"tensor {name!r}")))
            code, offset = r.unpack("<IQ", f"tensor {name!r}")
            table.append((name, shape, code, offset))
        data_offset = f.tell() + _padding(f.tell(), alignment)
    tensors = {}
    for name, shape, code, offset in table:
        try:
            ttype: TensorType | int = TensorType(code)
        except ValueError:
            ttype = code
        nbytes = ttype.nbytes(shape) if isinstance(ttype, TensorType) else None
        begin = data_offset + offset
        if nbytes is not None and begin + nbytes > size:
            raise CorruptFileError(f"{path}: tensor {name!r} ends at byte {begin + nbytes} past the end of the "
                                   f"{size}-byte file (truncated?); write or download it again")
        tensors[name] = TensorInfo(name, shape, ttype, begin, nbytes)
    return GGUFFile(path, version, metadata, types, tensors, alignment, data_offset)


__all__ = ["ALIGNMENT", "GGUFFile", "PlannedTensor", "TensorInfo", "TensorType", "Value", "ValueType", "array",
           "boolean", "dequantize_q8_0", "f32", "header_bytes", "quantize_q8_0", "read_gguf", "string", "u32",
           "write_gguf"]
