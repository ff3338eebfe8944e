"""Regression guard (not a timed test): peak RSS of conversions and merge must not grow with the
model the way holding it in memory would (>= 1 MB per MB of checkpoint), measured by the memory
benchmark at a small scale in this run; the figures are printed."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("model", ["gemma4", "qwen3_moe"])  # dense, and expert stacks from per-expert keys
def test_peak_memory_is_flat_in_the_number_of_layers(model):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "memory_vs_layers.py"), "--model", model,
                           "--layers", "2", "10", "--width", "1024", "--max-growth", "0.6"],
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout)  # the figures, in the test log
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    ratio_line = next(line for line in proc.stdout.splitlines() if line.startswith("ratio"))
    checkpoint_growth = float(ratio_line.split("checkpoint ")[1].split("x")[0])
    assert checkpoint_growth > 3  # the guard only means something when the model really grows
    assert "memory guard ok" in proc.stdout
