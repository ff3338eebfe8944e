"""python -m serving watch: checkpoints scored as they land (serving/watch.py)."""

import json
import os

import pytest

from serving.watch import Rows, best, committed, loss_at, pending


def _step(root, step, *, commit="rename"):
    """A step as Orbax leaves it: ``rename`` committed on a local disk (renamed from its temporary
    directory, commit_timestamp_nsecs set), ``file`` committed in place (commit_success.txt only),
    ``tmp`` still in its temporary directory, ``inplace`` still being written in place (Cloud
    Storage, GCSFuse: metadata there from the start, no commit stamp yet)."""
    name = f"{step}.orbax-checkpoint-tmp-1234" if commit == "tmp" else str(step)
    os.makedirs(os.path.join(root, name, "model_params"))
    meta = {"item_handlers": {}, "init_timestamp_nsecs": 1}
    if commit == "rename":
        meta["commit_timestamp_nsecs"] = 1_700_000_000_000_000_000 + step
    with open(os.path.join(root, name, "_CHECKPOINT_METADATA"), "w") as f:
        json.dump(meta, f)
    if commit == "file":
        open(os.path.join(root, name, "commit_success.txt"), "w").close()


def test_only_committed_checkpoints_are_seen(tmp_path):
    root = str(tmp_path / "checkpoints")
    _step(root, 2)
    _step(root, 10, commit="file")
    _step(root, 4, commit="inplace")
    _step(root, 6, commit="tmp")
    assert [c.step for c in committed(root)] == [2, 10]
    assert committed(root)[0].committed == 1_700_000_000.0
    assert [c.step for c in pending(root, {2})] == [10]
    assert committed(str(tmp_path / "none")) == []


def test_a_checkpoint_removed_before_export_is_skipped_in_one_line(tmp_path):
    from serving.watch import Checkpoint, Watch

    lines = []
    w = Watch(str(tmp_path / "run"), str(tmp_path / "base"), str(tmp_path), str(tmp_path / "out"), say=lines.append)
    gone = Checkpoint(7, str(tmp_path / "run" / "checkpoints" / "7"), 0.0)
    assert w.export(gone) is None
    assert lines == ["watch: step 7: removed by the run's retention before it was exported; skipped"]


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


def test_one_watch_per_out(tmp_path):
    from ckptbridge.errors import ConfigError
    from serving.watch import Busy

    first = Busy(str(tmp_path))
    with pytest.raises(ConfigError, match=f"another watch \\(pid {os.getpid()}\\) is writing here"):
        Busy(str(tmp_path))
    first.release()
    Busy(str(tmp_path)).release()


def test_a_left_server_of_another_base_or_silent_is_stopped(tmp_path):
    import subprocess
    import threading

    from serving.watch import SERVER, adopt_server

    for base in ("other", "base"):  # another base: stopped at once; this base but not answering: after the wait
        proc = subprocess.Popen(["sleep", "120"], start_new_session=True)
        reaper = threading.Thread(target=proc.wait)  # as init reaps a killed watch's server
        reaper.start()
        (tmp_path / SERVER).write_text(json.dumps({"pid": proc.pid, "url": "http://127.0.0.1:9",
                                                   "base": str(tmp_path / base)}))
        lines = []
        assert adopt_server(str(tmp_path), str(tmp_path / "base"), lines.append, timeout=1.0) is None
        reaper.join(timeout=30)
        assert proc.returncode is not None and proc.returncode != 0 and not (tmp_path / SERVER).exists()
        assert len(lines) == 1 and "stopping the server a killed watch left" in lines[0]


