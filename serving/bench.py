"""Load benchmark for an OpenAI-compatible vLLM endpoint: a QPS sweep at several input/output shapes.

Each point sends ``num_prompts`` streaming ``/v1/completions`` requests whose prompts are random
token ids of exactly the input length (drawn from ids the server's own tokenizer produces) and
whose outputs are exactly the output length (``ignore_eos``, ``min_tokens``), arriving as a Poisson
process at the given rate (``inf``: all at once) rescaled so the last one leaves at
``num_prompts / qps``, as ``vllm bench serve`` does. Per point: output
and total tokens/s over the point's duration, peak output tokens/s (busiest 1 s), median and p99
TTFT, median TPOT ((latency - ttft) / (out - 1)), p99 inter-token latency, failed requests, and
$/1M output tokens at a given $/hour. Every request has a timeout and every point a deadline, so
a run always ends by itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import time

import numpy as np

from ckptbridge.errors import ConfigError, InputNotFoundError
from serving.cost import TCO_HOURS, cost_per_million, tco_table


@dataclasses.dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    sent: float = 0.0  # time.perf_counter() seconds
    ttft: float = 0.0
    latency: float = 0.0
    token_times: list[float] = dataclasses.field(default_factory=list)  # absolute, one per output token


def parse_shapes(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        try:
            a, b = part.lower().split("x")
            shapes.append((int(a), int(b)))
        except ValueError:
            raise ConfigError(f"--shapes: {part!r} is not INPUTxOUTPUT tokens (e.g. 512x256)") from None
        if shapes[-1][0] < 1 or shapes[-1][1] < 1:
            raise ConfigError(f"--shapes: {part!r}: both lengths must be at least 1")
    return shapes


def parse_qps(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        try:
            q = float(part)
        except ValueError:
            raise ConfigError(f"--qps: {part!r} is not a number (or inf)") from None
        if not q > 0:
            raise ConfigError(f"--qps: {part!r} must be positive")
        out.append(q)
    return out


def server_info(url: str, model: str) -> dict:
    """The served model's entry from /v1/models; a clear error when the name is not served."""
    import httpx

    try:
        r = httpx.get(f"{url}/v1/models", timeout=10)
        r.raise_for_status()
        data = r.json().get("data", [])
    except (httpx.HTTPError, ValueError) as e:
        raise InputNotFoundError(f"{url}: no OpenAI-compatible server answers ({e}); start one with "
                                 "`python -m serving serve` or check --url") from None
    ids = [m.get("id") for m in data]
    for m in data:
        if m.get("id") == model:
            return m
    raise ConfigError(f"{url}: serves {', '.join(map(str, ids)) or 'no model'}, not {model!r}; pass one of those as --model")


def token_pool(url: str, model: str, size: int = 4096, seed: int = 0) -> list[int]:
    """Token ids the server's tokenizer really produces (no special tokens), from its /tokenize."""
    import httpx

    rng = random.Random(seed)
    words = ["module", "input", "output", "wire", "reg", "assign", "always", "posedge", "clk", "reset", "begin",
             "end", "if", "else", "case", "the", "a", "of", "counter", "state", "data", "valid", "ready", "sum"]
    text = " ".join(rng.choice(words) + rng.choice(["", "_", " ", "[7:0]", "=", ";", "\n", "0", "1"])
                    for _ in range(size))
    r = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}, timeout=60)
    if r.status_code != 200:
        raise ConfigError(f"{url}/tokenize answered {r.status_code}; the benchmark needs a vLLM server")
    ids = sorted(set(r.json()["tokens"]))
    if not ids:
        raise ConfigError(f"{url}/tokenize returned no tokens")
    return ids


def exact_text_prompt(client, url: str, model: str, ids: list[int], n: int, rng) -> str | None:
    """Text that the server tokenizes (with its special tokens, as a completion prompt) into exactly
    ``n`` tokens, starting from random ``ids``; None when the tokenizer will not settle on ``n``."""
    body = {"model": model}
    ids = list(ids)
    for _ in range(12):
        text = client.post(f"{url}/detokenize", json={**body, "tokens": ids}).json()["prompt"]
        got = client.post(f"{url}/tokenize", json={**body, "prompt": text, "add_special_tokens": True}).json()
        count = got["count"]
        if count == n:
            return text
        plain = client.post(f"{url}/tokenize", json={**body, "prompt": text, "add_special_tokens": False}).json()
        tokens = plain["tokens"]
        specials = count - len(tokens)
        want = n - specials
        ids = tokens[:want] if len(tokens) > want else tokens + [int(x) for x in rng.choice(ids, size=want - len(tokens))]
    return None


