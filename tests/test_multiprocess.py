"""One run trained by two processes with two CPU devices each, through JAX's multi-process
runtime (its coordinator, gloo collectives), against one process with four devices: the same
losses and LoRA factors, the same exported adapter, a killed peer named in one line, a resume of
both from the last committed checkpoint, and a last micro-batch that does not fill up."""

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from training import data as data_lib
from training.trainer import read_metrics

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training", "data_files",
                      "codev_sample.jsonl")
PEER_TIMEOUT = 10


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Tiny Gemma 4 (float32 in the tiny-cpu preset) whose heads divide by 2 on every layer."""
    from ckptbridge.testing import build_checkpoint

    return build_checkpoint(str(tmp_path_factory.mktemp("mp") / "hf"), num_attention_heads=8, num_key_value_heads=4,
                            num_global_key_value_heads=4, num_hidden_layers=2,
                            layer_types=["sliding_attention", "full_attention"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    """``python -m training --preset tiny-cpu`` in ``processes`` processes of 4/processes CPU
    devices each, their output in files (never a full pipe)."""

    def __init__(self, out: str, base: str, processes: int, *settings: str, peer_timeout: int | None = PEER_TIMEOUT):
        import tempfile

        self.out = out
        devices = 4 // processes
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        cmd = [sys.executable, "-m", "training", "--preset", "tiny-cpu", "--quiet", "--base", base, "--data", SAMPLE,
               "--out", out, "max_length=256", "grad_accum=1", "learning_rate=5e-3", "checkpoint_every=1",
               "keep_checkpoints=2", *settings]
        port = _free_port()
        self.procs, self.files = [], []
        for i in range(processes):
            files = (tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))
            extra = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes), "--process-id", str(i),
                     *(["--peer-timeout", str(peer_timeout)] if peer_timeout else [])] if processes > 1 else []
            self.procs.append(subprocess.Popen([*cmd, *extra], stdout=files[0], stderr=files[1], text=True, env=env))
            self.files.append(files)

    def wait(self, timeout: float = 300) -> list[tuple[int, str, str]]:
        """(exit code, stdout, stderr) of each process."""
        deadline = time.time() + timeout
        out = []
        for proc, (o, e) in zip(self.procs, self.files):
            try:
                proc.wait(timeout=max(1.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                for p in self.procs:
                    p.kill()
                proc.wait()
            o.seek(0)
            e.seek(0)
            out.append((proc.returncode, o.read(), e.read()))
        return out

    def metrics(self) -> list[dict]:
        path = os.path.join(self.out, "metrics.jsonl")
        return read_metrics(path) if os.path.isfile(path) else []


def _ok(results) -> None:
    for i, (code, _, err) in enumerate(results):
        assert code == 0, f"process {i}: exit {code}\n{err[-3000:]}"


def _export(run_dir: str, dst: str, base: str) -> bytes:
    """The bytes of the adapter file ``convert orbax-to-peft`` writes of the run's last checkpoint,
    with the checkpoint's path it records (``source``) blanked."""
    import struct

    from ckptbridge import convert_orbax_to_peft

    convert_orbax_to_peft(os.path.join(run_dir, "checkpoints"), dst, base=base, progress=False)
    with open(os.path.join(dst, "adapter_model.safetensors"), "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    source = os.path.join(run_dir, "checkpoints").encode()  # run directories named alike: the same length
    return data[:8] + data[8:8 + n].replace(source, b"-" * len(source)) + data[8 + n:]


def test_the_rows_of_each_process_make_the_global_batch():
    """The pipeline's micro-batches are all ``batch`` rows (the last filled with empty rows, its
    real tokens counted as they are), and the rows each process keeps make them up."""
    examples = [{"tokens": np.arange(1, n + 1, dtype=np.int32), "loss_mask": np.ones(n, np.int32)}
                for n in (5, 9, 3, 7, 4, 8, 6)]
    kw = dict(seq_len=16, batch=4, packing=False, seed=0)
    whole = list(data_lib.pipeline(examples, **kw))
    assert [len(b["tokens"]) for b in whole] == [4, 4]
    assert [int(b["filler_rows"]) for b in whole] == [0, 1]
    assert not whole[-1]["segment_ids"][-1].any() and not whole[-1]["loss_mask"][-1].any()
    assert sum(int(b["real_tokens"]) for b in whole) == sum(len(e["tokens"]) for e in examples)
    assert data_lib.count_batches(examples, **kw) == (2, 42)
    halves = [list(data_lib.pipeline(examples, **kw, rows=rows)) for rows in ((0, 2), (2, 4))]
    for b, first, second in zip(whole, *halves):
        for key in ("tokens", "loss_mask", "segment_ids", "positions"):
            np.testing.assert_array_equal(np.concatenate([first[key], second[key]]), b[key])
        assert int(first["real_tokens"]) == int(second["real_tokens"]) == int(b["real_tokens"])


@pytest.mark.slow
@pytest.mark.pinned_only
def test_two_processes_train_as_one(base, tmp_path):
    """fsdp=2 x tp=2 and fsdp=4 over 2 processes x 2 devices, against one process with 4 devices
    (micro-batch 4 = 2 processes x 2): the same losses within 1e-6 relative to the end of the
    epoch, whose last micro-batch is filled up.

    fsdp=2 x tp=2 (tp inside a process, fsdp across the two): its adapter export equals the
    one-process run's of the same mesh byte for byte. fsdp=4 spans the processes with 4 members,
    and gloo sums them in another order than XLA's in-process collectives: the factors agree within
    1e-5 relative (2.3e-6 measured), as fsdp=2 x tp=2's do with fsdp=4's.

    Then process 1 of the fsdp=4 run, with the default timeouts, is killed right after the first
    checkpoint commits: process 0 stops within seconds with one line naming it (exit 9); both
    started again resume from the last committed checkpoint and end with the losses of the
    uninterrupted run."""
    from safetensors.numpy import load_file

    one = Run(str(tmp_path / "one"), base, 1, "fsdp=4", "tp=1", "micro_batch=4")
    _ok(one.wait())
    ref = one.metrics()
    assert len(ref) >= 3 and ref[-1]["filler_rows"] > 0 and not any(r["filler_rows"] for r in ref[:-1])
    _export(one.out, str(tmp_path / "one-adapter"), base)
    one_tp = Run(str(tmp_path / "otp"), base, 1, "fsdp=2", "tp=2", "micro_batch=4")
    _ok(one_tp.wait())
    np.testing.assert_allclose([r["loss"] for r in one_tp.metrics()], [r["loss"] for r in ref], rtol=1e-6)
    ref_tp_bytes = _export(one_tp.out, str(tmp_path / "otp-adapter"), base)

    # fsdp=2 x tp=2 across the two processes, uninterrupted
    tp = Run(str(tmp_path / "tp2"), base, 2, "fsdp=2", "tp=2", "micro_batch=2")
    results = tp.wait()
    _ok(results)
    assert "[process 1/2]" in results[1][2] and "process 1 of 2" in results[1][2]
    got = tp.metrics()
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    assert [(r["tokens"], r["loss_tokens"], r["filler_rows"]) for r in got] == \
        [(r["tokens"], r["loss_tokens"], r["filler_rows"]) for r in ref]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-6)
    assert _export(tp.out, str(tmp_path / "tp2-adapter"), base) == ref_tp_bytes
    fsdp, tp_factors = (load_file(str(tmp_path / f"{n}-adapter" / "adapter_model.safetensors")) for n in ("one", "tp2"))
    for key, value in fsdp.items():
        assert np.linalg.norm(tp_factors[key] - value) <= 1e-5 * np.linalg.norm(value), key

    # fsdp=4 across the two processes, the default timeouts: process 1 killed right after the first
    # checkpoint commits; process 0's next collective fails, and it ends at once with one line
    run_dir = str(tmp_path / "two")
    killed = Run(run_dir, base, 2, "fsdp=4", "tp=1", "micro_batch=2", peer_timeout=None)
    committed = os.path.join(run_dir, "checkpoints", "1")
    deadline = time.time() + 300
    while time.time() < deadline and not os.path.isdir(committed) and killed.procs[0].poll() is None:
        time.sleep(0.02)
    assert os.path.isdir(committed), killed.wait()[0][2][-3000:]
    killed.procs[1].send_signal(signal.SIGKILL)
    t_kill = time.time()
    (code0, _, err0), (code1, _, _) = killed.wait(timeout=90)
    waited = time.time() - t_kill
    assert code1 == -signal.SIGKILL and code0 == 9, err0[-3000:]
    assert waited < 60, waited  # not JAX's shutdown barrier (123 s), nor the default peer timeout (180 s)
    last = err0.strip().splitlines()[-1]
    assert last.startswith("training: error: process 1 of 2 ended without finishing: its connection to this "
                           "process closed (seen from process 0)"), last
    assert "Traceback" not in err0, err0[-3000:]
    assert len(killed.metrics()) < len(ref)

    again = Run(run_dir, base, 2, "fsdp=4", "tp=1", "micro_batch=2")
    results = again.wait()
    _ok(results)
    assert all("resumed from step" in err for _, _, err in results)
    got = again.metrics()
    assert [r["step"] for r in got] == [r["step"] for r in ref]
    assert [(r["tokens"], r["loss_tokens"]) for r in got] == [(r["tokens"], r["loss_tokens"]) for r in ref]
    np.testing.assert_allclose([r["loss"] for r in got], [r["loss"] for r in ref], rtol=1e-6)
    _export(run_dir, str(tmp_path / "two-adapter"), base)
    resumed = load_file(str(tmp_path / "two-adapter" / "adapter_model.safetensors"))
    assert resumed.keys() == fsdp.keys()
    for key, value in fsdp.items():
        assert np.linalg.norm(resumed[key] - value) <= 1e-5 * np.linalg.norm(value), key


