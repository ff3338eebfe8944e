"""The main job end to end at its smallest setting: train, convert, merge, serve, bench, eval, report."""

import json
import os
import subprocess
import sys

import pytest

from serving.profiles import SERVE_PYTHON

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not os.path.exists(SERVE_PYTHON), reason="no .venv-serve: run scripts/setup.sh")]


def test_main_job_smallest_setting(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "--smallest", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and all(report["checks"].values()), report["checks"]
    assert report["conversion"]["identical"] and report["parity"]["rel_l2"] <= 5e-5
    t = report["training"]
    assert t["steps"] >= 2 and t["final_loss"] < t["first_loss"] and 0 < t["real_token_fraction"] <= 1
    assert t["compile_seconds"] > 0 and t["steady_tokens_per_s"] > 0 and t["chip"] == "cpu" and t["steady_mfu"] is None
    assert report["export"]["peft_vs_tunix_rel_l2"] <= 5e-5 and report["export"]["merged_vs_tunix_rel_l2"] <= 5e-5
    assert report["serving"]["adapter_tokens_equal_hf_peft"] and report["serving"]["adapter_changes_tokens"]
    assert all(p["failed"] == 0 and p["output_tok_s"] > 0 for p in report["bench"]["points"])
    assert report["eval"]["samples"] == 2 * report["eval"]["problems"] and report["eval"]["k"] == 2
    assert report["eval"]["references_pass@1"] == 1.0
    # evaluation through the watch: every checkpoint of the background run scored, on the one server
    w = report["watch"]
    assert len(w["saved_steps"]) >= 2 and [r["step"] for r in w["rows"]] == w["saved_steps"]
    assert w["saved_steps"][-1] == t["steps"] == report["eval"]["step"] == report["export"]["step"]
    for r in w["rows"]:
        assert r["served_parity"] == "equal" and 0 <= r["pass@1"] <= r["pass@2"] <= 1 and r["loss"] > 0, r
    assert w["best"]["step"] in w["saved_steps"] and w["rows"][-1]["pass@1"] == report["eval"]["pass@1"]
    assert (out / "server.log").read_text().count("non-default args") == 1
    assert [round(r["hours"]) for r in report["cost"]["tco"]] == [1, 8, 24]
    md = (out / "report.md").read_text()
    for text in ("Result: **PASS**", "loss.png", "s compiling; steady", "throughput_vs_qps.png", "pass@1", "total $",
                 "watch.png", f"Best step: **{w['best']['step']}**"):
        assert text in md, text
    for name in ("loss.png", "throughput_vs_qps.png", "ttft_vs_qps.png", "bench.json", "eval.json", "samples.jsonl",
                 "watch.png", "best.json"):
        assert (out / name).stat().st_size > 0, name
    assert "[8/8]" in proc.stdout and f"watch: step {t['steps']}: loss" in proc.stdout  # progress is visible
