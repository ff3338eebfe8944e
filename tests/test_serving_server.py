"""A real vLLM server (cpu profile, started by `python -m serving serve` with no --max-model-len) on
a tiny Gemma 4 whose config says max_position_embeddings 256, serving LoRA adapters converted by
ckptbridge: the length defaults to the model's limit; `ckptbridge verify served` finds the
`--target vllm` adapter equal to transformers+PEFT and the transformers-bound one divergent; vLLM
honours rank/alpha patterns; bench and eval run against it; unknown adapters fail cleanly; a failed
start names vLLM's reason; SIGTERM stops it cleanly."""

import json
import os
import signal
import subprocess
import sys

import httpx
import numpy as np
import pytest

from serving.profiles import SERVE_PYTHON
from serving.server import free_port

from conftest import run_cli, start_server, stop_server

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(SERVE_PYTHON), reason="no .venv-serve: run scripts/setup.sh")]
PATTERN_TARGETS = r"model\.layers\.\d+\.(?:self_attn\.(?:q_proj|o_proj)|mlp\.(?:gate_proj|up_proj|down_proj))"


def run_serving(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "serving", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import jax

    from ckptbridge import convert_orbax_to_peft
    from ckptbridge.specs.gemma4 import VLLM_DIMS
    from ckptbridge.testing import (lora_targets, build_checkpoint, build_peft_adapter, build_tunix_lora,
                                    save_tunix_lora)

    jax.config.update("jax_default_matmul_precision", "highest")
    tmp = tmp_path_factory.mktemp("serve")
    base = build_checkpoint(str(tmp / "tiny-gemma4"), prefix="model.", max_position_embeddings=256, **VLLM_DIMS)
    model, rules = build_tunix_lora(base, [{"module_path": lora_targets(), "rank": 8, "alpha": 16.0}], seed=1, scale=1.0)
    root = save_tunix_lora(model, str(tmp / "ckpt"), custom_metadata={
        "ckptbridge": {"family": "gemma4", "kind": "lora", "lora": {"rules": rules}}})
    adapters = {t: str(tmp / f"adapter-{t}") for t in ("hf", "vllm")}
    for target, path in adapters.items():
        convert_orbax_to_peft(root, path, base=base, target=target, progress=False)
    # made by PEFT, no k_proj (so no k_eq_v question), down_proj at its own rank and alpha
    adapters["pattern"] = build_peft_adapter(base, str(tmp / "adapter-pattern"), r=4, lora_alpha=10, seed=5, scale=1.0,
                                             target_modules=PATTERN_TARGETS, rank_pattern={"down_proj": 8},
                                             alpha_pattern={"down_proj": 3})
    named = {"ft": adapters["vllm"], "ft-hf": adapters["hf"], "ft-pattern": adapters["pattern"]}
    proc, url, log, err = start_server(base, named, tmp, "--no-adapter-check")
    info = {"url": url, "base": base, "adapters": adapters, "proc": proc, "log": log, "stderr": err, "tmp": tmp,
            "name": "tiny-gemma4", "root": root}
    yield info
    stop_server(proc)


def completion_ids(url, model, ids, n):
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": ids, "max_tokens": n, "min_tokens": n,
                                                  "temperature": 0.0, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_max_model_len_defaults_to_the_models_limit(server):
    err = open(server["stderr"]).read()
    assert "max model length 256: the model's limit (max_position_embeddings in" in err
    assert "vLLM will compute in float32 (--dtype float32; checkpoint float32)" in err
    models = httpx.get(f"{server['url']}/v1/models", timeout=30).json()["data"]
    assert {m["id"] for m in models} == {"tiny-gemma4", "ft", "ft-hf", "ft-pattern"}
    assert next(m for m in models if m["id"] == "tiny-gemma4")["max_model_len"] == 256
    log = open(server["log"]).read()
    assert "dtype=torch.float32" in log and "max_seq_len=256" in log  # what vLLM itself reports
    # --no-adapter-check printed what it let through
    assert "error: --adapter ft-hf:" in err and "v_proj copies" in err


def test_adapter_tokens_equal_hf_peft(server):
    from ckptbridge.verify import hf_greedy

    ids = [int(x) for x in np.random.default_rng(0).integers(3, 512, size=10)]
    n = 16
    base_tokens = completion_ids(server["url"], server["name"], ids, n)
    ft_tokens = completion_ids(server["url"], "ft", ids, n)
    assert base_tokens != ft_tokens  # the adapter is applied
    assert base_tokens == hf_greedy(server["base"], None, ids, n)
    assert ft_tokens == hf_greedy(server["base"], server["adapters"]["hf"], ids, n)


def test_verify_served(server):
    common = ["verify", "served", "--url", server["url"], "--base", server["base"], "--tokens", "16", "--json"]
    proc = run_cli(*common, "--model", "ft", "--adapter", server["adapters"]["hf"], timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["equal"] and r["first_divergence"] is None and r["server"] == r["reference"] and len(r["server"]) == 16
    # the transformers-bound export, served by vLLM: K gets the LoRA on k_eq_v layers, V does not
    proc = run_cli(*common, "--model", "ft-hf", "--adapter", server["adapters"]["hf"], timeout=600)
    assert proc.returncode == 6, proc.stderr
    r = json.loads(proc.stdout)
    assert not r["equal"] and 0 <= r["first_divergence"] < 16
    assert r["server"][:r["first_divergence"]] == r["reference"][:r["first_divergence"]]
    text = run_cli(*common[:-1], "--model", "ft-hf", "--adapter", server["root"], timeout=600)  # Orbax form
    assert text.returncode == 6 and f"at position {r['first_divergence']} of 16" in text.stdout
    # the base alone
    proc = run_cli(*common, "--model", server["name"], timeout=600)
    assert proc.returncode == 0 and json.loads(proc.stdout)["equal"]


def test_vllm_honours_rank_and_alpha_patterns(server, tmp_path):
    import shutil

    from ckptbridge.verify import hf_greedy, served_parity

    r = served_parity(server["url"], "ft-pattern", server["base"], adapter=server["adapters"]["pattern"], tokens=16)
    assert r.equal, r
    # the patterns matter: without them transformers+PEFT computes other tokens
    flat = str(tmp_path / "flat")
    shutil.copytree(server["adapters"]["pattern"], flat)
    cfg = json.load(open(os.path.join(flat, "adapter_config.json")))
    cfg["alpha_pattern"] = {}
    json.dump(cfg, open(os.path.join(flat, "adapter_config.json"), "w"))
    assert hf_greedy(server["base"], flat, r.prompt_ids, 16) != r.server


def test_failed_start_names_vllms_reason(server, tmp_path):
    # a length above the model's limit, slipped past the check as a raw vLLM flag: vLLM refuses it
    log = str(tmp_path / "fail.log")
    r = run_serving("serve", "--profile", "cpu", "--model", server["base"], "--port", str(free_port()), "--log", log,
                    "--vllm-arg=--max-model-len=4096")
    assert r.returncode == 9
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("serving: error: vLLM exited with code 1 while starting: User-specified "
                                "max_model_len (4096) is greater than the derived max_model_len"), r.stderr
    assert lines[-1].endswith(f"(full log: {log})") and "Traceback" in open(log).read()


def test_unknown_adapter_is_a_clean_http_error(server):
    r = httpx.post(f"{server['url']}/v1/completions", json={"model": "nope", "prompt": "hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
    assert completion_ids(server["url"], "ft", [5, 6, 7], 2)  # still serving


def test_bench_sweep_returns_complete_figures(server, tmp_path):
    out = tmp_path / "bench"
    r = run_serving("bench", "--url", server["url"], "--model", "ft", "--qps", "4,inf", "--shapes", "32x16,64x8",
                    "--num-prompts", "6", "--out", str(out), "--usd-per-hour", "21.52", "--train-cost", "56.11",
                    "--model-dir", server["base"])
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((out / "bench.json").read_text())
    assert result["weights"]["quantization"] is None and list(result["weights"]["dtypes"]) == ["F32"]
    assert "not quantized)" in r.stdout
    assert len(result["points"]) == 4
    for p in result["points"]:
        assert (p["completed"], p["failed"]) == (6, 0)
        assert p["output_tokens"] == 6 * p["output_len"] and p["input_tokens"] == 6 * p["input_len"]
        assert p["total_tok_s"] > p["output_tok_s"] > 0 and p["peak_output_tok_s"] > 0
        assert 0 < p["median_ttft_ms"] <= p["p99_ttft_ms"] < p["duration_s"] * 1000
        # tokens that reach the client in one read share their arrival time: on a starved 2-core
        # machine a short request's tokens can all come at once (TPOT 0, no inter-token gap to measure)
        assert 0 <= p["median_tpot_ms"] < 10_000 and (p["p99_itl_ms"] is None or p["p99_itl_ms"] > 0)
        assert p["usd_per_1m_output_tokens"] == pytest.approx(21.52 / (p["output_tok_s"] * 3600 / 1e6))
    assert any(p["median_tpot_ms"] > 0 and p["p99_itl_ms"] for p in result["points"])  # streaming was measured
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


def short_problems(tmp_path) -> str:
    """The bundled problems with one-line specs, so that prompts fit the model's 256 tokens."""
    import shutil

    from serving.evaluate import BUNDLED_PROBLEMS, list_problems

    out = tmp_path / "problems"
    out.mkdir()
    for task, paths in list_problems(BUNDLED_PROBLEMS, need_tests=True).items():
        (out / f"{task}_prompt.txt").write_text(f"Implement {task.split('_', 1)[1]} as TopModule.\n")
        for kind in ("ref", "test"):
            shutil.copy(paths[kind], out / os.path.basename(paths[kind]))
    return str(out)


def test_eval_generate_resumes_and_scores(server, tmp_path):
    samples = tmp_path / "samples.jsonl"
    problems = short_problems(tmp_path)
    common = ["eval", "generate", "--url", server["url"], "--model", "ft", "--out", str(samples), "--max-tokens", "24",
              "--problems", problems]
    r = run_serving(*common, "--n", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    first = samples.read_text().splitlines()
    r = run_serving(*common, "--n", "2")
    assert r.returncode == 0 and "6 new samples" in r.stdout
    lines = samples.read_text().splitlines()
    assert lines[: len(first)] == first and len(lines) == 2 * len(first) == 12
    result = tmp_path / "result.json"
    r = run_serving("eval", "score", "--samples", str(samples), "--out", str(result), "--k", "1,2", "--problems",
                    problems)
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