def test_a_server_gone_mid_step_is_exit_9(tmp_path, monkeypatch):
    from ckptbridge.errors import InputNotFoundError
    from serving import watch as watch_mod
    from serving.server import free_port

    root = tmp_path / "run" / "checkpoints"
    _step(str(root), 3)
    w = watch_mod.Watch(str(tmp_path / "run"), str(tmp_path / "base"), str(tmp_path), str(tmp_path / "out"))

    def fails(self, server, rows):  # what generate or the probe raise when the server stops answering mid-way
        raise InputNotFoundError("http://127.0.0.1:1/v1/completions: connection refused")

    monkeypatch.setattr(watch_mod.Watch, "pass_once", fails)
    with pytest.raises(watch_mod.ServerGone, match="went away; the 0 row\\(s\\) so far are in"):
        watch_mod.watch(w, server_url=f"http://127.0.0.1:{free_port()}", once=True)
    watch_mod.Busy(str(tmp_path / "out")).release()  # the lock was let go


# --------------------------------------------------------------------------- the whole loop (vLLM on the CPU)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(ROOT, "training", "data_files", "codev_sample.jsonl")


def _rows(out):
    path = os.path.join(out, "watch.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


@pytest.mark.slow
@pytest.mark.pinned_only
def test_watch_scores_every_checkpoint_of_a_run_as_it_lands(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from test_serving_server import short_problems

    from ckptbridge.specs.gemma4 import VLLM_DIMS
    from ckptbridge.testing import build_checkpoint
    from serving.profiles import SERVE_PYTHON

    if not os.path.exists(SERVE_PYTHON):
        pytest.skip("no .venv-serve: run scripts/setup.sh")
    base = build_checkpoint(str(tmp_path / "tiny-gemma4"), prefix="model.", max_position_embeddings=256, **VLLM_DIMS)
    problems = short_problems(tmp_path)
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "watch")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with open(tmp_path / "train.log", "w") as log:
        args = ["--preset", "tiny-cpu", "--quiet", "--base", base, "--data", SAMPLE, "--out", run_dir, "--max-steps",
                "4", "grad_accum=1", "micro_batch=1", "max_length=256", "checkpoint_every=1", "keep_checkpoints=4",
                "learning_rate=5e-3", "warmup_steps=2"]
        training = subprocess.Popen([sys.executable, "-m", "training", *args], cwd=ROOT, env=env, stdout=log,
                                    stderr=log)
    watch = ["python", "-m", "serving", "watch", run_dir, "--base", base, "--problems", problems, "--out", out,
             "--samples", "2", "--k", "1,2", "--max-tokens", "24", "--poll", "0.5"]
    watch[0] = sys.executable

    def start():
        return subprocess.Popen(watch, cwd=ROOT, env=env, stdout=open(tmp_path / "watch.out", "a"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    deadline = time.time() + 900
    while not os.path.exists(os.path.join(run_dir, "config.json")) and training.poll() is None:
        time.sleep(0.2)  # the run is there (a RUN_DIR that is not one is refused)
    first = start()
    while time.time() < deadline and len(_rows(out)) < 2 and first.poll() is None:
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)  # after its second row
    first.wait()
    before = _rows(out)
    assert len(before) >= 2, open(tmp_path / "watch.out").read()[-3000:]
    scored = {r["step"]: os.stat(os.path.join(out, "scores", f"step-{r['step']}.json")).st_mtime_ns for r in before}
    second = start()
    assert second.wait(timeout=900) == 0, open(tmp_path / "watch.out").read()[-3000:]
    assert training.wait(timeout=600) == 0, open(tmp_path / "train.log").read()[-3000:]
    rows = _rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # each once, in order
    assert rows[: len(before)] == before  # not scored again
    assert all(os.stat(os.path.join(out, "scores", f"step-{k}.json")).st_mtime_ns == t for k, t in scored.items())
    # warmup: the first update has learning rate 0, so step 1's adapter is the base (scored, with a line)
    assert [r["changes_model"] for r in rows] == [False, True, True, True]
    for r in rows:
        assert r["served_parity"] == "equal", r
        assert 0 <= r["pass@1"] <= r["pass@2"] <= 1 and r["loss"] > 0 and r["seconds_commit_to_score"] >= 0
        assert os.path.isfile(os.path.join(r["adapter"], "adapter_config.json"))
    server_log = open(os.path.join(out, "server.log")).read()
    assert server_log.count("non-default args") == 1  # one vLLM start: the restart used the server left running
    # which logs on by itself after its watch was killed: all four loads are in its log
    assert server_log.count('"POST /v1/load_lora_adapter HTTP/1.1" 200') >= 4
    best = json.load(open(os.path.join(out, "best.json")))
    top = max(rows, key=lambda r: (r["pass@1"], -r["loss"]))
    assert best["step"] == top["step"] and os.path.isfile(os.path.join(out, "watch.png"))
    assert not os.path.exists(os.path.join(out, "server.json"))  # stopped at the end
    text = open(tmp_path / "watch.out").read()
    assert "using the server the last watch left running" in text and "step 4: loss" in text
    assert "step 1: the adapter changes nothing yet" in text

    # --once on the finished run scores only what has no row
    with open(os.path.join(out, "watch.jsonl"), "w") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rows[:3])
    proc = subprocess.run(watch + ["--once"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 checkpoint(s) scored" in proc.stdout and "step 4: loss" in proc.stdout
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]


def test_watch_refuses_what_is_not_a_run(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "serving", "watch", str(tmp_path), "--base", str(tmp_path), "--out",
                           str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and "not a training run" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.pinned_only
def test_a_server_that_goes_away_is_one_line_and_exit_9(adapters, tmp_path):
    import shutil
    import subprocess
    import sys

    from serving.server import free_port

    row = adapters["keqv_text_bf16_single"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(row.tunix, run_dir / "checkpoints")  # a Tunix CheckpointManager tree, step 3
    (run_dir / "config.json").write_text("{}")
    out = tmp_path / "out"
    argv = ["watch", str(run_dir), "--base", row.base, "--out", str(out), "--server",
            f"http://127.0.0.1:{free_port()}", "--once"]
    proc = subprocess.run([sys.executable, "-m", "serving", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 9, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "went away" in last and "the 0 row(s) so far are in" in last, proc.stderr
    assert os.path.isdir(out / "adapters" / "step-3")  # exported before the server was asked


def test_runtime_lora_servers_and_the_profiles_watch_refuses(tmp_path):
    import subprocess
    import sys

    def serving(*argv):
        return subprocess.run([sys.executable, "-m", "serving", *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)

    ok = serving("serve", "--profile", "gpu-h100x2", "--model", "google/gemma-4-31b-it", "--runtime-lora",
                 "--max-lora-rank", "64", "--dry-run")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True vllm serve google/gemma-4-31b-it")
    assert "--enable-lora --max-lora-rank 64" in ok.stdout and "--lora-modules" not in ok.stdout
    for argv, text in ((["--profile", "gpu-h100x2"], "pass --max-lora-rank"),
                       (["--profile", "tpu-v6e-8", "--max-lora-rank", "64"], "serves no LoRA adapters")):
        bad = serving("serve", "--model", "google/gemma-4-31b-it", "--runtime-lora", "--dry-run", *argv)
        assert bad.returncode == 8 and text in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr

    run, base = tmp_path / "run", tmp_path / "base"
    for d in (run, base):
        d.mkdir()
        (d / "config.json").write_text("{}")
    for profile, text in (("tpu-v6e-8", "serves no LoRA adapters"),
                          ("gpu-h100x2", f"serving serve --profile gpu-h100x2 --model {base} --runtime-lora")):
        bad = serving("watch", str(run), "--base", str(base), "--out", str(tmp_path / "o"), "--profile", profile)
        assert bad.returncode == 8 and text in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    bad = serving("watch", str(run), "--base", str(base), "--out", str(tmp_path / "o"), "--k", "1,9")
    assert bad.returncode == 8 and "each k must be 1..--samples (5)" in bad.stderr
    assert not (tmp_path / "o").exists()  # refused before anything is written
