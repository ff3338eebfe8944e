"""Bad inputs: one line naming the file/key and the fix, a specific exit code, no DST, SRC untouched."""

import json
import os
import shutil

import numpy as np
import pytest

from ckptbridge.io.safetensors import PlannedTensor, SafetensorsFile, write_file

from conftest import run_cli, tree_hash

pytestmark = pytest.mark.pinned_only  # ckptbridge's own error paths


def copy_of(checkpoints, tmp_path, case="keqv_text_bf16_single"):
    dst = tmp_path / "src"
    shutil.copytree(checkpoints[case], dst)
    return str(dst)


def rewrite(path, edit):
    """Rewrite a safetensors file through ``edit(dict name -> array) -> dict``."""
    with SafetensorsFile(path) as f:
        tensors = {k: np.array(f.array(k)) for k in f.keys()}
    tensors = edit(tensors)
    write_file(path, [PlannedTensor(k, v.dtype, v.shape, lambda v=v: v) for k, v in tensors.items()])


def check_failure(proc, code, *needles, src=None, before=None, dst=None):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckptbridge: error: ")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    if dst is not None:
        assert not os.path.exists(dst)
        parent = os.path.dirname(os.path.abspath(dst))
        assert not [n for n in os.listdir(parent) if ".ckptbridge-tmp-" in n]
    if src is not None:
        assert tree_hash(src) == before


def s2o(src, dst, *extra):
    return run_cli("convert", "safetensors-to-orbax", src, dst, "--quiet", *extra)


def test_missing_tensor(checkpoints, tmp_path):
    src = copy_of(checkpoints, tmp_path)
    key = "model.layers.3.mlp.up_proj.weight"
    rewrite(os.path.join(src, "model.safetensors"), lambda t: {k: v for k, v in t.items() if k != key})
    before, dst = tree_hash(src), str(tmp_path / "dst")
    check_failure(s2o(src, dst), 6, key, "missing", src=src, before=before, dst=dst)


def test_wrong_shape(checkpoints, tmp_path):
    src = copy_of(checkpoints, tmp_path)
    key = "model.layers.5.self_attn.k_proj.weight"

    def edit(t):
        t[key] = np.concatenate([t[key], t[key]])
        return t

    rewrite(os.path.join(src, "model.safetensors"), edit)
    before, dst = tree_hash(src), str(tmp_path / "dst")
    check_failure(s2o(src, dst), 6, key, "model.safetensors", "(40, 40)", "(20, 40)", src=src, before=before, dst=dst)


def test_unexpected_tensor(checkpoints, tmp_path):
    src = copy_of(checkpoints, tmp_path)
    key = "model.layers.5.self_attn.v_proj.weight"  # k_eq_v layers have no v_proj

    def edit(t):
        t[key] = t["model.layers.5.self_attn.k_proj.weight"]
        return t

    rewrite(os.path.join(src, "model.safetensors"), edit)
    before, dst = tree_hash(src), str(tmp_path / "dst")
    check_failure(s2o(src, dst), 6, key, "unexpected", src=src, before=before, dst=dst)


