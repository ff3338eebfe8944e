"""verilog-eval (v2, spec-to-rtl layout) through any OpenAI-compatible server, scored with iverilog.

Problems: ``ProbNNN_name_prompt.txt`` (the spec), ``ProbNNN_name_ref.sv`` (``RefModule``) and
``ProbNNN_name_test.sv`` (testbench ``tb`` printing ``Mismatches: N in M samples``).

* :func:`generate` asks the model for ``n`` completions per problem (the spec through the model's
  chat template with the usual instructions) and appends ``{"task_id", "completion"}`` lines to a
  samples file; re-running it only asks for what is missing.
* :func:`score` compiles each sample's first fenced code block (else its raw text) with the test
  and reference (``iverilog -Wall -Winfloop -Wno-timescale -g2012 -s tb``), runs it with a time,
  output and file-size limit in a scratch directory of its own, and passes it only on
  ``Mismatches: 0 in M samples`` with M > 0. Samples that use file or shell system tasks
  (``$fopen``, ``$system``, ``$dumpfile``, ``$writemem*``...) or `` `include`` are not run.
  pass@k is the unbiased estimator ``1 - C(n - c, k) / C(n, k)`` averaged over problems.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from ckptbridge.errors import ConfigError, CorruptFileError, InputNotFoundError, OutputError

log = logging.getLogger("serving.eval")

BUNDLED_PROBLEMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "eval_problems")
INSTRUCTIONS = (
    "You are a Verilog RTL designer. Implement the hardware described below as a Verilog module named "
    "TopModule, keeping the port names and widths of the interface exactly as given. Answer with a single "
    "```verilog code block containing the complete module (from `module TopModule` to `endmodule`)."
)
COMPILE = ["iverilog", "-Wall", "-Winfloop", "-Wno-timescale", "-g2012", "-s", "tb", "-o", "bin",
           "sample.sv", "test.sv", "ref.sv"]
RESULT_LINE = re.compile(r"Mismatches:\s*(\d+)\s+in\s+(\d+)\s+samples")
FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
FORBIDDEN = re.compile(
    r"\$(?P<task>f?open[rwa]?|system|writemem[bh]|dumpfile|dumpvars|dumpall|dumpon|dumpflush|dumplimit|"
    r"dumpports\w*|fdump\w*|fflush|fputc|fwrite[bho]?|fdisplay[bho]?|fstrobe[bho]?|fmonitor[bho]?|fclose)\b"
    r"|(?P<include>`include\b)"
)
OUTPUT_LIMIT = 1 << 20  # bytes of simulator output kept; more and the run is stopped
FILE_LIMIT = 16 << 20  # largest file a compile or run may write
MEMORY_LIMIT = 4 << 30


# ----------------------------------------------------------------------------------------------- problems


def list_problems(problems_dir: str, need_tests: bool = False) -> dict[str, dict[str, str]]:
    """task_id -> {"prompt", "ref", "test"} paths, from a verilog-eval spec-to-rtl directory."""
    if not os.path.isdir(problems_dir):
        raise InputNotFoundError(f"{problems_dir}: no such problems directory")
    out = {}
    for name in sorted(os.listdir(problems_dir)):
        if not name.endswith("_prompt.txt"):
            continue
        task = name[: -len("_prompt.txt")]
        paths = {kind: os.path.join(problems_dir, f"{task}_{kind}{ext}")
                 for kind, ext in (("prompt", ".txt"), ("ref", ".sv"), ("test", ".sv"))}
        if need_tests:
            for kind in ("ref", "test"):
                if not os.path.isfile(paths[kind]):
                    raise InputNotFoundError(f"{paths[kind]}: missing; every problem needs _prompt.txt, _ref.sv and "
                                             "_test.sv")
        out[task] = paths
    if not out:
        raise InputNotFoundError(f"{problems_dir}: no ProbNNN_name_prompt.txt files (verilog-eval spec-to-rtl layout)")
    return out


def messages_for(prompt_text: str) -> list[dict]:
    return [{"role": "user", "content": f"{INSTRUCTIONS}\n\n{prompt_text.strip()}\n"}]


# ----------------------------------------------------------------------------------------------- generate


def read_samples(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise InputNotFoundError(f"{path}: no such samples file")
    samples = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            line = raw.decode("utf-8", "replace").strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise CorruptFileError(f"{path}: line {i} is not JSON; each line is "
                                       '{"task_id": "ProbNNN_name", "completion": "..."}') from None
            if not isinstance(row, dict) or not isinstance(row.get("task_id"), str) or not isinstance(
                    row.get("completion"), str):
                raise CorruptFileError(f'{path}: line {i} needs a string "task_id" and a string "completion"')
            samples.append(row)
    return samples


def generate(url: str, model: str, problems_dir: str, out: str, *, n: int = 5, temperature: float = 0.8,
             top_p: float = 0.95, max_tokens: int = 1024, workers: int = 4, timeout: float = 600.0,
             seed: int | None = None, progress: bool | None = None) -> dict:
    """Ask the model for ``n`` completions of every problem, appending to ``out``; resumable."""
    import httpx

    from serving.bench import server_info

    if n < 1:
        raise ConfigError("--n must be at least 1")
    problems = list_problems(problems_dir)
    server_info(url, model)
    have: dict[str, int] = {}
    if os.path.exists(out):
        for row in read_samples(out):
            have[row["task_id"]] = have.get(row["task_id"], 0) + 1
    todo = [(task, n - have.get(task, 0)) for task in problems if have.get(task, 0) < n]
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    lock = threading.Lock()
    failures: list[str] = []
    written = 0
    bar = _bar(len(todo), "generate", progress)

    def ask(task: str, missing: int) -> None:
        nonlocal written
        with open(problems[task]["prompt"], encoding="utf-8") as f:
            prompt = f.read()
        body = {"model": model, "messages": messages_for(prompt), "n": missing, "temperature": temperature,
                "top_p": top_p, "max_tokens": max_tokens}
        if seed is not None:
            body["seed"] = seed
        error = None
        for attempt in range(3):
            try:
                r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)
                if r.status_code == 200:
                    choices = r.json()["choices"]
                    with lock, open(out, "a", encoding="utf-8") as f:
                        for c in choices:
                            f.write(json.dumps({"task_id": task, "completion": c["message"]["content"] or ""}) + "\n")
                        written += len(choices)
                    return
                error = f"HTTP {r.status_code}: {r.text[:200]}"
                if r.status_code < 500:
                    break
            except httpx.HTTPError as e:
                error = f"{type(e).__name__}: {e}"
            time.sleep(2 ** attempt)
        with lock:
            failures.append(f"{task}: {error}")

    with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
        for fut in concurrent.futures.as_completed([pool.submit(ask, t, m) for t, m in todo]):
            fut.result()
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    summary = {"samples": out, "problems": len(problems), "requested": len(todo), "written": written,
               "already_there": sum(min(v, n) for v in have.values()), "failed": failures}
    if failures:
        raise OutputError(f"{out}: {len(failures)} problem(s) got no completions ({failures[0]}); re-run the same "
                          "command to retry only those")
    return summary


# ----------------------------------------------------------------------------------------------- score


def extract_code(completion: str) -> str:
    """The first fenced code block (preferring one tagged verilog/systemverilog), else the raw text."""
    blocks = FENCE.findall(completion)
    for lang, body in blocks:
        if lang.lower() in ("verilog", "systemverilog", "sv", "v"):
            return body
    return blocks[0][1] if blocks else completion


def _limited(argv: list[str], cpu_seconds: float) -> tuple[list[str], object]:
    """``argv`` under resource limits (file size, CPU time, memory, no core files): through
    util-linux's ``prlimit`` when present (no Python runs between fork and exec, which matters in
    multithreaded callers), else set in the child before exec."""
    cpu = int(cpu_seconds) + 1
    limits = {resource.RLIMIT_FSIZE: FILE_LIMIT, resource.RLIMIT_CPU: cpu, resource.RLIMIT_AS: MEMORY_LIMIT,
              resource.RLIMIT_CORE: 0}
    prlimit = shutil.which("prlimit")
    if prlimit:
        return [prlimit, f"--fsize={FILE_LIMIT}", f"--cpu={cpu}", f"--as={MEMORY_LIMIT}", "--core=0", "--",
                *argv], None

    def apply():
        for which, value in limits.items():
            resource.setrlimit(which, (value, value))

    return argv, apply


def _run_limited(argv: list[str], cwd: str, timeout: float) -> tuple[str, int | None, str | None]:
    """Run with time, output and file-size limits; returns (output, returncode, limit hit or None)."""
    argv, preexec = _limited(argv, timeout)
    proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=preexec,
                            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": cwd, "TMPDIR": cwd,
                                 "LC_ALL": "C"})
    chunks: list[bytes] = []
    size = 0
    hit: list[str] = []

    def reader():
        nonlocal size
        while True:
            block = proc.stdout.read1(65536)
            if not block:
                return
            if size < OUTPUT_LIMIT:
                chunks.append(block[: OUTPUT_LIMIT - size])
            size += len(block)
            if size > OUTPUT_LIMIT and not hit:
                hit.append("output_limit")
                _kill(proc)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        hit.append("timeout")
        _kill(proc)
        proc.wait()
    t.join(5)
    code = proc.returncode
    if not hit and code is not None and code < 0 and -code in (signal.SIGXCPU, signal.SIGKILL):
        hit.append("timeout")
    if not hit and code is not None and code < 0 and -code == signal.SIGXFSZ:
        hit.append("file_limit")
    return b"".join(chunks).decode("utf-8", "replace"), code, (hit[0] if hit else None)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def check_sample(paths: dict[str, str], completion: str, *, timeout: float = 30.0,
                 scratch: str | None = None) -> dict:
    """Compile and simulate one sample; {"passed", "reason", "mismatches", "total", "detail"}."""
    code = extract_code(completion)
    bad = FORBIDDEN.search(code)
    if bad:
        what = bad.group("task") and f"${bad.group('task')}" or "`include"
        return {"passed": False, "reason": "forbidden", "detail": f"{what} is not allowed in a sample"}
    work = tempfile.mkdtemp(prefix="vlog-", dir=scratch)
    try:
        with open(os.path.join(work, "sample.sv"), "w", encoding="utf-8") as f:
            f.write(code)
        shutil.copyfile(paths["test"], os.path.join(work, "test.sv"))
        shutil.copyfile(paths["ref"], os.path.join(work, "ref.sv"))
        out, rc, hit = _run_limited(COMPILE, work, timeout)
        if hit:
            return {"passed": False, "reason": f"compile_{hit}", "detail": out[-500:]}
        if rc != 0:
            return {"passed": False, "reason": "compile_error", "detail": out[-1000:]}
        out, rc, hit = _run_limited(["vvp", "-n", "bin"], work, timeout)
        found = RESULT_LINE.findall(out)
        mismatches, total = (int(found[-1][0]), int(found[-1][1])) if found else (None, None)
        result = {"mismatches": mismatches, "total": total}
        if hit:
            return {**result, "passed": False, "reason": hit, "detail": out[-500:]}
        if rc != 0:
            return {**result, "passed": False, "reason": "runtime_error", "detail": out[-500:]}
        if not found:
            return {**result, "passed": False, "reason": "no_result", "detail": out[-500:]}
        if mismatches != 0 or total == 0:
            return {**result, "passed": False, "reason": "mismatch", "detail": f"{mismatches} of {total} samples"}
        return {**result, "passed": True, "reason": "pass", "detail": ""}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """Unbiased pass@k (Chen et al. 2021); None when fewer than k samples."""
    if n < k:
        return None
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def iverilog_version() -> str:
    if shutil.which("iverilog") is None or shutil.which("vvp") is None:
        raise InputNotFoundError("iverilog/vvp not found; install Icarus Verilog (`apt-get install -y iverilog`; "
                                 "scripts/setup.sh does it when run as root)")
    out = subprocess.run(["iverilog", "-V"], capture_output=True, text=True).stdout
    return out.splitlines()[0].strip() if out else "unknown"


def score(problems_dir: str, samples_path: str, out: str, *, ks: tuple[int, ...] = (1, 5), workers: int | None = None,
          timeout: float = 30.0, progress: bool | None = None) -> dict:
    version = iverilog_version()
    problems = list_problems(problems_dir, need_tests=True)
    samples = read_samples(samples_path)
    unknown = sorted({s["task_id"] for s in samples} - set(problems))
    if unknown:
        raise ConfigError(f"{samples_path}: task_id {unknown[0]!r} is not a problem in {problems_dir}"
                          + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    if any(k < 1 for k in ks):
        raise ConfigError("--k values must be at least 1")
    by_task: dict[str, list[str]] = {}
    for s in samples:
        by_task.setdefault(s["task_id"], []).append(s["completion"])
    jobs = [(task, i, text) for task, texts in by_task.items() for i, text in enumerate(texts)]
    results: dict[str, list] = {task: [None] * len(texts) for task, texts in by_task.items()}
    bar = _bar(len(jobs), "score", progress)
    scratch = tempfile.mkdtemp(prefix="verilog-eval-")
    try:
        with concurrent.futures.ThreadPoolExecutor(workers or os.cpu_count() or 1) as pool:
            futures = {pool.submit(check_sample, problems[task], text, timeout=timeout, scratch=scratch): (task, i)
                       for task, i, text in jobs}
            for fut in concurrent.futures.as_completed(futures):
                task, i = futures[fut]
                results[task][i] = fut.result()
                if bar is not None:
                    bar.update(1)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if bar is not None:
            bar.close()
    per = {}
    for task in sorted(results):
        rs = results[task]
        n, c = len(rs), sum(r["passed"] for r in rs)
        per[task] = {"n": n, "c": c, **{f"pass@{k}": pass_at_k(n, c, k) for k in ks}, "samples": rs}
    summary = {"problems_dir": os.path.abspath(problems_dir), "samples_file": os.path.abspath(samples_path),
               "iverilog": version, "k": list(ks), "num_problems": len(per), "num_samples": len(jobs),
               "missing": sorted(set(problems) - set(per))}
    for k in ks:
        vals = [p[f"pass@{k}"] for p in per.values() if p[f"pass@{k}"] is not None]
        summary[f"pass@{k}"] = float(np.mean(vals)) if vals else None
        summary[f"problems_with_{k}_samples"] = len(vals)
    reasons: dict[str, int] = {}
    for p in per.values():
        for r in p["samples"]:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
    summary["reasons"] = reasons
    summary["problems"] = per
    os.makedirs(os.path.dirname(os.path.abspath(out)) or ".", exist_ok=True)
    tmp = f"{out}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(tmp, out)
    return summary


def _bar(total: int, desc: str, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or not total:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr)