def test_half_a_cluster_is_named():
    """Flags or JAX's variables that describe part of a run of several processes: one line each."""
    from ckptbridge.errors import ConfigError
    from training.distributed import cluster_of

    assert cluster_of(environ={}) is None
    assert cluster_of(environ={"TPU_WORKER_HOSTNAMES": "a,b"}).source == "tpu"
    c = cluster_of(environ={"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"})
    assert (c.coordinator, c.num_processes, c.process_id, c.source) == ("h:1", 2, 1, "environment")
    for kwargs, env, says in (
            ({}, {"JAX_COORDINATOR_ADDRESS": "h:1"}, "JAX_NUM_PROCESSES, JAX_PROCESS_ID missing"),
            ({"coordinator": "h:1", "num_processes": 2}, {}, "--process-id missing"),
            ({"coordinator": "h", "num_processes": 2, "process_id": 0}, {}, "--coordinator h: write it as HOST:PORT"),
            ({"coordinator": "h:1", "num_processes": 2, "process_id": 2}, {}, "the index runs from 0 to 1"),
            ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
             "must be whole numbers")):
        with pytest.raises(ConfigError, match=says):
            cluster_of(**kwargs, environ=env)


def test_jax_keeps_its_coordinator_client_where_the_peer_watch_reads_it():
    """training/distributed.py reads JAX's key-value client from ``jax._src.distributed``: this
    fails if JAX moves it or its methods."""
    from jax._src import distributed

    assert hasattr(distributed.global_state, "client")
    from jax._src.lib import _jax

    for method in ("key_value_set", "key_value_dir_get"):
        assert hasattr(_jax.DistributedRuntimeClient, method)


