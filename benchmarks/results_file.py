"""The benchmarks' results files: ``{"runs": [...]}``, each run of a script appended as a numbered,
dated record, so that a file keeps every measurement taken."""

from __future__ import annotations

import json
import os
import time


def append_run(path: str, record: dict) -> int:
    """Append ``record`` to the runs of ``path`` (made if missing) as the next run; returns its number."""
    runs = []
    if os.path.isfile(path):
        with open(path) as f:
            runs = json.load(f).get("runs", [])
    number = len(runs) + 1
    runs.append({"run": number, "date": time.strftime("%Y-%m-%d"), **record})
    with open(path, "w") as f:
        json.dump({"runs": runs}, f, indent=1)
        f.write("\n")
    return number
