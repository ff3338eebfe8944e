"""Small file helpers every reader shares: one JSON-object reader, one close-on-error guard, one
base for what is opened and closed (a context manager)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from ckptbridge.errors import CorruptFileError, InputNotFoundError


class Closeable(Protocol):
    def close(self) -> None: ...


C = TypeVar("C", bound=Closeable)


class Opened:
    """Something opened that :meth:`close` releases; ``with`` closes it."""

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_json_object(path: str, fix: str, *, read: Callable[[str], bytes] | None = None,
                     missing: str | None = None) -> dict:
    """The JSON object in ``path`` (read with ``read``, default the local file). Not a JSON object:
    a CorruptFileError naming the file and ``fix``; no file: an InputNotFoundError (``missing``
    says what it means)."""
    try:
        if read is not None:
            raw = read(path)
        else:
            with open(path, "rb") as f:
                raw = f.read()
    except FileNotFoundError:
        raise InputNotFoundError(f"{path}: {missing or 'no such file'}") from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: not valid JSON ({e}); {fix}") from None
    if not isinstance(data, dict):
        raise CorruptFileError(f"{path}: expected a JSON object, found {type(data).__name__}; {fix}")
    return data


@contextlib.contextmanager
def close_on_error(resource: C) -> Iterator[C]:
    """Hand ``resource`` to the block; close it if the block raises (it stays open otherwise)."""
    try:
        yield resource
    except BaseException:
        resource.close()
        raise
