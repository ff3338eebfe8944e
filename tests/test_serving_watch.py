"""python -m serving watch: checkpoints scored as they land (serving/watch.py)."""

import json
import os

import pytest

from serving.watch import Rows, best, committed, loss_at, pending


def _step(root, step, *, commit=True, tmp=False):
    name = f"{step}.orbax-checkpoint-tmp-1234" if tmp else str(step)
    os.makedirs(os.path.join(root, name, "model_params"))
    if commit:
        open(os.path.join(root, name, "_CHECKPOINT_METADATA"), "w").close()


def test_only_committed_checkpoints_are_seen(tmp_path):
    root = str(tmp_path / "checkpoints")
    _step(root, 2)
    _step(root, 10)
    _step(root, 4, commit=False)  # arrays still being written
    _step(root, 6, tmp=True)  # Orbax's temporary directory, renamed when done
    assert [c.step for c in committed(root)] == [2, 10]
    assert [c.step for c in pending(root, {2}, print)] == [10]
    assert committed(str(tmp_path / "none")) == []


def test_rows_survive_a_kill_mid_line_and_refuse_duplicates(tmp_path):
    rows = Rows(str(tmp_path))
    rows.append({"step": 1, "pass@1": 0.5})
    rows.append({"step": 2, "pass@1": 0.25})
    with open(rows.path, "a") as f:
        f.write('{"step": 3, "pa')  # killed while writing
    again = Rows(str(tmp_path))
    assert again.steps == {1, 2}
    text = open(again.path).read()
    assert text.endswith("}\n") and text.count("\n") == 2  # the partial line is gone from the file too
    with pytest.raises(RuntimeError, match="step 2 has a row already"):
        again.append({"step": 2})
    again.append({"step": 3, "pass@1": 1.0})
    assert [json.loads(line)["step"] for line in open(again.path)] == [1, 2, 3]


def test_best_is_the_highest_pass_at_1_then_the_lower_loss():
    rows = [{"step": 1, "pass@1": 0.5, "loss": 2.0}, {"step": 2, "pass@1": 0.75, "loss": 1.5},
            {"step": 3, "pass@1": 0.75, "loss": 1.2}, {"step": 4, "pass@1": None, "loss": 0.1}]
    assert best(rows)["step"] == 3
    assert best([{"step": 1, "pass@1": None}]) is None


def test_loss_at_reads_whole_lines_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n{"step": 3, "lo')
    assert loss_at(str(path), 2) == 2.25
    assert loss_at(str(path), 3) is None and loss_at(str(tmp_path / "none"), 1) is None
