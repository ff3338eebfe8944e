"""A real vLLM server (cpu profile, started by `python -m serving serve`) on a tiny Gemma 4 with a
LoRA adapter converted by ckptbridge: adapter tokens equal HF+PEFT, bench and eval against it,
unknown adapters fail cleanly, SIGTERM stops it cleanly."""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from serving.profiles import SERVE_PYTHON
from serving.server import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(SERVE_PYTHON), reason="no .venv-serve: run scripts/setup.sh")]



def run_serving(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "serving", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import jax

    from ckptbridge.adapters import convert_orbax_to_peft
    from ckptbridge.testing import LORA_TARGETS, VLLM_DIMS, build_checkpoint, build_tunix_lora, save_tunix_lora

    jax.config.update("jax_default_matmul_precision", "highest")
    tmp = tmp_path_factory.mktemp("serve")
    base = build_checkpoint(str(tmp / "tiny-gemma4"), prefix="model.", **VLLM_DIMS)
    model, rules = build_tunix_lora(base, [{"module_path": LORA_TARGETS, "rank": 8, "alpha": 16.0}], seed=1, scale=1.0)
    root = save_tunix_lora(model, str(tmp / "ckpt"), custom_metadata={
        "ckptbridge": {"family": "gemma4", "kind": "lora", "lora": {"rules": rules}}})
    adapters = {t: str(tmp / f"adapter-{t}") for t in ("hf", "vllm")}
    for target, path in adapters.items():
        convert_orbax_to_peft(root, path, base=base, target=target, progress=False)
    port = free_port()
    log = str(tmp / "server.log")
    proc = subprocess.Popen([sys.executable, "-m", "serving", "serve", "--profile", "cpu", "--model", base,
                             "--adapter", f"ft={adapters['vllm']}", "--port", str(port), "--log", log,
                             "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("serving ") or proc.poll() is not None:
            break
    assert proc.poll() is None, proc.stderr.read()[-3000:] + open(log).read()[-3000:]
    info = {"url": url, "base": base, "adapters": adapters, "proc": proc, "log": log, "tmp": tmp, "name": "tiny-gemma4"}
    yield info
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def completion_ids(url, model, ids, n):
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": n, "min_tokens": n,
                                                  "temperature": 0.0, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_adapter_tokens_equal_hf_peft(server):
    from ckptbridge.verify import hf_greedy

    ids = [int(x) for x in np.random.default_rng(0).integers(3, 512, size=10)]
    n = 16
    base_tokens = completion_ids(server["url"], server["name"], ids, n)
    ft_tokens = completion_ids(server["url"], "ft", ids, n)
    assert base_tokens != ft_tokens  # the adapter is applied
    assert base_tokens == hf_greedy(server["base"], None, ids, n)
    assert ft_tokens == hf_greedy(server["base"], server["adapters"]["hf"], ids, n)


def test_unknown_adapter_is_a_clean_http_error(server):
    r = httpx.post(f"{server['url']}/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    assert completion_ids(server["url"], "ft", [5, 6, 7], 2)  # still serving


def test_bench_sweep_returns_complete_figures(server, tmp_path):
    out = tmp_path / "bench"
    r = run_serving("bench", "--url", server["url"], "--model", "ft", "--qps", "4,inf", "--shapes", "32x16,64x8",
                    "--num-prompts", "6", "--out", str(out), "--usd-per-hour", "21.52", "--train-cost", "56.11")
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert len(result["points"]) == 4
    for p in result["points"]:
        assert (p["completed"], p["failed"]) == (6, 0)
        assert p["output_tokens"] == 6 * p["output_len"] and p["input_tokens"] == 6 * p["input_len"]
        assert p["total_tok_s"] > p["output_tok_s"] > 0 and p["peak_output_tok_s"] > 0
        assert 0 < p["median_ttft_ms"] <= p["p99_ttft_ms"] < p["duration_s"] * 1000
        assert 0 < p["median_tpot_ms"] < 10_000 and p["p99_itl_ms"] > 0
        assert p["usd_per_1m_output_tokens"] == pytest.approx(21.52 / (p["output_tok_s"] * 3600 / 1e6))
    assert [round(t["total_usd"], 2) for t in result["tco"]] == [77.63, 228.27, 572.59]
    for name in ("bench.txt", "throughput_vs_qps.png", "ttft_vs_qps.png"):
        assert (out / name).stat().st_size > 0
    assert "TTFT p50" in r.stdout and "TCO" in r.stdout


def test_bench_at_concurrency_16_has_no_failures(server):
    r = run_serving("bench", "--url", server["url"], "--model", server["name"], "--qps", "inf", "--shapes", "48x24",
                    "--num-prompts", "32", "--max-concurrency", "16", "--json", "--fail-on-error")
    assert r.returncode == 0, r.stderr[-3000:]
    p = json.loads(r.stdout)["points"][0]
    assert (p["completed"], p["failed"]) == (32, 0) and p["output_tokens"] == 32 * 24


def test_eval_generate_resumes_and_scores(server, tmp_path):
    samples = tmp_path / "samples.jsonl"
    common = ["eval", "generate", "--url", server["url"], "--model", "ft", "--out", str(samples), "--max-tokens", "24"]
    r = run_serving(*common, "--n", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    first = samples.read_text().splitlines()
    r = run_serving(*common, "--n", "2")
    assert r.returncode == 0 and "6 new samples" in r.stdout
    lines = samples.read_text().splitlines()
    assert lines[: len(first)] == first and len(lines) == 2 * len(first) == 12
    result = tmp_path / "result.json"
    r = run_serving("eval", "score", "--samples", str(samples), "--out", str(result), "--k", "1,2")
    assert r.returncode == 0, r.stderr
    res = json.loads(result.read_text())
    assert res["num_samples"] == 12 and all(p["n"] == 2 for p in res["problems"].values())
    assert res["pass@1"] is not None and res["pass@2"] is not None


def test_serve_refuses_an_hf_target_adapter(server):
    r = run_serving("serve", "--profile", "cpu", "--model", server["base"], "--adapter",
                    f"ft={server['adapters']['hf']}", "--dry-run")
    assert r.returncode == 8 and "--target vllm" in r.stderr


def test_zz_sigterm_stops_the_server_cleanly(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert "server stopped" in out
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{server['url']}/v1/models", timeout=5)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert server["base"] not in ps  # no engine process left behind
