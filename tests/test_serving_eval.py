"""serving without a server: eval score against iverilog, pass@k, profiles' commands, cost model, bad inputs."""

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from serving.evaluate import BUNDLED_PROBLEMS, extract_code, list_problems, pass_at_k, score

TASKS = sorted(list_problems(BUNDLED_PROBLEMS))


def run_serving(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "serving", *args], capture_output=True, text=True, timeout=timeout)


def ref_as_top(task: str) -> str:
    with open(os.path.join(BUNDLED_PROBLEMS, f"{task}_ref.sv")) as f:
        return f.read().replace("module RefModule", "module TopModule")


def test_bundled_problems_have_the_verilog_eval_layout():
    assert len(TASKS) >= 5
    for task in TASKS:
        for suffix in ("_prompt.txt", "_ref.sv", "_test.sv"):
            assert os.path.isfile(os.path.join(BUNDLED_PROBLEMS, task + suffix))
        with open(os.path.join(BUNDLED_PROBLEMS, f"{task}_prompt.txt")) as f:
            assert "TopModule" in f.read()


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert abs(pass_at_k(n, c, k) - want) < 1e-12
    assert pass_at_k(3, 1, 5) is None


def test_extract_code():
    text = "Sure.\n```verilog\nmodule TopModule(); endmodule\n```\nand\n```verilog\nmodule X; endmodule\n```"
    assert extract_code(text) == "module TopModule(); endmodule\n"
    assert extract_code("```\nmodule A; endmodule\n```") == "module A; endmodule\n"
    assert extract_code("```python\nprint(1)\n```\n```systemverilog\nmodule B; endmodule\n```") == "module B; endmodule\n"
    assert extract_code("module C; endmodule") == "module C; endmodule"


def test_score_counts_only_real_passes(tmp_path):
    """Per problem 5 samples with a known number of correct ones; wrong, non-compiling, hanging,
    endlessly printing and file-writing samples all fail, for their own reason, and nothing escapes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    and_wrong = "module TopModule(input a, input b, output out);\n  assign out = a | b;\nendmodule\n"
    bad = {
        "mismatch": None,  # per task below
        "compile_error": "module TopModule(input a, output out);\n  assign out = ;\nendmodule\n",
        "timeout": ("module TopModule(input a, input b, output out);\n  initial begin : spin integer i;\n"
                    "    for (i = 0; i >= 0; i = i + 0) ;\n  end\n  assign out = a & b;\nendmodule\n"),
        "output_limit": ("module TopModule(input a, input b, output out);\n  initial forever $display(\"spam\");\n"
                         "  assign out = a & b;\nendmodule\n"),
        "forbidden": (f"module TopModule(input a, input b, output out);\n  integer fd;\n  initial begin\n"
                      f"    fd = $fopen(\"{outside}/escaped.txt\", \"w\"); $fdisplay(fd, \"out\"); $fclose(fd);\n"
                      f"  end\n  assign out = a & b;\nendmodule\n"),
    }
    dump = (f"module TopModule(input a, input b, output out);\n  initial begin $dumpfile(\"{outside}/w.vcd\"); "
            "$dumpvars; end\n  assign out = a & b;\nendmodule\n")
    include = '`include "/etc/passwd"\nmodule TopModule(input a, input b, output out);\nendmodule\n'
    rows, expect_c = [], {}
    for j, task in enumerate(TASKS):
        good = ref_as_top(task)
        c = j % 4  # 0..3 correct samples out of 5
        expect_c[task] = c
        samples = [f"Here you go:\n```verilog\n{good}```\n" for _ in range(c)]
        fillers = ["compile_error", "timeout", "output_limit", "forbidden", "mismatch"]
        for kind in fillers[: 5 - c]:
            if kind == "mismatch":
                samples.append(and_wrong if task.endswith("and_gate") else _constant_top(task))
            else:
                samples.append(bad[kind])
        rows += [{"task_id": task, "completion": s} for s in samples]
    rows.append({"task_id": TASKS[1], "completion": dump})
    rows.append({"task_id": TASKS[1], "completion": include})
    samples_path = tmp_path / "samples.jsonl"
    samples_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "result.json"
    r = score(BUNDLED_PROBLEMS, str(samples_path), str(out), ks=(1, 5), timeout=5)
    assert json.loads(out.read_text())["pass@1"] == r["pass@1"]
    assert list(outside.iterdir()) == []  # nothing written outside the work dirs
    for task in TASKS:
        p = r["problems"][task]
        n = 7 if task == TASKS[1] else 5
        assert (p["n"], p["c"]) == (n, expect_c[task]), (task, [s["reason"] for s in p["samples"]])
        assert p["pass@1"] == pytest.approx(expect_c[task] / n)
        assert p["pass@5"] == pytest.approx(pass_at_k(n, expect_c[task], 5))
        reasons = [s["reason"] for s in p["samples"]]
        assert reasons.count("pass") == expect_c[task]
        for s in p["samples"]:
            assert s["passed"] == (s["reason"] == "pass")
    assert r["pass@1"] == pytest.approx(sum(r["problems"][t]["pass@1"] for t in TASKS) / len(TASKS))
    seen = r["reasons"]
    for reason in ("pass", "compile_error", "timeout", "output_limit", "forbidden", "mismatch"):
        assert seen.get(reason), (reason, seen)
    extra = [s["detail"] for s in r["problems"][TASKS[1]]["samples"][-2:]]
    assert "$dumpfile" in extra[0] and "`include" in extra[1]


def _constant_top(task: str) -> str:
    """A TopModule with the reference's ports whose outputs are all ones (compiles, mismatches)."""
    with open(os.path.join(BUNDLED_PROBLEMS, f"{task}_ref.sv")) as f:
        ref = f.read()
    header = ref[ref.index("module RefModule"):ref.index(");") + 2].replace("RefModule", "TopModule")
    header = header.replace("output reg", "output").replace("output logic", "output")
    outputs = [line.split()[-1].rstrip(",") for line in header.splitlines() if line.strip().startswith("output")]
    return header + "\n" + "".join(f"  assign {o} = '1;\n" for o in outputs) + "endmodule\n"


