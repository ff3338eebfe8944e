"""An output file written fast: unbuffered writes, stored bytes of another file copied in the
kernel, and the disk writing behind the writer (so the closing fsync has little left to do).
Every writer of a large file (safetensors, GGUF) writes through it."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future, ThreadPoolExecutor

from ckptbridge.errors import CorruptFileError


@dataclasses.dataclass(frozen=True)
class FileRange:
    """Bytes ``begin:end`` of an open file (``fd``), as a piece of a tensor to write."""

    fd: int
    begin: int
    end: int
    path: str
    name: str

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


COPY_STEP = 256 << 20  # bytes per copy_file_range call
WRITEBACK_EVERY = 256 << 20  # start writing dirty pages to disk after this many bytes


class OutputFile:
    """An output file written with unbuffered writes. Every ``WRITEBACK_EVERY`` bytes, a
    background thread hands the pages written so far to the kernel's writeback
    (``posix_fadvise(DONTNEED)``, which blocks until the disk has queued them), so the disk
    writes while the next tensors are produced and the closing fsync has little left to do."""

    def __init__(self, path: str):
        self.path = path
        self.f = open(path, "wb", buffering=0)
        self.fd = self.f.fileno()
        self.pos = 0
        self.flushed = 0
        self.can_copy = hasattr(os, "copy_file_range")
        self._flusher: ThreadPoolExecutor | None = None
        self._flushing: Future | None = None

    def write(self, data: memoryview) -> None:
        done = 0
        while done < data.nbytes:
            done += os.write(self.fd, data[done:done + (1 << 30)])
        self.pos += done
        self._writeback()

    def copy(self, src: FileRange) -> None:
        """Copy ``src`` in the kernel (copy_file_range); read + write where that is not possible."""
        offset = src.begin
        while offset < src.end:
            n = min(COPY_STEP, src.end - offset)
            got = self._copy_in_kernel(src.fd, offset, n) if self.can_copy else 0
            if not self.can_copy:
                buf = os.pread(src.fd, min(n, 64 << 20), offset)
                got = len(buf)
                self.write(memoryview(buf))
            if got <= 0:
                raise CorruptFileError(f"{src.path}: tensor {src.name!r} ends early (file changed or truncated)")
            offset += got

    def _copy_in_kernel(self, fd: int, offset: int, n: int) -> int:
        try:
            got = os.copy_file_range(fd, self.fd, n, offset, self.pos)
        except OSError:  # another filesystem, or not supported here: the caller copies through memory
            self.can_copy = False
            return 0
        self.pos += got
        os.lseek(self.fd, self.pos, os.SEEK_SET)  # where the next write() goes
        self._writeback()
        return got

    def _writeback(self) -> None:
        if self.pos - self.flushed < WRITEBACK_EVERY or not hasattr(os, "posix_fadvise"):
            return
        if self._flushing is not None:
            if not self._flushing.done():
                return  # the disk is behind; hand over a larger range next time
            self._flushing.result()
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(1, thread_name_prefix="writeback")
        self._flushing = self._flusher.submit(os.posix_fadvise, self.fd, self.flushed, self.pos - self.flushed,
                                              os.POSIX_FADV_DONTNEED)
        self.flushed = self.pos

    def close(self, sync: bool) -> None:
        try:
            if self._flusher is not None:
                self._flusher.shutdown(wait=True)
            if sync:
                os.fsync(self.fd)
        finally:
            self.f.close()


__all__ = ["COPY_STEP", "WRITEBACK_EVERY", "FileRange", "OutputFile"]
