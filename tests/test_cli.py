"""The CLI end to end, as a user runs it."""

import json
import os

import numpy as np

import pytest

from conftest import run_cli

pytestmark = pytest.mark.pinned_only  # the command line is ckptbridge's own


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


def test_conversions_in_row_blocks(checkpoints, tmp_path):
    """--chunk-size smaller than the tensors: the large ones are stored in row-block chunks, read
    back in blocks, and every byte comes back; --no-compression stores them without zstd."""
    from ckptbridge.io.orbax import OrbaxCheckpoint

    src = checkpoints["keqv_lm_f32_sharded"]
    for name, extra in (("zstd", ()), ("raw", ("--no-compression",))):
        orbax_dir, back = str(tmp_path / f"orbax-{name}"), str(tmp_path / f"back-{name}")
        proc = run_cli("convert", "safetensors-to-orbax", src, orbax_dir, "--chunk-size", "4KiB", "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert report["chunk_bytes"] == 4096 and report["compression"] is (name == "zstd")
        with OrbaxCheckpoint(orbax_dir) as ckpt:
            chunked = [p for p, (shape, dtype) in ckpt.leaves.items() if ckpt.chunks(p) != shape]
            assert chunked, "no leaf was stored in blocks"
            for p in chunked:
                shape, dtype = ckpt.leaves[p]
                assert all(c <= s for c, s in zip(ckpt.chunks(p), shape))
                assert int(np.prod(ckpt.chunks(p))) * dtype.itemsize <= 4096 or min(ckpt.chunks(p)) == 1
        proc = run_cli("convert", "orbax-to-safetensors", orbax_dir, back, "--chunk-size", "2KiB")
        assert proc.returncode == 0, proc.stderr
        proc = run_cli("verify", "tensors", src, back)
        assert proc.returncode == 0 and "identical" in proc.stdout, proc.stdout
    for name, compressor in (("zstd", {"id": "zstd", "level": 1}), ("raw", None)):
        with OrbaxCheckpoint(str(tmp_path / f"orbax-{name}")) as ckpt:
            stores = ckpt._impl._stores  # the TensorStore arrays: their zarr metadata
            assert {json.dumps(st.spec().to_json()["metadata"].get("compressor")) for st in stores.values()} == {
                json.dumps(compressor)}
    # Orbax's own restore: the chunked checkpoints hold the same tree as one of whole-array chunks
    assert run_cli("convert", "safetensors-to-orbax", src, str(tmp_path / "orbax-whole")).returncode == 0
    whole = _orbax_restore(str(tmp_path / "orbax-whole"))
    for name in ("zstd", "raw"):
        got = _orbax_restore(str(tmp_path / f"orbax-{name}"))
        assert got.keys() == whole.keys()
        for path, value in whole.items():
            assert got[path].dtype == value.dtype and got[path].tobytes() == value.tobytes(), path
    proc = run_cli("convert", "safetensors-to-orbax", src, str(tmp_path / "x"), "--chunk-size", "lots")
    assert proc.returncode == 8 and "--chunk-size" in proc.stderr and not os.path.exists(tmp_path / "x")


def _orbax_restore(path: str) -> dict:
    import orbax.checkpoint as ocp

    def flat(t, prefix=()):
        out = {}
        for k, v in t.items():
            out.update(flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): np.asarray(v)})
        return out

    with ocp.PyTreeCheckpointer() as ckptr:
        return flat(ckptr.restore(os.path.abspath(path)))


def test_huge_pages_reexec_conditions(monkeypatch):
    from ckptbridge import hugepages

    env = hugepages.environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "A": "1"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1" and env["A"] == "1"
    assert hugepages.environment({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert not hugepages.wanted({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})  # the user's choice stands
    assert not hugepages.wanted({hugepages.OPT_OUT: "1"})
    assert not hugepages.wanted(hugepages.environment({}))  # never twice
    monkeypatch.setattr(hugepages, "THP_MODE", "/nonexistent")
    assert not hugepages.wanted({})
    calls = []
    monkeypatch.setattr(os, "execve", lambda *a: calls.append(a))
    hugepages.reexec(["convert", "x", "y"])
    assert calls[0][1][1:] == ["-m", "ckptbridge", "convert", "x", "y"]
    assert "glibc.malloc.hugetlb=1" in calls[0][2]["GLIBC_TUNABLES"]


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