async def _one(session, url: str, model: str, prompt: list[int] | str, in_len: int, out_len: int,
               timeout: float) -> RequestResult:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "min_tokens": out_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    res = RequestResult(ok=False, prompt_tokens=in_len)
    res.sent = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buffer = b""
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    payload = event.strip().removeprefix(b"data:").strip()
                    if not payload or payload == b"[DONE]":
                        continue
                    chunk = json.loads(payload)
                    if chunk.get("usage"):
                        res.prompt_tokens = chunk["usage"].get("prompt_tokens", res.prompt_tokens)
                    for choice in chunk.get("choices") or []:
                        ids = choice.get("token_ids")
                        n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
                        res.token_times += [now] * n
        res.output_tokens = len(res.token_times)
        if not res.token_times:
            res.error = "no tokens received"
            return res
        res.ttft = res.token_times[0] - res.sent
        res.latency = res.token_times[-1] - res.sent
        res.ok = True
    except TimeoutError:
        res.error = f"timed out after {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - every failure is counted and reported
        res.error = f"{type(e).__name__}: {e}"
    return res


def make_prompts(url: str, model: str, pool: list[int], in_len: int, num_prompts: int, rng, fmt: str) -> list:
    """Random prompts of exactly ``in_len`` prompt tokens: token-id lists, or (``fmt="text"``) text
    the server tokenizes to that length, so it does the tokenizing work a real client causes."""
    import httpx

    prompts: list = [[int(x) for x in rng.choice(pool, size=in_len)] for _ in range(num_prompts)]
    if fmt == "text":
        with httpx.Client(timeout=120) as client:
            for i, ids in enumerate(prompts):
                text = exact_text_prompt(client, url, model, ids, in_len, rng)
                if text is not None:
                    prompts[i] = text
    return prompts


async def _run_point(url: str, model: str, qps: float, in_len: int, out_len: int, prompts: list, seed: int,
                     timeout: float, max_concurrency: int | None) -> tuple[list[RequestResult], float, float]:
    import aiohttp

    rng = np.random.default_rng(seed + 1)
    num_prompts = len(prompts)
    if math.isinf(qps):
        arrivals = np.zeros(num_prompts)
    else:
        # Poisson arrivals, rescaled so that the last request goes out at num_prompts / qps (as
        # vLLM's benchmark does): the point's duration, hence its throughput, does not hinge on the seed
        arrivals = np.cumsum(rng.exponential(1.0 / qps, size=num_prompts))
        arrivals *= (num_prompts / qps) / arrivals[-1]
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=connector, read_bufsize=1 << 20) as session:

        async def send(prompt):
            if limit is None:
                return await _one(session, url, model, prompt, in_len, out_len, timeout)
            async with limit:
                return await _one(session, url, model, prompt, in_len, out_len, timeout)

        start = time.perf_counter()
        tasks = []
        for prompt, at in zip(prompts, arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(prompt)))
        results = await asyncio.gather(*tasks)
        end = time.perf_counter()
    return list(results), start, end


def summarize(results: list[RequestResult], start: float, end: float, usd_per_hour: float | None) -> dict:
    ok = [r for r in results if r.ok]
    duration = max([end - start] + [r.latency + r.sent - start for r in ok]) if results else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    times = np.array([t for r in ok for t in r.token_times]) - start
    peak = int(np.bincount(np.floor(times).astype(int)).max()) if len(times) else 0
    ttft = np.array([r.ttft for r in ok])
    tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    itl = np.concatenate([np.diff(r.token_times) for r in ok]) if ok else np.array([])
    itl = itl[itl > 0] if len(itl) else itl  # tokens of one chunk share a time

    def ms(a, q):
        return float(np.percentile(a, q) * 1000) if len(a) else None

    out = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration if duration else 0.0,
        "total_tok_s": (in_tokens + out_tokens) / duration if duration else 0.0,
        "peak_output_tok_s": peak,
        "median_ttft_ms": ms(ttft, 50),
        "p99_ttft_ms": ms(ttft, 99),
        "median_tpot_ms": ms(tpot, 50),
        "p99_itl_ms": ms(itl, 99),
        "median_latency_ms": ms(np.array([r.latency for r in ok]), 50),
    }
    if usd_per_hour:
        out["usd_per_1m_output_tokens"] = cost_per_million(usd_per_hour, out["output_tok_s"])
    return out


