"""What every verb returns: a frozen dataclass with ``to_json()`` (the ``--json`` output: its
fields in order, nested reports as objects) and ``summary()`` (the lines the CLI prints)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar


def emit(report: Report, as_json: bool = False) -> None:
    """Print a verb's report: as JSON (``--json``), else its summary."""
    import json

    print(json.dumps(report.to_json(), indent=2, default=str) if as_json else report.summary())


def human_bytes(n: float) -> str:
    """1536 -> "1.5 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def internal(default: Any = None) -> Any:
    """A field the summary needs that is not part of the JSON report."""
    return dataclasses.field(default=default, metadata={"json": False}, compare=False)


def _json(value: Any) -> Any:
    if isinstance(value, Report):
        return value.to_json()
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _json(v) for k, v in value.items()}
    return value


@dataclasses.dataclass(frozen=True)
class Report:
    """Base of the verbs' reports. ``OMIT_NONE`` names the fields left out of the JSON when None
    (a report says nothing of what did not happen)."""

    OMIT_NONE: ClassVar[tuple[str, ...]] = ()

    def to_json(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("json", True) and not (value is None and f.name in self.OMIT_NONE):
                out[f.name] = _json(value)
        return out

    def summary(self) -> str:
        raise NotImplementedError
