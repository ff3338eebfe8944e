"""Progress bars for long work: tqdm on a terminal, quiet otherwise (or when asked)."""

from __future__ import annotations

import sys


class Progress:
    """A byte-counting progress bar that is a no-op when disabled or not on a terminal."""

    def __init__(self, total: int, desc: str, enabled: bool | None = None):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                             file=sys.stderr, leave=False)

    def update(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