def run_sweep(url: str, model: str, *, qps: list[float], shapes: list[tuple[int, int]], num_prompts: int = 30,
              seed: int = 0, timeout: float = 600.0, max_concurrency: int | None = None,
              usd_per_hour: float | None = None, prompt_format: str = "text", progress=print) -> dict:
    info = server_info(url, model)
    max_len = info.get("max_model_len")
    for a, b in shapes:
        if max_len and a + b > max_len:
            raise ConfigError(f"--shapes {a}x{b}: {a + b} tokens exceed the server's max model length {max_len}")
    pool = token_pool(url, model, seed=seed)
    points = []
    for in_len, out_len in shapes:
        for q in qps:
            prompts = make_prompts(url, model, pool, in_len, num_prompts, np.random.default_rng(seed + len(points)),
                                   prompt_format)
            results, start, end = asyncio.run(_run_point(url, model, q, in_len, out_len, prompts, seed + len(points),
                                                         timeout, max_concurrency))
            point = {"input_len": in_len, "output_len": out_len, "qps": q if math.isfinite(q) else "inf", **summarize(results, start, end,
                                                                                      usd_per_hour)}
            points.append(point)
            if progress:
                progress(_row(point))
    return {"url": url, "model": model, "num_prompts": num_prompts, "seed": seed, "max_concurrency": max_concurrency,
            "prompt_format": prompt_format,
            "usd_per_hour": usd_per_hour, "max_model_len": max_len, "points": points}


COLUMNS = [("shape", 11), ("qps", 6), ("ok/fail", 8), ("out tok/s", 10), ("total tok/s", 12), ("peak out", 9),
           ("TTFT p50", 9), ("TTFT p99", 9), ("TPOT p50", 9), ("ITL p99", 8), ("$/1M out", 9)]


def _fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def _row(p: dict) -> str:
    cells = [f"{p['input_len']}x{p['output_len']}", str(p["qps"]), f"{p['completed']}/{p['failed']}",
             _fmt(p["output_tok_s"]), _fmt(p["total_tok_s"]), str(p["peak_output_tok_s"]), _fmt(p["median_ttft_ms"]),
             _fmt(p["p99_ttft_ms"]), _fmt(p["median_tpot_ms"]), _fmt(p["p99_itl_ms"]),
             _fmt(p.get("usd_per_1m_output_tokens"), 2)]
    return " ".join(c.rjust(w) for c, (_, w) in zip(cells, COLUMNS))


def table(result: dict) -> str:
    head = " ".join(name.rjust(w) for name, w in COLUMNS)
    lines = [head, "-" * len(head)] + [_row(p) for p in result["points"]]
    if result.get("weights"):
        from ckptbridge.report import human_bytes

        w = result["weights"]
        lines.append(f"weights: {human_bytes(w['bytes'])} ({', '.join(f'{k} {human_bytes(v)}' for k, v in w['dtypes'].items())}"
                     f"; {w['quantization'] or 'not quantized'})")
    lines.append("(times in ms; TTFT time to first token, TPOT time per output token, ITL inter-token latency)")
    return "\n".join(lines)


def plot(result: dict, out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(p["input_len"], p["output_len"]) for p in result["points"]})
    files = []
    for key, ylabel, name in (("output_tok_s", "output tokens/s", "throughput_vs_qps.png"),
                              ("median_ttft_ms", "median TTFT (ms)", "ttft_vs_qps.png")):
        fig, ax = plt.subplots(figsize=(6.5, 4), dpi=100)
        for shape in shapes:
            pts = [p for p in result["points"] if (p["input_len"], p["output_len"]) == shape and p[key] is not None]
            finite = [p["qps"] for p in pts if p["qps"] != "inf"]
            xs = [p["qps"] if p["qps"] != "inf" else max(finite + [1]) * 2 for p in pts]
            ax.plot(xs, [p[key] for p in pts], marker="o", label=f"{shape[0]}/{shape[1]}")
            if key == "output_tok_s":
                ax.plot(xs, [p["peak_output_tok_s"] for p in pts], ls="--", lw=0.8, color=ax.lines[-1].get_color())
        ax.set_xscale("log", base=2)
        ax.set_xlabel("request rate (QPS; inf drawn at 2x the largest)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{result['model']}: {ylabel}" + (" (dashed: peak 1 s)" if key == "output_tok_s" else ""))
        ax.grid(alpha=0.3)
        ax.legend(title="input/output tokens", fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path)
        plt.close(fig)
        files.append(path)
    return files


def write_outputs(result: dict, out_dir: str, *, train_cost: float | None = None,
                  hours: tuple[float, ...] = TCO_HOURS) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    if train_cost is not None and result.get("usd_per_hour"):
        result["tco"] = tco_table(train_cost, result["usd_per_hour"], hours)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=2, allow_nan=False, default=str)
    with open(os.path.join(out_dir, "bench.txt"), "w") as f:
        f.write(table(result) + "\n")
    result["plots"] = plot(result, out_dir)
    return result
