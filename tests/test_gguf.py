"""GGUF files (ckptbridge/io/gguf.py) against llama.cpp's own gguf-py (PyPI ``gguf``): the same
metadata and tensors written by both are the same bytes, each reads what the other writes, and
Q8_0 blocks are bit-equal to gguf-py's quantizer (the reference implementation in ggml-quants.c).
Bad files and failed writes end in one error and leave nothing behind."""

from __future__ import annotations

import json
import os
import struct

import gguf  # llama.cpp's gguf-py, in every test environment (requirements/*.txt): the reference
import ml_dtypes
import numpy as np
import pytest

from ckptbridge.errors import CorruptFileError, InputNotFoundError, MismatchError, OutputError
from ckptbridge.io import gguf as ours

Q = gguf.GGMLQuantizationType


def values(seed: int = 0) -> np.ndarray:
    """Values that exercise Q8_0: random, an all-zero block, constant blocks, halves that round
    away from zero (x / d = k + 0.5 exactly), tiny and huge magnitudes, negatives."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((9, 128)) * 2).astype(np.float32)
    x[1] = 0
    x[2, :32] = 0.25
    x[3, :32] = np.concatenate([[127.0], np.arange(31) + 0.5]).astype(np.float32)  # d = 1: ties
    x[3, 32:64] = -x[3, :32]
    x[4] *= 1e-30
    x[5] *= 6e4
    return x


def test_q8_0_is_bit_equal_to_gguf_py():
    x = values()
    want = gguf.quants.quantize(x, Q.Q8_0)
    got = ours.quantize_q8_0(x)
    assert got.dtype == np.uint8 and got.shape == want.shape == (9, 4 * 34)
    assert np.array_equal(got, want)
    xb = x.astype(ml_dtypes.bfloat16)  # what a bf16 model hands it
    assert np.array_equal(ours.quantize_q8_0(xb), gguf.quants.quantize(xb.astype(np.float32), Q.Q8_0))
    assert np.array_equal(ours.dequantize_q8_0(got, x.shape), gguf.quants.dequantize(want, Q.Q8_0))
    with pytest.raises(ValueError, match="multiple of 32"):
        ours.quantize_q8_0(np.zeros((2, 48), np.float32))


METADATA = {
    "general.architecture": ours.string("llama"),
    "general.name": ours.string("tiny ünïcode"),
    "llama.block_count": ours.u32(2),
    "llama.rope.freq_base": ours.f32(500000.0),
    "llama.attention.causal": ours.boolean(True),
    "gemma4.attention.head_count_kv": ours.array([4, 4, 1], ours.ValueType.INT32),
    "tokenizer.ggml.tokens": ours.array(["<s>", "a", "é b"], ours.ValueType.STRING),
    "tokenizer.ggml.scores": ours.array([0.0, -1.5, -2.0], ours.ValueType.FLOAT32),
    "tokenizer.ggml.token_type": ours.array([3, 1, 1], ours.ValueType.INT32),
    "tokenizer.ggml.add_bos_token": ours.boolean(False),
    "general.file_type": ours.u32(7),
}


def planned(x: np.ndarray) -> list[ours.PlannedTensor]:
    xb = x.astype(ml_dtypes.bfloat16)
    return [
        ours.PlannedTensor("blk.0.attn_q.weight", x.shape, ours.TensorType.F32, lambda: x),
        ours.PlannedTensor("blk.0.attn_k.weight", x.shape, ours.TensorType.BF16, lambda: xb),
        ours.PlannedTensor("blk.0.ffn_up.weight", x.shape, ours.TensorType.Q8_0, lambda: ours.quantize_q8_0(x)),
        ours.PlannedTensor("blk.0.attn_norm.weight", (5,), ours.TensorType.F32, lambda: np.arange(5, dtype=np.float32)),
        ours.PlannedTensor("output.weight", (3, 128), ours.TensorType.F16, lambda: x[:3].astype(np.float16)),
    ]


def reference_file(path: str, x: np.ndarray) -> None:
    """The same file through gguf-py's GGUFWriter, value types spelled out as llama.cpp's converter does."""
    w = gguf.GGUFWriter(path, "llama")
    V = gguf.GGUFValueType
    w.add_string("general.name", "tiny ünïcode")
    w.add_uint32("llama.block_count", 2)
    w.add_float32("llama.rope.freq_base", 500000.0)
    w.add_bool("llama.attention.causal", True)
    w.add_key_value("gemma4.attention.head_count_kv", [4, 4, 1], V.ARRAY, sub_type=V.INT32)
    w.add_key_value("tokenizer.ggml.tokens", ["<s>", "a", "é b"], V.ARRAY, sub_type=V.STRING)
    w.add_key_value("tokenizer.ggml.scores", [0.0, -1.5, -2.0], V.ARRAY, sub_type=V.FLOAT32)
    w.add_key_value("tokenizer.ggml.token_type", [3, 1, 1], V.ARRAY, sub_type=V.INT32)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_uint32("general.file_type", 7)
    w.add_tensor("blk.0.attn_q.weight", x)
    w.add_tensor("blk.0.attn_k.weight", x.astype(ml_dtypes.bfloat16).view(np.uint16), raw_dtype=Q.BF16)
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(x, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.arange(5, dtype=np.float32))
    w.add_tensor("output.weight", x[:3].astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_written_bytes_equal_gguf_py_and_read_back(tmp_path):
    x = values()
    mine, theirs = str(tmp_path / "ours.gguf"), str(tmp_path / "gguf-py.gguf")
    written = []
    size = ours.write_gguf(mine, METADATA, planned(x), on_written=written.append)
    reference_file(theirs, x)
    with open(mine, "rb") as a, open(theirs, "rb") as b:
        assert a.read() == b.read()
    assert size == os.path.getsize(mine) and sum(written) == sum(t.nbytes for t in planned(x))

    r = gguf.GGUFReader(mine)  # llama.cpp's reader on ours
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "é b"]
    assert r.fields["tokenizer.ggml.token_type"].types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32]
    kinds = {t.name: (t.tensor_type, [int(d) for d in t.shape]) for t in r.tensors}
    assert kinds["blk.0.ffn_up.weight"] == (Q.Q8_0, [128, 9])  # ggml's order: innermost first
    assert kinds["output.weight"] == (Q.F16, [128, 3])
    assert all(t.data_offset % 32 == 0 for t in r.tensors)

    back = ours.read_gguf(theirs)  # ours on llama.cpp's writer
    assert back.version == 3 and back.alignment == 32
    assert back.metadata == {k: v.value for k, v in METADATA.items()}
    assert back.types == {k: v.type for k, v in METADATA.items()}
    assert {n: (t.shape, t.type) for n, t in back.tensors.items()} == {t.name: (t.shape, t.type) for t in planned(x)}
    assert np.array_equal(back.values("blk.0.attn_q.weight"), x)
    assert back.values("blk.0.attn_k.weight").tobytes() == x.astype(ml_dtypes.bfloat16).tobytes()
    assert np.array_equal(back.array("blk.0.ffn_up.weight"), gguf.quants.quantize(x, Q.Q8_0))
    assert np.abs(back.values("blk.0.ffn_up.weight") - x).max() <= np.abs(x).max() / 127


def test_bad_files_are_one_error(tmp_path):
    with pytest.raises(InputNotFoundError, match="no such file"):
        ours.read_gguf(str(tmp_path / "missing.gguf"))
    other = tmp_path / "model.safetensors"
    other.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(CorruptFileError, match="not a GGUF file"):
        ours.read_gguf(str(other))
    good = str(tmp_path / "good.gguf")
    ours.write_gguf(good, METADATA, planned(values()))
    data = open(good, "rb").read()
    for cut in (10, 200, len(data) - 100):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(CorruptFileError, match=r"truncated\?"):
            ours.read_gguf(str(p))


def test_failed_writes_leave_nothing(tmp_path):
    x = values()
    dst = tmp_path / "out.gguf"

    def boom():
        raise RuntimeError("read failed")

    tensors = planned(x)
    broken = [*tensors[:2], ours.PlannedTensor("blk.0.ffn_up.weight", x.shape, ours.TensorType.Q8_0, boom)]
    with pytest.raises(RuntimeError, match="read failed"):
        ours.write_gguf(str(dst), METADATA, broken)
    wrong = [ours.PlannedTensor("a", x.shape, ours.TensorType.Q8_0, lambda: x)]  # values, not Q8_0 blocks
    with pytest.raises(MismatchError, match=r"a: produced float32 \(9, 128\).*uint8 \(9, 136\)"):
        ours.write_gguf(str(dst), METADATA, wrong)
    with pytest.raises(ValueError, match="planned twice"):
        ours.write_gguf(str(dst), METADATA, [tensors[0], tensors[0]])
    assert os.listdir(tmp_path) == []  # no file, no temporary left

    dst.write_bytes(b"keep")
    with pytest.raises(OutputError, match="already exists"):
        ours.write_gguf(str(dst), METADATA, tensors)
    assert dst.read_bytes() == b"keep"
    ours.write_gguf(str(dst), METADATA, tensors, overwrite=True)
    assert ours.read_gguf(str(dst)).tensors.keys() == {t.name for t in tensors}
    assert sorted(os.listdir(tmp_path)) == ["out.gguf"]


def test_inspect_says_what_a_gguf_file_holds(tmp_path):
    from conftest import run_cli

    path = str(tmp_path / "m.gguf")
    meta = {**METADATA, "tokenizer.ggml.model": ours.string("gpt2"), "llama.context_length": ours.u32(4096),
            "tokenizer.chat_template": ours.string("{{ messages }}")}
    ours.write_gguf(path, meta, planned(values()))
    info = json.loads(run_cli("inspect", path, "--json").stdout)
    assert info["kind"] == "gguf-model" and info["architecture"] == "llama" and info["gguf_version"] == 3
    assert info["tensor_types"] == {"F32": 2, "BF16": 1, "Q8_0": 1, "F16": 1}
    assert info["tensors"] == 5 and info["parameters"] == 3 * 9 * 128 + 5 + 3 * 128
    assert info["bytes"] == sum(t.nbytes for t in planned(values()))
    assert (info["block_count"], info["context_length"], info["tokenizer"], info["vocab"]) == (2, 4096, "gpt2", 3)
    assert info["chat_template"] is True
    text = run_cli("inspect", path).stdout
    assert text.startswith(f"{path}: gguf-model") and "tensor_types" in text and "Q8_0: 1" in text

    adapter = str(tmp_path / "a.gguf")
    ours.write_gguf(adapter, {"general.architecture": ours.string("llama"), "general.type": ours.string("adapter"),
                              "adapter.type": ours.string("lora"), "adapter.lora.alpha": ours.f32(16.0)},
                    [ours.PlannedTensor("blk.0.attn_q.weight.lora_a", (8, 128), ours.TensorType.F32,
                                        lambda: np.zeros((8, 128), np.float32))])
    info = json.loads(run_cli("inspect", adapter, "--json").stdout)
    assert (info["kind"], info["adapter_type"], info["lora_alpha"]) == ("gguf-adapter", "lora", 16.0)

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(open(path, "rb").read()[:300])
    r = run_cli("inspect", str(broken))
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "truncated" in r.stderr


def test_nested_arrays_and_odd_headers(tmp_path):
    """What gguf-py writes for an array of arrays reads back; a header that claims too many
    dimensions or a zero alignment is one clear error."""
    p = str(tmp_path / "nested.gguf")
    w = gguf.GGUFWriter(p, "llama")
    w.add_array("x.nested", [[1, 2], [3]])
    w.add_custom_alignment(64)
    w.add_tensor("t", np.ones((2, 3), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = ours.read_gguf(p)
    assert f.metadata["x.nested"] == [[1, 2], [3]] and f.alignment == 64 and f.tensors["t"].offset % 64 == 0
    assert np.array_equal(f.values("t"), np.ones((2, 3), np.float32))

    bad = str(tmp_path / "zero-align.gguf")
    ours.write_gguf(bad, {"general.alignment": ours.u32(32)}, [])
    data = bytearray(open(bad, "rb").read())
    at = data.index(b"general.alignment") + len("general.alignment") + 4  # the value, after its key and type
    assert data[at:at + 4] == struct.pack("<I", 32)
    data[at:at + 4] = struct.pack("<I", 0)
    open(bad, "wb").write(data)
    with pytest.raises(CorruptFileError, match="general.alignment is 0"):
        ours.read_gguf(bad)
