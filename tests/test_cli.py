"""The CLI end to end, as a user runs it."""

import json
import os

import pytest

from conftest import run_cli


def test_help_for_every_verb():
    for args in (["--help"], ["convert", "--help"], ["convert", "safetensors-to-orbax", "--help"],
                 ["convert", "orbax-to-safetensors", "--help"], ["inspect", "--help"], ["verify", "logits", "--help"],
                 ["verify", "tensors", "--help"], ["verify", "adapter", "--help"], ["verify", "served", "--help"]):
        proc = run_cli(*args)
        assert proc.returncode == 0, (args, proc.stderr)
        assert "usage: ckptbridge" in proc.stdout
    assert "Exit codes" in run_cli("convert", "safetensors-to-orbax", "--help").stdout


def test_convert_inspect_verify(checkpoints, tmp_path):
    src = checkpoints["keqv_lm_f32_sharded"]
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")

    proc = run_cli("convert", "safetensors-to-orbax", src, orbax_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tensors"] == 80 and report["layer_kinds"] == {"sliding": 5, "global (k_eq_v)": 1}

    info = json.loads(run_cli("inspect", src, "--json").stdout)
    assert info["kind"] == "hf-model" and info["key_prefix"] == "model.language_model." and info["valid"]
    assert info["parameters"] == 89_486 and info["dtypes"] == {"F32": 85}
    info = json.loads(run_cli("inspect", orbax_dir, "--json").stdout)
    assert info["kind"] == "orbax-weights" and info["leaves"] == 80 and info["family"] == "gemma4"
    assert info["metadata"]["key_prefix"] == "model.language_model."
    text = run_cli("inspect", orbax_dir).stdout
    assert "orbax-weights" in text and "global (k_eq_v): 1" in text

    proc = run_cli("convert", "orbax-to-safetensors", orbax_dir, back, "--max-shard-size", "200KB")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("verify", "tensors", src, back)
    assert proc.returncode == 0 and "identical" in proc.stdout

    proc = run_cli("convert", "orbax-to-safetensors", orbax_dir, back, "--overwrite", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert not [n for n in os.listdir(tmp_path) if ".ckptbridge-tmp-" in n]


@pytest.mark.slow
def test_verify_logits_cli(checkpoints, tmp_path):
    src = checkpoints["kv_lm_bf16_sharded"]
    orbax_dir = str(tmp_path / "orbax")
    assert run_cli("convert", "safetensors-to-orbax", src, orbax_dir).returncode == 0
    proc = run_cli("verify", "logits", src, "--tunix", orbax_dir, "--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["ok"] and r["rel_l2"] <= 1e-5 and r["argmax_agreement"] == 1.0


def test_verify_tensors_reports_differences(checkpoints):
    proc = run_cli("verify", "tensors", checkpoints["keqv_text_bf16_single"], checkpoints["kv_text_f32_sharded"])
    assert proc.returncode == 6 and "DIFFERENT" in proc.stdout