def test_score_cli_and_bad_inputs(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"task_id": t, "completion": ref_as_top(t)}) + "\n" for t in TASKS))
    out = tmp_path / "r.json"
    r = run_serving("eval", "score", "--samples", str(good), "--out", str(out), "--k", "1")
    assert r.returncode == 0, r.stderr
    assert "pass@1: 1.0000" in r.stdout and json.loads(out.read_text())["pass@1"] == 1.0
    cases = [
        ("not json", "this is not json\n", 4, "line 1 is not JSON"),
        ("no completion", json.dumps({"task_id": TASKS[0]}) + "\n", 4, '"completion"'),
        ("unknown task", json.dumps({"task_id": "Prob999_nope", "completion": "x"}) + "\n", 8, "Prob999_nope"),
    ]
    for name, text, code, message in cases:
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        dst = tmp_path / f"{name}.json"
        r = run_serving("eval", "score", "--samples", str(path), "--out", str(dst))
        assert r.returncode == code and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (name, r.stderr)
        assert not dst.exists()
    r = run_serving("eval", "score", "--samples", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.json"))
    assert r.returncode == 3 and "no such samples file" in r.stderr
    r = run_serving("eval", "score", "--problems", str(tmp_path), "--samples", str(good), "--out", str(out))
    assert r.returncode == 3 and "spec-to-rtl" in r.stderr


def test_remote_profiles_print_the_papers_commands(tmp_path, checkpoints):
    base = checkpoints["keqv_text_bf16_single"]
    r = run_serving("serve", "--profile", "tpu-v6e-8", "--model", base, "--dry-run")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip()
    assert cmd.startswith("docker run --rm --privileged --net host --shm-size 16G")
    assert "vllm/vllm-tpu" in cmd and " vllm serve /models/" in cmd
    for flag in ("--tensor-parallel-size 8", "--max-model-len 16384", "--kv-cache-dtype fp8"):
        assert flag in cmd
    r = run_serving("serve", "--profile", "gpu-h100x2", "--model", base, "--dry-run", "--port", "9000")
    cmd = r.stdout.strip()
    assert r.returncode == 0 and cmd.startswith("vllm serve ")
    assert "--tensor-parallel-size 2" in cmd and "--dtype bfloat16" in cmd and "--kv-cache-dtype" not in cmd
    assert "--port 9000" in cmd
    # the TPU path has no LoRA: a clear way out instead of a failure on the TPU VM
    adapter = str(tmp_path / "adapter")
    from ckptbridge.testing import write_random_adapter

    write_random_adapter(base, adapter)
    r = run_serving("serve", "--profile", "tpu-v6e-8", "--model", base, "--adapter", f"ft={adapter}", "--dry-run")
    assert r.returncode == 8 and "ckptbridge merge" in r.stderr
    r = run_serving("serve", "--profile", "cpu", "--model", str(tmp_path / "nope"), "--dry-run")
    assert r.returncode == 3 and "no such model directory" in r.stderr
    r = run_serving("serve", "--profile", "cpu", "--model", base, "--adapter", "ft", "--dry-run")
    assert r.returncode == 8 and "NAME=DIR" in r.stderr


def test_cost_model_reproduces_the_papers_figures():
    from serving.cost import RATES, cost_per_million, tco_table

    assert round(cost_per_million(RATES["tpu-v6e-8"], 1403), 2) == 4.26
    tpu = [round(r["total_usd"], 2) for r in tco_table(56.11, RATES["tpu-v6e-8"])]
    gpu = [round(r["total_usd"], 2) for r in tco_table(119.23, RATES["gpu-h100x2"])]
    assert tpu == [77.63, 228.27, 572.59] and gpu == [141.35, 296.19, 650.11]
    assert round(RATES["tpu-v5p-8"] * 3.34, 2) == 56.11


def test_bench_without_a_server_is_a_clear_error():
    r = run_serving("bench", "--url", "http://127.0.0.1:9", "--model", "m", "--qps", "1", "--shapes", "8x8",
                    "--num-prompts", "1")
    assert r.returncode == 3 and "no OpenAI-compatible server answers" in r.stderr
    r = run_serving("bench", "--url", "http://127.0.0.1:9", "--model", "m", "--shapes", "8by8")
    assert r.returncode == 8 and "INPUTxOUTPUT" in r.stderr


def test_no_stray_files_in_bundled_problems():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(BUNDLED_PROBLEMS, "*"))}
    assert all(n.endswith(("_prompt.txt", "_ref.sv", "_test.sv")) for n in names)
