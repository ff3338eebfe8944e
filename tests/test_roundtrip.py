"""HF -> Orbax -> HF: bit for bit, with the Orbax tree in Tunix's layout."""

import json
import os

import numpy as np
import pytest

from ckptbridge import mapping
from ckptbridge.convert import convert_orbax_to_safetensors, convert_safetensors_to_orbax, open_hf_source
from ckptbridge.io.hf import HFModelDir
from ckptbridge.io.orbax import nest
from ckptbridge.verify import compare_tensors

from conftest import CASES, tree_hash


@pytest.mark.parametrize("case", list(CASES))
def test_bitwise_round_trip(checkpoints, tmp_path, case):
    src = checkpoints[case]
    before = tree_hash(src)
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")
    r = convert_safetensors_to_orbax(src, orbax_dir, progress=False)
    assert r.key_prefix == CASES[case]["prefix"]
    convert_orbax_to_safetensors(orbax_dir, back, progress=False)
    same = compare_tensors(src, back)
    assert same.identical, same
    assert same.tensors > 0
    with HFModelDir(src) as a, HFModelDir(back) as b:
        assert sorted(a.keys()) == sorted(b.keys())
        for k in a.keys():
            assert a.info(k).dtype == b.info(k).dtype
            assert a.array(k).tobytes() == b.array(k).tobytes()
    # config and the non-weight files come back
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(src, "config.json")))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert open(os.path.join(back, name), "rb").read() == open(os.path.join(src, name), "rb").read()
    assert tree_hash(src) == before


def test_orbax_tree_is_the_tunix_state(checkpoints, tmp_path):
    import orbax.checkpoint as ocp

    src = checkpoints["keqv_lm_f32_sharded"]
    dst = str(tmp_path / "orbax")
    convert_safetensors_to_orbax(src, dst, progress=False)
    tree = ocp.StandardCheckpointer().restore(os.path.abspath(dst))
    assert set(tree) == {"embedder", "layers", "final_norm"}
    assert sorted(tree["layers"], key=int) == [str(i) for i in range(6)]
    k = tree["layers"]["5"]["attn"]["k_einsum"]["w"]
    assert k.shape == (1, 40, 20) and k.dtype == np.float32
    assert "kv_einsum" not in tree["layers"]["5"]["attn"]
    assert tree["layers"]["0"]["attn"]["kv_einsum"]["w"].shape == (2, 2, 40, 12)
    with open_hf_source(src) as source:
        for e in source.entries:
            node = tree
            for p in e.tunix_path:
                node = node[p]
            np.testing.assert_array_equal(np.asarray(node), source.tunix_value(e))


def test_bfloat16_stays_bfloat16(checkpoints, tmp_path):
    import ml_dtypes
    import orbax.checkpoint as ocp

    dst = str(tmp_path / "orbax")
    convert_safetensors_to_orbax(checkpoints["keqv_text_bf16_single"], dst, progress=False)
    tree = ocp.StandardCheckpointer().restore(os.path.abspath(dst))
    assert tree["layers"]["1"]["mlp"]["down_proj"]["kernel"].dtype == ml_dtypes.bfloat16


def test_metadata_records_config_family_prefix(checkpoints, tmp_path):
    from ckptbridge.io.orbax import OrbaxCheckpoint

    src = checkpoints["kv_text_f32_sharded"]
    dst = str(tmp_path / "orbax")
    convert_safetensors_to_orbax(src, dst, progress=False)
    with OrbaxCheckpoint(dst) as ck:
        meta = ck.ckptbridge_metadata
    assert meta["family"] == "gemma4"
    assert meta["key_prefix"] == "model."
    assert meta["hf_config"] == json.load(open(os.path.join(src, "config.json")))
    assert meta["format_version"] == 1 and meta["kind"] == "weights"