def test_unknown_model_type(checkpoints, tmp_path):
    src = copy_of(checkpoints, tmp_path)
    cfg_path = os.path.join(src, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["model_type"] = "mixtral"
    json.dump(cfg, open(cfg_path, "w"))
    before, dst = tree_hash(src), str(tmp_path / "dst")
    check_failure(s2o(src, dst), 5, "config.json", "'mixtral'", "gemma4", src=src, before=before, dst=dst)


@pytest.mark.parametrize("keep", [4, 100, -1000])
def test_truncated_safetensors(checkpoints, tmp_path, keep):
    src = copy_of(checkpoints, tmp_path)
    path = os.path.join(src, "model.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:keep])
    before, dst = tree_hash(src), str(tmp_path / "dst")
    check_failure(s2o(src, dst), 4, "model.safetensors", src=src, before=before, dst=dst)


def test_existing_destination(checkpoints, tmp_path):
    src = checkpoints["keqv_text_bf16_single"]
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    before = tree_hash(src)
    proc = s2o(src, str(dst))
    check_failure(proc, 7, str(dst), "--overwrite", src=src, before=before)
    assert (dst / "keep.txt").read_text() == "mine"


def test_destination_inside_source(checkpoints, tmp_path):
    src = copy_of(checkpoints, tmp_path)
    before = tree_hash(src)
    check_failure(s2o(src, os.path.join(src, "orbax")), 7, "inside the source", src=src, before=before)


def test_missing_source(tmp_path):
    dst = str(tmp_path / "dst")
    check_failure(s2o(str(tmp_path / "nope"), dst), 3, "nope", dst=dst)


def test_pickle_weights_are_refused(tmp_path, checkpoints):
    src = tmp_path / "pickled"
    src.mkdir()
    shutil.copy(os.path.join(checkpoints["keqv_text_bf16_single"], "config.json"), src)
    marker = tmp_path / "unpickled"
    # a pickle that would create `marker` if anything unpickled it
    import pickle

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (src / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    dst = str(tmp_path / "dst")
    check_failure(s2o(str(src), dst), 5, "pytorch_model.bin", "safetensors", dst=dst)
    assert not marker.exists()


def test_towers_need_the_flag(checkpoints, tmp_path):
    src = copy_of(checkpoints, tmp_path, "keqv_lm_f32_sharded")
    index_path = os.path.join(src, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shard = sorted(set(index["weight_map"].values()))[0]
    key = "model.vision_tower.encoder.layers.0.mlp.up_proj.weight"

    def edit(t):
        t[key] = np.ones((3, 4), np.float32)
        return t

    rewrite(os.path.join(src, shard), edit)
    index["weight_map"][key] = shard
    json.dump(index, open(index_path, "w"))
    before, dst = tree_hash(src), str(tmp_path / "dst")
    check_failure(s2o(src, dst), 5, "--skip-multimodal", src=src, before=before, dst=dst)
    proc = s2o(src, dst, "--skip-multimodal")
    assert proc.returncode == 0, proc.stderr
    assert "dropped 1 vision/audio tensors" in proc.stdout
    assert tree_hash(src) == before


def test_bad_shard_size(checkpoints, tmp_path):
    orbax_dir = str(tmp_path / "orbax")
    assert s2o(checkpoints["keqv_text_bf16_single"], orbax_dir).returncode == 0
    before, dst = tree_hash(orbax_dir), str(tmp_path / "dst")
    proc = run_cli("convert", "orbax-to-safetensors", orbax_dir, dst, "--max-shard-size", "lots")
    check_failure(proc, 8, "--max-shard-size", src=orbax_dir, before=before, dst=dst)


def test_orbax_missing_leaf_and_wrong_config(checkpoints, tmp_path):
    orbax_dir = str(tmp_path / "orbax")
    assert s2o(checkpoints["keqv_text_bf16_single"], orbax_dir).returncode == 0
    before = tree_hash(orbax_dir)
    # a config with no k_eq_v expects kv_einsum on the global layer: the tree does not have it
    other = checkpoints["kv_text_f32_sharded"]
    dst = str(tmp_path / "dst")
    proc = run_cli("convert", "orbax-to-safetensors", orbax_dir, dst, "--config", os.path.join(other, "config.json"))
    check_failure(proc, 6, "layers/5/attn/kv_einsum/w", "missing", src=orbax_dir, before=before, dst=dst)


def test_not_a_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    dst = str(tmp_path / "dst")
    proc = run_cli("convert", "orbax-to-safetensors", str(empty), dst)
    check_failure(proc, 3, "not an Orbax checkpoint", dst=dst)
    proc = s2o(str(empty), dst)
    check_failure(proc, 3, "config.json", dst=dst)


def test_usage_errors_exit_2():
    proc = run_cli("convert", "safetensors-to-orbax")
    assert proc.returncode == 2 and "SRC" in proc.stderr
