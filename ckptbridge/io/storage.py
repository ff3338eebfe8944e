"""Where Orbax checkpoints live: local directories or Cloud Storage (``gs://bucket/path``).

The few file operations the Orbax side needs (exists, isdir, isfile, list, read, remove), the
same for both; Cloud Storage through gcsfs (application default credentials, anonymous for
public buckets; ``STORAGE_EMULATOR_HOST`` for an emulator). Arrays themselves are read with
TensorStore's ``gcs`` driver (:func:`kvstore`) and written by Orbax, whose paths take ``gs://``
as they are.
"""

from __future__ import annotations

import functools
import os
import posixpath

from ckptbridge import deps

SCHEME = "gs://"
COMMIT_FILE = "commit_success.txt"  # what Orbax writes into a finished checkpoint on Cloud Storage


def is_remote(path: str) -> bool:
    return str(path).startswith(SCHEME)


def split(path: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = str(path)[len(SCHEME):]
    bucket, _, key = rest.partition("/")
    return bucket, key.strip("/")


def join(path: str, *parts: str) -> str:
    return posixpath.join(path, *parts) if is_remote(path) else os.path.join(path, *parts)


def dirname(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) if is_remote(path) else os.path.dirname(path)


def basename(path: str) -> str:
    return posixpath.basename(path.rstrip("/")) if is_remote(path) else os.path.basename(path)


def absolute(path: str) -> str:
    """``path`` made absolute (a ``gs://`` path is absolute already)."""
    return path.rstrip("/") if is_remote(path) else os.path.abspath(path)


@functools.lru_cache(maxsize=1)
def _gcs():
    gcsfs = deps.load("gcsfs", "gcs")
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    return gcsfs.GCSFileSystem(token="anon" if emulator else None)


def exists(path: str) -> bool:
    return _gcs().exists(path) if is_remote(path) else os.path.exists(path)


def isdir(path: str) -> bool:
    return _gcs().isdir(path) if is_remote(path) else os.path.isdir(path)


def isfile(path: str) -> bool:
    return _gcs().isfile(path) if is_remote(path) else os.path.isfile(path)


def listdir(path: str) -> list[str]:
    """Names of the entries of directory ``path``."""
    if not is_remote(path):
        return os.listdir(path)
    return [posixpath.basename(p.rstrip("/")) for p in _gcs().ls(path, detail=False, refresh=True)]


def forget(path: str) -> None:
    """Drop what is cached of ``path`` and its directory (Cloud Storage listings), so that the next
    look asks the server."""
    if is_remote(path):
        _gcs().invalidate_cache(path)
        _gcs().invalidate_cache(dirname(path))


def read_bytes(path: str) -> bytes:
    if is_remote(path):
        with _gcs().open(path, "rb") as f:
            return f.read()
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    if is_remote(path):
        with _gcs().open(path, "wb") as f:
            f.write(data)
        return
    with open(path, "wb") as f:
        f.write(data)


def remove_tree(path: str) -> None:
    if is_remote(path):
        if _gcs().exists(path):
            _gcs().rm(path, recursive=True)
        return
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def copy_tree(src: str, dst: str, *, last: tuple[str, ...] = ()) -> None:
    """Copy every object under ``src`` to the same place under ``dst`` on the server, objects
    named in ``last`` after all others, in that order."""
    fs = _gcs()
    src, dst = src.rstrip("/"), dst.rstrip("/")
    rank = {name: i + 1 for i, name in enumerate(last)}
    objects = sorted(fs.find(src), key=lambda p: rank.get(posixpath.basename(p), 0))
    for obj in objects:
        fs.copy(obj, dst + "/" + obj[len(split(src)[0]) + 1 + len(split(src)[1]):].lstrip("/"))
    fs.invalidate_cache()


def kvstore(path: str) -> dict:
    """The TensorStore key-value store of directory ``path`` (``file`` or ``gcs``)."""
    if is_remote(path):
        bucket, key = split(path)
        return {"driver": "gcs", "bucket": bucket, "path": key + "/" if key else ""}
    return {"driver": "file", "path": path.rstrip("/") + "/"}
