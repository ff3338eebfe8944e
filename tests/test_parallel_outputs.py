"""What the converting verbs write does not depend on how many workers made it or on the memory
budget: one worker with a budget of one chunk against several with room for many, byte for byte
(safetensors files whole; Orbax checkpoints as the stored key/value pairs of their database:
array metadata and every encoded chunk)."""

from __future__ import annotations

import hashlib
import os

import pytest

from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax
from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax
from ckptbridge import merge_lora

SERIAL = dict(workers=1, memory_budget="4KiB")
PARALLEL = dict(workers=4, memory_budget="64MiB")
CHUNK = "4KiB"  # small enough that every large tensor goes in row blocks


def orbax_stored(path: str) -> dict[bytes, str]:
    """key -> sha256 of the value, for every key of the checkpoint's OCDBT database."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": "file://" + os.path.abspath(path)}).result()
    return {k: hashlib.sha256(kv.read(k).result().value).hexdigest() for k in kv.list().result()}


def files(path: str, suffixes=(".safetensors", ".json")) -> dict[str, str]:
    """relative path -> sha256 of the files of ``path`` ending in ``suffixes``."""
    out = {}
    for d, _, names in os.walk(path):
        for n in names:
            if n.endswith(suffixes):
                full = os.path.join(d, n)
                with open(full, "rb") as f:
                    out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("name", ["keqv_lm_f32_sharded", "qwen3_moe"])
def test_conversions_do_not_depend_on_workers(checkpoints, tmp_path, name):
    src = checkpoints[name]
    out = {}
    for kind, par in (("serial", SERIAL), ("parallel", PARALLEL)):
        orbax, back = str(tmp_path / f"{kind}.orbax"), str(tmp_path / f"{kind}.hf")
        convert_safetensors_to_orbax(src, orbax, chunk_size=CHUNK, progress=False, **par)
        convert_orbax_to_safetensors(orbax, back, chunk_size=CHUNK, max_shard_size="64KiB", progress=False, **par)
        out[kind] = orbax_stored(orbax), files(back)
    (orbax_a, hf_a), (orbax_b, hf_b) = out["serial"], out["parallel"]
    assert sum(k.endswith(b".0") for k in orbax_a) > 20  # many chunks were written
    assert orbax_a == orbax_b
    assert len([f for f in hf_a if f.endswith(".safetensors")]) > 1 and hf_a == hf_b


def test_codec_verbs_default_to_at_most_four_workers(checkpoints, tmp_path, monkeypatch):
    """On a host of 13 usable cores, safetensors-to-orbax and orbax-to-safetensors run 4 workers
    unless told otherwise (stream.CODEC_VERB_WORKERS), and the output is the same as with 13."""
    from ckptbridge import stream

    monkeypatch.setattr(stream, "usable_cores", lambda: 13)
    made = []
    engine = stream.Parallelism.engine
    monkeypatch.setattr(stream.Parallelism, "engine", lambda self, name="ckptbridge": made.append(self.workers)
                        or engine(self, name))
    src = checkpoints["keqv_lm_f32_sharded"]
    for kind, workers in (("default", None), ("thirteen", 13)):
        convert_safetensors_to_orbax(src, str(tmp_path / f"{kind}.orbax"), chunk_size=CHUNK, workers=workers,
                                     progress=False)
        convert_orbax_to_safetensors(str(tmp_path / f"{kind}.orbax"), str(tmp_path / f"{kind}.hf"),
                                     chunk_size=CHUNK, workers=workers, progress=False)
    assert made == [4, 4, 13, 13]
    assert orbax_stored(str(tmp_path / "default.orbax")) == orbax_stored(str(tmp_path / "thirteen.orbax"))
    assert files(str(tmp_path / "default.hf")) == files(str(tmp_path / "thirteen.hf"))


def test_lora_verbs_do_not_depend_on_workers(adapters, tmp_path):
    row = adapters["keqv_lm_f32_sharded"]
    got = {}
    for kind, par in (("serial", SERIAL), ("parallel", PARALLEL)):
        peft, orbax = str(tmp_path / f"{kind}.peft"), str(tmp_path / f"{kind}.p2o")
        merged_orbax, merged_peft = str(tmp_path / f"{kind}.m1"), str(tmp_path / f"{kind}.m2")
        convert_orbax_to_peft(row.tunix, peft, base=row.base, target="vllm", progress=False, **par)
        convert_peft_to_orbax(row.peft, orbax, base=row.base, progress=False, **par)
        merge_lora(row.base, row.tunix, merged_orbax, max_shard_size="64KiB", progress=False, **par)
        merge_lora(row.base, row.peft, merged_peft, max_shard_size="64KiB", progress=False, **par)
        got[kind] = (files(peft, (".safetensors",)), orbax_stored(os.path.join(orbax, "0", "model_params")),
                     files(merged_orbax), files(merged_peft))
    for a, b in zip(got["serial"], got["parallel"]):
        assert a and a == b


def test_bad_workers_or_budget_is_one_line_and_writes_nothing(checkpoints, tmp_path):
    from conftest import run_cli

    src = checkpoints["keqv_lm_f32_sharded"]
    for flags, words in ((["--workers", "0"], "--workers"),
                         (["--memory-budget", "lots"], "--memory-budget"),
                         (["--memory-budget", "1MiB", "--chunk-size", "2MiB"], "--chunk-size")):
        dst = tmp_path / "out"
        proc = run_cli("convert", "safetensors-to-orbax", src, str(dst), *flags)
        assert proc.returncode == 8, proc.stderr
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not dst.exists()
    for verb in (["merge", src, str(tmp_path / "nope")], ["convert", "orbax-to-safetensors", str(tmp_path / "nope")],
                 ["convert", "orbax-to-peft", str(tmp_path / "nope"), "--base", src],
                 ["convert", "peft-to-orbax", str(tmp_path / "nope"), "--base", src]):
        proc = run_cli(*verb, str(tmp_path / "m"), "--workers", "-1")  # checked before any input is opened
        assert proc.returncode == 8 and "workers (--workers)" in proc.stderr, proc.stderr
        assert not (tmp_path / "m").exists()
