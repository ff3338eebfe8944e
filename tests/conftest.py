"""Fixtures: tiny random Gemma 4 checkpoints written by transformers' save_pretrained.

Built once per session. All dims distinct (see ckptbridge.testing.TINY_DIMS); random norms
and layer scalars; k_eq_v and plain global layers; both key prefixes; one file and 2 shards.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CASES = {
    # name: build_checkpoint kwargs
    "keqv_lm_f32_sharded": dict(attention_k_eq_v=True, prefix="model.language_model.", dtype="float32", shards=2),
    "keqv_text_bf16_single": dict(attention_k_eq_v=True, prefix="model.", dtype="bfloat16", shards=1),
    "kv_text_f32_sharded": dict(attention_k_eq_v=False, prefix="model.", dtype="float32", shards=2),
    "kv_lm_bf16_sharded": dict(attention_k_eq_v=False, prefix="model.language_model.", dtype="bfloat16", shards=2),
}


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> path of a tiny HF checkpoint, built lazily and cached for the session."""
    from ckptbridge.testing import build_checkpoint

    root = tmp_path_factory.mktemp("hf")
    built: dict[str, str] = {}

    class Lazy(dict):
        def __missing__(self, name):
            path = str(root / name)
            build_checkpoint(path, seed=len(built), **CASES[name])
            built[name] = path
            self[name] = path
            return path

    return Lazy()


def tree_hash(path: str) -> str:
    """Hash of every file's relative path and bytes under ``path`` (inputs must stay untouched)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(path)):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            h.update(os.path.relpath(full, path).encode())
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def run_cli(*args: str, timeout: int = 300, env: dict | None = None,
            python: str = sys.executable) -> subprocess.CompletedProcess:
    """Run the ckptbridge CLI in a fresh process (``python``: another environment's), with
    ``env`` added to the environment."""
    return subprocess.run(
        [python, "-m", "ckptbridge", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )


def start_server(base: str, adapters: dict, tmp, *extra: str):
    """``python -m serving serve`` (cpu profile, float32) on ``base`` with ``adapters`` (name ->
    dir), waited for until it says ``serving``. Returns (process, url, log, stderr path)."""
    import time

    from serving.server import free_port

    port = free_port()
    log, err = str(tmp / "server.log"), str(tmp / "serve.stderr")
    proc = subprocess.Popen([sys.executable, "-m", "serving", "serve", "--profile", "cpu", "--model", base,
                             *[a for name, path in adapters.items() for a in ("--adapter", f"{name}={path}")],
                             *extra, "--port", str(port), "--log", log, "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=open(err, "w"), text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("serving ") or proc.poll() is not None:
            break
    assert proc.poll() is None, open(err).read()[-3000:] + (open(log).read()[-3000:] if os.path.exists(log) else "")
    return proc, f"http://127.0.0.1:{port}", log, err


def stop_server(proc) -> None:
    """SIGTERM lets `serving serve` stop vLLM's whole process group."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def flat_state(module) -> dict:
    """An nnx module's parameters as {path tuple of str: leaf} (leaves as nnx gives them)."""
    from flax import nnx

    flat = {}

    def walk(node, prefix=()):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, prefix + (str(key),))
        else:
            flat[prefix] = node

    walk(nnx.state(module).to_pure_dict())
    return flat
