"""Atomic output directories: write into a temporary sibling, rename into place at the end.

A killed process leaves at most a directory named ``.<name>.ckptbridge-tmp-<pid>`` next to the
destination, never a half-written destination. Leftovers of dead processes are removed by the
next run that writes the same destination.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

from ckptbridge.errors import OutputError
from ckptbridge.io import storage

log = logging.getLogger(__name__)
TMP_MARK = ".ckptbridge-tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tmp_pattern(dst: str) -> str:
    parent, name = os.path.split(os.path.abspath(dst))
    return os.path.join(parent, f".{name}{TMP_MARK}")


def clean_stale(dst: str) -> list[str]:
    """Remove temporary directories of dead processes left next to ``dst``. Returns them."""
    removed = []
    for path in glob.glob(glob.escape(_tmp_pattern(dst)) + "*"):
        tail = path[len(_tmp_pattern(dst)):]
        pid_text = tail.split(".", 1)[0]
        if pid_text.isdigit() and _pid_alive(int(pid_text)) and int(pid_text) != os.getpid():
            continue
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
        log.info("removed leftover %s of an interrupted run", path)
        removed.append(path)
    return removed


def check_destination(dst: str, sources: list[str], overwrite: bool) -> None:
    """Refuse a destination that exists (without ``overwrite``), overlaps a source, or cannot be written."""
    if storage.is_remote(dst):
        return _check_remote_destination(dst, sources, overwrite)
    adst = os.path.realpath(dst)
    for src in sources:
        if storage.is_remote(src):
            continue
        asrc = os.path.realpath(src)
        if adst == asrc or adst.startswith(asrc.rstrip(os.sep) + os.sep):
            raise OutputError(f"{dst}: destination lies inside the source {src}; choose a directory outside it")
        if asrc.startswith(adst.rstrip(os.sep) + os.sep):
            raise OutputError(f"{dst}: destination contains the source {src}; choose another directory")
    if os.path.lexists(dst) and not overwrite:
        raise OutputError(f"{dst}: already exists; remove it or pass overwrite=True (--overwrite)")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise OutputError(f"{dst}: parent directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{dst}: parent directory {parent} is not writable; choose another destination")


def _check_remote_destination(dst: str, sources: list[str], overwrite: bool) -> None:
    adst = storage.absolute(dst) + "/"
    for src in sources:
        if storage.is_remote(src):
            asrc = storage.absolute(src) + "/"
            if adst.startswith(asrc) or asrc.startswith(adst):
                raise OutputError(f"{dst}: destination and source {src} overlap; choose another destination")
    bucket, _ = storage.split(dst)
    if not storage.exists(storage.SCHEME + bucket):
        raise OutputError(f"{dst}: bucket {bucket} does not exist or cannot be read with these credentials")
    if storage.exists(dst) and not overwrite:
        raise OutputError(f"{dst}: already exists; remove it or pass overwrite=True (--overwrite)")


@contextlib.contextmanager
def atomic_directory(dst: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh temporary directory; on success it becomes ``dst``, on failure it is removed.

    On Cloud Storage, which has no rename, the temporary prefix is copied object by object to
    ``dst`` on the server (no bytes pass through this machine), Orbax's ``_METADATA`` files last,
    so a run killed on the way leaves no checkpoint that reads as one."""
    if storage.is_remote(dst):
        with _remote_atomic_directory(dst, overwrite) as tmp:
            yield tmp
        return
    clean_stale(dst)
    parent = os.path.dirname(os.path.abspath(dst))
    prefix = os.path.basename(_tmp_pattern(dst)) + f"{os.getpid()}."
    try:
        tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    except OSError as e:
        raise OutputError(f"{dst}: cannot create a directory in {parent} ({e.strerror}); "
                          "choose another destination") from None
    try:
        yield os.path.join(tmp, "out")
        out = os.path.join(tmp, "out")
        if os.path.lexists(dst):
            if not overwrite:
                raise OutputError(f"{dst}: appeared while writing; remove it or pass overwrite=True (--overwrite)")
            old = os.path.join(tmp, "old")
            os.rename(dst, old)
        os.rename(out, dst)
        _fsync_dir(parent)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise OutputError(f"{dst}: disk full while writing ({e}); free space and run again") from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _remote_atomic_directory(dst: str, overwrite: bool) -> Iterator[str]:
    import secrets
    import socket

    dst = storage.absolute(dst)
    parent, name = storage.dirname(dst), storage.basename(dst)
    host = "".join(c for c in socket.gethostname() if c.isalnum() or c == "-")[:40]
    mine = f".{name}{TMP_MARK}{host}-"
    if storage.exists(parent):  # leftovers of this machine's killed runs (others' cannot be told apart)
        for entry in storage.listdir(parent):
            pid = entry[len(mine):].split(".", 1)[0]
            if entry.startswith(mine) and pid.isdigit() and not _pid_alive(int(pid)):
                storage.remove_tree(storage.join(parent, entry))
                log.info("removed leftover %s of an interrupted run", storage.join(parent, entry))
    tmp = storage.join(parent, f"{mine}{os.getpid()}.{secrets.token_hex(4)}")
    try:
        yield storage.join(tmp, "out")
        out = storage.join(tmp, "out")
        if storage.exists(dst):
            if not overwrite:
                raise OutputError(f"{dst}: appeared while writing; remove it or pass overwrite=True (--overwrite)")
            storage.remove_tree(dst)
        storage.copy_tree(out, dst, last=("_CHECKPOINT_METADATA", storage.COMMIT_FILE, "_METADATA"))
    finally:
        storage.remove_tree(tmp)