def test_the_peer_watch_names_a_silent_peer_and_a_failed_collectives_lost_one(monkeypatch, capsys):
    """The watch over a key-value store like the coordinator's: a peer that never counts, or stops
    counting, ends this process with one line naming it (exit 9) once the timeout has passed; after
    a failed collective, the peer whose connection closed or whose counter stands still is named at
    once, and an error of this process's own (every peer counting) is left to end the run as it
    would."""
    from training import distributed

    store: dict = {}

    class Client:
        down = False

        def key_value_set(self, key, value, allow_overwrite=False):
            if self.down:
                raise RuntimeError("UNAVAILABLE")
            store[key] = value

        def key_value_dir_get(self, prefix):
            if self.down:
                raise RuntimeError("UNAVAILABLE")
            store[f"{distributed._KEY}2"] = str(time.monotonic())  # process 2 keeps counting
            return [(k, v) for k, v in store.items() if k.startswith(prefix)]

    client = Client()
    monkeypatch.setattr(distributed, "_client", lambda: client)

    def exit_(code):
        raise SystemExit(code)

    monkeypatch.setattr(distributed.os, "_exit", exit_)
    watch = distributed.PeerWatch(0, 3, timeout=0.5, coordinator="h:1", interval=0.05)
    with pytest.raises(SystemExit) as e:
        watch._run()
    assert e.value.code == distributed.PEER_LOST_EXIT
    assert capsys.readouterr().err.startswith("training: error: process 1 of 3 never started its heartbeat for 0 s")

    store[f"{distributed._KEY}1"] = "7"  # counted once, then stopped
    assert watch.find_lost(beats=1) == (1, "stopped: a collective failed and its heartbeat stood still for 1 s")
    monkeypatch.setattr(distributed, "_watch", watch)
    with pytest.raises(SystemExit) as e:
        distributed.end_if_peer_lost(RuntimeError("UNKNOWN: Gloo AllGather failed: Connection reset by peer\nmore"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 9 and len(lines) == 1
    assert lines[0].startswith("training: error: process 1 of 3 stopped: a collective failed") and \
        "(RuntimeError: UNKNOWN: Gloo AllGather failed: Connection reset by peer)" in lines[0], lines[0]

    watch.links._closed.add(1)  # its connection closed: named at once
    assert watch.find_lost(beats=1) == (1, distributed.LINK_CLOSED)
    store[f"{distributed._DONE}1"] = "1"  # finished: not lost; every other peer counting
    distributed.end_if_peer_lost(ValueError("this process's own"))
    assert capsys.readouterr().err == ""
    client.down = True  # the coordinator's store gone
    assert watch.find_lost(beats=1)[0] == 0