def test_sharded_output_with_index(checkpoints, tmp_path):
    src = checkpoints["keqv_lm_f32_sharded"]
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")
    convert_safetensors_to_orbax(src, orbax_dir, progress=False)
    r = convert_orbax_to_safetensors(orbax_dir, back, max_shard_size="100KB", progress=False)
    shards = [f for f in r.files if f.endswith(".safetensors")]
    assert len(shards) > 2
    index = json.load(open(os.path.join(back, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    sizes = [os.path.getsize(os.path.join(back, s)) for s in shards]
    assert max(sizes) < 100_000 + 4096  # header slack
    assert compare_tensors(src, back).identical


def test_tunix_tree_without_metadata_needs_config(checkpoints, tmp_path):
    """A tree written by Tunix itself (nnx state with 'value' leaves, no ckptbridge metadata)."""
    import orbax.checkpoint as ocp

    from ckptbridge.errors import ConfigError

    src = checkpoints["kv_lm_bf16_sharded"]
    flat = {}
    with open_hf_source(src) as source:
        for e in source.entries:
            flat[e.tunix_path + ("value",)] = np.array(source.tunix_value(e))
    tree = nest(flat)
    ckpt = os.path.abspath(str(tmp_path / "tunix_tree"))
    ocp.PyTreeCheckpointer().save(ckpt, tree)
    with pytest.raises(ConfigError, match="--config"):
        convert_orbax_to_safetensors(ckpt, str(tmp_path / "x"), progress=False)
    assert not os.path.exists(tmp_path / "x")
    back = str(tmp_path / "back")
    convert_orbax_to_safetensors(ckpt, back, config=src, progress=False)
    assert compare_tensors(src, back).identical


def test_checkpoint_manager_layout_is_found(checkpoints, tmp_path):
    src = checkpoints["keqv_text_bf16_single"]
    root = tmp_path / "run"
    (root / "100").mkdir(parents=True)
    convert_safetensors_to_orbax(src, str(root / "100" / "model_params"), progress=False)
    back = str(tmp_path / "back")
    convert_orbax_to_safetensors(str(root), back, progress=False)
    assert compare_tensors(src, back).identical


def test_every_tensor_maps_to_an_entry(checkpoints):
    with open_hf_source(checkpoints["keqv_lm_f32_sharded"]) as source:
        mapped = {k for e in source.entries for k in e.hf_keys}
        assert mapped == set(source.model.keys())
        assert len({e.tunix_path for e in source.entries}) == len(source.entries)
        assert all(isinstance(e, mapping.Entry) for e in source.entries)


@pytest.mark.slow
def test_per_layer_config_dialect(checkpoints, tmp_path):
    """A config in the per_layer_config dialect converts, round-trips and gives the same model."""
    import shutil

    import jax

    from ckptbridge.specs.gemma4 import to_per_layer_config
    from ckptbridge.tunix_model import load_tunix_model
    from ckptbridge.verify import hf_logits, tunix_logits

    legacy = checkpoints["keqv_lm_f32_sharded"]
    src = str(tmp_path / "plc")
    shutil.copytree(legacy, src)
    to_per_layer_config(os.path.join(src, "config.json"))
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")
    convert_safetensors_to_orbax(src, orbax_dir, progress=False)
    convert_orbax_to_safetensors(orbax_dir, back, progress=False)
    assert compare_tensors(src, back).identical
    assert "per_layer_config" in json.load(open(os.path.join(back, "config.json")))["text_config"]
    jax.config.update("jax_default_matmul_precision", "highest")
    model, _ = load_tunix_model(orbax_dir)
    tokens = np.random.default_rng(3).integers(0, 300, size=(1, 11))
    ours, ref = tunix_logits(model, tokens), hf_logits(legacy, tokens)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) <= 1e-5


@pytest.mark.parametrize("in_kernel", [True, False], ids=["copy_file_range", "read-write"])
def test_file_ranges_copy_bytes_exactly(tmp_path, monkeypatch, in_kernel):
    """Untouched tensors are copied file to file (copy_file_range, or read + write where the
    kernel cannot), in steps smaller than the tensor, with writeback started along the way."""
    import ml_dtypes

    from ckptbridge.io import safetensors as st

    monkeypatch.setattr(st, "COPY_STEP", 1000)
    monkeypatch.setattr(st, "WRITEBACK_EVERY", 4096)
    if not in_kernel:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((37, 101)).astype(ml_dtypes.bfloat16),
               "b": rng.integers(0, 100, (3, 7, 5)).astype(np.int32), "c": np.zeros((0, 4), np.float32)}
    src, dst = str(tmp_path / "src.safetensors"), str(tmp_path / "dst.safetensors")
    st.write_file(src, [st.PlannedTensor(k, v.dtype, v.shape, lambda v=v: v) for k, v in tensors.items()])
    with st.SafetensorsFile(src) as f:
        planned = [st.PlannedTensor(k, st.numpy_dtype(f.info(k).dtype), f.info(k).shape,
                                    chunks=lambda k=k: [f.byte_range(k)]) for k in f.keys()]
        planned.insert(1, st.PlannedTensor("mid", np.float32, (5,), lambda: np.arange(5, dtype=np.float32)))
        st.write_file(dst, planned)
    with st.SafetensorsFile(dst) as g:
        for k, v in tensors.items():
            assert g.array(k).tobytes() == v.tobytes() and g.array(k).dtype == v.dtype
        assert g.array("mid").tolist() == [0, 1, 2, 3, 4]


def test_file_range_of_a_truncated_source_is_an_error(tmp_path):
    from ckptbridge.errors import CorruptFileError
    from ckptbridge.io import safetensors as st

    src, dst = str(tmp_path / "src.safetensors"), str(tmp_path / "dst.safetensors")
    v = np.ones((64, 64), np.float32)
    st.write_file(src, [st.PlannedTensor("w", v.dtype, v.shape, lambda: v)])
    with st.SafetensorsFile(src) as f:
        os.truncate(src, os.path.getsize(src) - 100)
        with pytest.raises(CorruptFileError, match="'w' ends early"):
            st.write_file(dst, [st.PlannedTensor("w", v.dtype, v.shape, chunks=lambda: [f.byte_range("w")])])
