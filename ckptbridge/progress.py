"""Progress bars for long work: tqdm on a terminal, quiet otherwise (or when asked)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any


class Progress:
    """A progress bar counting bytes (or ``unit``) that is a no-op when disabled or not on a
    terminal."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None, unit: str = "B"):
        self.total = total
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            from tqdm import tqdm

            scale = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, **scale)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress_over(leaves: Iterable[Any], desc: str, enabled: bool | None = None) -> Progress:
    """A bar over the bytes of ``leaves`` (Orbax :class:`~ckptbridge.io.orbax.LazyArray` leaves),
    each reporting its bytes as they are written."""
    leaves = list(leaves)
    bar = Progress(sum(leaf.nbytes for leaf in leaves), desc, enabled)
    for leaf in leaves:
        leaf.on_written = bar.update
    return bar
