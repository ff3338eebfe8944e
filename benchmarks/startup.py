"""Start-up time of the CLI: `ckptbridge --help` and `ckptbridge inspect` of a small local HF
model, in a core install (`pip install .`, no extras) and in the full environment (.venv), plus
the modules that cost the most to import (`python -X importtime`).

Each command runs in a fresh process, alternating between the environments, `--runs` times;
medians are reported. The core environment is built in a temporary directory unless `--core`
names one.

    .venv/bin/python benchmarks/startup.py [--runs 7] [--core VENV] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build_core(path: str) -> str:
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    subprocess.run([os.path.join(path, "bin", "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    ROOT], check=True)
    return path


def timed(argv: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tempfile.gettempdir())
    return time.perf_counter() - t


def import_costs(python: str, top: int = 8) -> list[dict]:
    """The modules with the largest cumulative import time under ``import ckptbridge.cli`` + the
    inspect verb's imports."""
    p = subprocess.run([python, "-X", "importtime", "-c", "import ckptbridge.cli, ckptbridge.inspect"],
                       capture_output=True, text=True, check=True, cwd=tempfile.gettempdir())
    rows = []
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cum_us, name = line[len("import time:"):].split("|")
        if len(name) - len(name.lstrip()) == 1:  # imported by the command itself, not by another module
            rows.append({"module": name.strip(), "cumulative_ms": int(cum_us) / 1000})
    return sorted(rows, key=lambda r: -r["cumulative_ms"])[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--core", help="an existing core virtual environment (default: build one)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "startup.json"))
    args = ap.parse_args()

    from ckptbridge.testing import build_checkpoint

    with tempfile.TemporaryDirectory(prefix="ckptbridge-startup-") as tmp:
        core = args.core or build_core(os.path.join(tmp, "core"))
        model = build_checkpoint(os.path.join(tmp, "model"), tokenizer=False)
        envs = {"core": os.path.join(core, "bin"), "full": os.path.join(ROOT, ".venv", "bin")}
        commands = {"--help": ["--help"], "inspect": ["inspect", model]}
        times: dict = {env: {c: [] for c in commands} for env in envs}
        for _ in range(args.runs):
            for env, bindir in envs.items():
                for name, argv in commands.items():
                    times[env][name].append(timed([os.path.join(bindir, "ckptbridge"), *argv]))
        baseline = [timed([os.path.join(envs["core"], "python"), "-c", "pass"]) for _ in range(args.runs)]
        result = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "runs": args.runs,
            "python_startup_s": round(statistics.median(baseline), 3),
            "median_s": {env: {c: round(statistics.median(v), 3) for c, v in cs.items()} for env, cs in times.items()},
            "imports_ms": {env: import_costs(os.path.join(bindir, "python")) for env, bindir in envs.items()},
        }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
