"""Orbax checkpoints on Cloud Storage (gs://), against a GCS emulator (gcp-storage-emulator, the
JSON API; tests/gcs_emulator.py) that the tests start: a Tunix CheckpointManager tree uploaded to a bucket converts to the
same PEFT bytes as from the local copy, and is inspected and merged from there; safetensors-to-orbax
and peft-to-orbax write to gs:// (restored with Orbax from there, read back bit-exact); a failed
write leaves nothing at the destination."""

import importlib.util
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax
from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax
from ckptbridge.errors import OutputError
from ckptbridge.io import storage
from ckptbridge import merge_lora
from ckptbridge.testing import build_peft_adapter
from ckptbridge.verify import compare_tensors

from conftest import run_cli

# found, not imported: gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when imported (below, once it is set;
# otherwise it asks the emulator over gRPC what kind of bucket it is, and waits a minute per bucket)
if importlib.util.find_spec("gcsfs") is None or importlib.util.find_spec("gcp_storage_emulator") is None:
    pytest.skip("gcsfs and gcp-storage-emulator are not installed (scripts/setup.sh installs them)",
                allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs():
    """A GCS emulator with bucket ``bkt``, and the environment that points gcsfs and TensorStore at it."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "gcs_emulator.py"), str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120  # its imports take seconds on a busy 2-core machine
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            assert proc.poll() is None, "the GCS emulator exited at start"
            assert time.time() < deadline, "the GCS emulator did not listen within 120 s"
            time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url, "GOOGLE_CLOUD_PROJECT": "test",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        storage._gcs.cache_clear()
        try:
            yield storage._gcs()
        finally:
            storage._gcs.cache_clear()
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def made(gcs, checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("gcs")
    base = checkpoints["kv_lm_bf16_sharded"]
    peft_dir = build_peft_adapter(base, str(root / "peft"), r=4, lora_alpha=8, seed=4)
    os.makedirs(root / "run")
    local = str(root / "run" / "checkpoints")
    convert_peft_to_orbax(peft_dir, local, base=base, step=30, progress=False)
    gcs.put(local, "bkt/run/checkpoints", recursive=True)  # as `gcloud storage cp -r` uploads it
    return {"base": base, "peft": peft_dir, "local": local, "remote": "gs://bkt/run/checkpoints"}


def test_orbax_to_peft_from_a_bucket(made, tmp_path):
    a, b = str(tmp_path / "local"), str(tmp_path / "remote")
    convert_orbax_to_peft(made["local"], a, base=made["base"], progress=False)
    cli = run_cli("convert", "orbax-to-peft", made["remote"], b, "--base", made["base"], "--quiet")
    assert cli.returncode == 0, cli.stderr
    from safetensors.numpy import load_file

    ta, tb = load_file(os.path.join(a, "adapter_model.safetensors")), load_file(os.path.join(b, "adapter_model.safetensors"))
    assert set(ta) == set(tb) and all(ta[k].tobytes() == tb[k].tobytes() for k in ta)
    info = run_cli("inspect", made["remote"], "--json")
    assert info.returncode == 0 and '"kind": "orbax-lora"' in info.stdout, info.stdout + info.stderr
    merge_lora(made["base"], made["remote"], str(tmp_path / "merged-remote"), progress=False)
    merge_lora(made["base"], made["local"], str(tmp_path / "merged-local"), progress=False)
    assert compare_tensors(str(tmp_path / "merged-local"), str(tmp_path / "merged-remote")).identical


def test_conversions_write_to_a_bucket(gcs, made, tmp_path):
    import orbax.checkpoint as ocp

    dst = "gs://bkt/out/orbax"
    r = convert_safetensors_to_orbax(made["base"], dst, progress=False)
    assert r.tensors > 0 and gcs.exists(dst + "/_METADATA")
    assert not [p for p in gcs.ls("bkt/out") if storage.basename(p).startswith(".")]  # no temporary prefix left
    restored = ocp.StandardCheckpointer().restore(dst)  # Orbax restores it from the bucket
    local = str(tmp_path / "orbax")
    convert_safetensors_to_orbax(made["base"], local, progress=False)
    flat_local = ocp.StandardCheckpointer().restore(local)

    def leaves(tree, prefix=()):
        for k, v in tree.items():
            yield from leaves(v, prefix + (k,)) if isinstance(v, dict) else [(prefix + (k,), np.asarray(v))]

    got, want = dict(leaves(restored)), dict(leaves(flat_local))
    assert set(got) == set(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)
    back = str(tmp_path / "back")
    convert_orbax_to_safetensors(dst, back, progress=False)  # and reads back bit-exact, tokenizer files too
    assert compare_tensors(made["base"], back).identical
    assert {n for n in os.listdir(made["base"]) if n.startswith("tokenizer")} <= set(os.listdir(back))
    with pytest.raises(OutputError, match="already exists"):
        convert_safetensors_to_orbax(made["base"], dst, progress=False)
    convert_peft_to_orbax(made["peft"], "gs://bkt/out/lora", base=made["base"], step=5, progress=False)
    a = str(tmp_path / "from-remote-lora")
    convert_orbax_to_peft("gs://bkt/out/lora", a, base=made["base"], progress=False)
    # the PEFT round trip through the bucket gives the adapter's logits back
    from ckptbridge.verify import hf_logits, peft_logits, rel_l2

    tokens = np.random.default_rng(0).integers(3, 300, size=(1, 9))
    assert rel_l2(peft_logits(made["base"], a, tokens), peft_logits(made["base"], made["peft"], tokens)) <= 1e-5
    assert rel_l2(hf_logits(made["base"], tokens), peft_logits(made["base"], a, tokens)) > 1e-3


def test_a_failed_write_leaves_nothing(gcs, made, monkeypatch):
    from ckptbridge.formats import hf as sources

    calls = {"n": 0}
    real = sources.HFSource.tunix_value

    def failing(self, entry):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("killed")
        return real(self, entry)

    monkeypatch.setattr(sources.HFSource, "tunix_value", failing)
    with pytest.raises(RuntimeError, match="killed"):
        convert_safetensors_to_orbax(made["base"], "gs://bkt/failed/orbax", progress=False)
    assert not gcs.exists("bkt/failed/orbax") and gcs.find("bkt/failed") == []
    # what a killed run leaves (its temporary prefix, no _METADATA at the destination) is not a
    # checkpoint, and the next run on this machine removes it
    import socket

    host = "".join(c for c in socket.gethostname() if c.isalnum() or c == "-")[:40]
    leftover = f"bkt/failed/.orbax.ckptbridge-tmp-{host}-999999999.abcd/out/_CHECKPOINT_METADATA"
    gcs.pipe(leftover, b"{}")
    gcs.pipe("bkt/failed/orbax/d/partial", b"x")
    cli = run_cli("convert", "orbax-to-safetensors", "gs://bkt/failed/orbax", "unused")
    assert cli.returncode == 3 and "not an Orbax checkpoint" in cli.stderr, cli.stderr
    monkeypatch.undo()
    convert_safetensors_to_orbax(made["base"], "gs://bkt/failed/orbax", progress=False, overwrite=True)
    gcs.invalidate_cache()
    assert not [p for p in gcs.ls("bkt/failed") if "ckptbridge-tmp" in p] and gcs.exists("bkt/failed/orbax/_METADATA")


def test_watch_follows_a_run_in_a_bucket(gcs, made, tmp_path):
    """serving watch on a RUN_DIR in gs://: committed steps found (one being written in place is not),
    the loss read from there, and the export the same bytes as from the local copy."""
    import json

    from safetensors.numpy import load_file

    from serving.watch import Watch, checkpoints_dir, committed, loss_at

    gcs.pipe("bkt/run/config.json", b"{}")
    gcs.pipe("bkt/run/metrics.jsonl", b'{"step": 30, "loss": 1.25}\n{"step": 31, "lo')
    gcs.pipe("bkt/run/checkpoints/40/_CHECKPOINT_METADATA", json.dumps({"init_timestamp_nsecs": 1}).encode())
    gcs.pipe("bkt/run/checkpoints/40/model_params/_METADATA", b"{}")
    root = checkpoints_dir("gs://bkt/run")
    found = committed(root)
    assert [c.step for c in found] == [30] and found[0].committed > 0
    assert loss_at("gs://bkt/run/metrics.jsonl", 30) == 1.25
    w = Watch("gs://bkt/run", made["base"], str(tmp_path), str(tmp_path / "out"))
    remote = w.export(found[0])
    local = str(tmp_path / "local")
    convert_orbax_to_peft(made["local"], local, base=made["base"], target="vllm", progress=False)
    ta, tb = (load_file(os.path.join(d, "adapter_model.safetensors")) for d in (local, remote))
    assert set(ta) == set(tb) and all(ta[k].tobytes() == tb[k].tobytes() for k in ta)
