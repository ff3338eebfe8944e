"""``ckptbridge convert`` and ``ckptbridge.convert``: what the matrix (tests/test_matrix.py) does
not cover by itself. GGUF read in every stored type (Q8_0 against gguf-py's own dequantization),
adapters merged into MaxText and GGUF in one pass, MaxText to GGUF q8_0 and fp8, the formats
table, and bad input: one line naming the file or the option and the fix, a non-zero exit,
nothing written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import WIDE, assert_same_model, run_cli

from ckptbridge import convert
from ckptbridge.errors import ConfigError

pytestmark = pytest.mark.slow


def test_formats_table_lists_every_format():
    from ckptbridge import formats

    proc = run_cli("formats")
    assert proc.returncode == 0, proc.stderr
    for f in formats.FORMATS.values():
        assert f.name in proc.stdout and f.title in proc.stdout
    rows = json.loads(run_cli("formats", "--json").stdout)
    assert [r["format"] for r in rows] == list(formats.FORMATS)
    assert {r["format"]: r["writes"] for r in rows}["gguf-lora"] and not {r["format"]: r["reads"]
                                                                         for r in rows}["gguf-lora"]


def test_q8_0_is_read_as_gguf_py_dequantizes_it(wide, tmp_path):
    """A Q8_0 file read back: float32 values bit-equal to gguf-py's ``gguf.quants.dequantize`` of
    each tensor (rows that are not whole blocks stored F16, norms F32: as stored); ``dtype``
    bfloat16 is that float32 rounded to nearest even."""
    import gguf as ggufpy
    import ml_dtypes

    from ckptbridge.io.gguf import read_gguf
    from ckptbridge.io.hf import HFModelDir

    src = wide["qwen3_untied"]
    q8 = str(tmp_path / "q8.gguf")
    convert(src, q8, outtype="q8_0", progress=False)
    f32, bf16 = str(tmp_path / "f32"), str(tmp_path / "bf16")
    convert(q8, f32, to="hf", config=src, progress=False)
    convert(q8, bf16, to="hf", config=src, dtype="bfloat16", progress=False)
    file = read_gguf(q8)
    with HFModelDir(f32) as a, HFModelDir(bf16) as b:
        assert {a.info(k).dtype for k in a.keys()} == {"F32"} and {b.info(k).dtype for k in b.keys()} == {"BF16"}
        got = a.array("model.layers.1.mlp.down_proj.weight")
        t = file.tensors["blk.1.ffn_down.weight"]
        assert t.type.name == "Q8_0"
        want = ggufpy.quants.dequantize(np.asarray(file.array(t.name)), ggufpy.GGMLQuantizationType.Q8_0)
        assert got.tobytes() == np.asarray(want, np.float32).reshape(got.shape).tobytes()
        assert np.array_equal(b.array("model.layers.1.mlp.down_proj.weight").view(np.uint16),
                              got.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_float16_gguf_round_trip_is_bitwise(tmp_path):
    from ckptbridge.testing import build_checkpoint

    src = build_checkpoint(str(tmp_path / "f16"), family="qwen3", dtype="float16", seed=3, **WIDE)
    out, back = str(tmp_path / "m.gguf"), str(tmp_path / "back")
    assert convert(src, out, outtype="auto", progress=False).outtype == "f16"
    convert(out, back, to="hf", config=src, progress=False)
    assert_same_model(src, back, set())


@pytest.mark.parametrize("to", ["maxtext", "gguf"])
def test_base_and_tunix_lora_in_one_pass(checkpoints, adapters, tmp_path, to):
    """base + a Tunix LoRA checkpoint -> MaxText (scanned) or GGUF q8_0 in one pass: the same tensors
    as converting the model merge_lora makes."""
    from ckptbridge import merge_lora

    name = "qwen3_untied"
    base, lora = checkpoints[name], adapters[name].tunix
    merged = str(tmp_path / "merged")
    merge_lora(base, lora, merged, progress=False)
    opts = {"scan_layers": True} if to == "maxtext" else {"outtype": "q8_0"}
    ext = ".gguf" if to == "gguf" else ""
    one, two = str(tmp_path / f"one{ext}"), str(tmp_path / f"two{ext}")
    report = convert(base, one, to=to, adapter=lora, progress=False, **opts, **({"name": "m"} if ext else {}))
    convert(merged, two, to=to, progress=False, **opts, **({"name": "m"} if ext else {}))
    if to == "gguf":
        assert report.adapter == lora
        assert open(one, "rb").read() == open(two, "rb").read()
        return
    assert report.adapters == [lora]
    back_one, back_two = str(tmp_path / "back1"), str(tmp_path / "back2")
    convert(one, back_one, to="hf", progress=False)
    convert(two, back_two, to="hf", progress=False)
    assert_same_model(back_two, back_one, set())


def test_maxtext_to_gguf_q8_0_and_fp8(wide, tmp_path):
    """MaxText -> GGUF q8_0 holds what HF -> GGUF q8_0 writes (the same metadata and tensors, each
    the same bytes; in the rows' order, where the HF file follows ggml's converter's order of the
    HF files); MaxText -> fp8 the tensors HF -> fp8 writes."""
    from ckptbridge.io.gguf import read_gguf

    src = wide["qwen3_untied"]
    mt = str(tmp_path / "mt")
    convert(src, mt, to="maxtext", scan_layers=True, progress=False)
    a, b = str(tmp_path / "a.gguf"), str(tmp_path / "b.gguf")
    convert(mt, a, outtype="q8_0", name="m", tokenizer=False, progress=False)
    convert(src, b, outtype="q8_0", name="m", tokenizer=False, progress=False)
    fa_, fb_ = read_gguf(a), read_gguf(b)
    assert fa_.metadata == fb_.metadata and set(fa_.tensors) == set(fb_.tensors)
    for n, t in fb_.tensors.items():
        assert (fa_.tensors[n].shape, fa_.tensors[n].type) == (t.shape, t.type), n
        assert fa_.array(n).tobytes() == fb_.array(n).tobytes(), n
    assert fa_.tensors["blk.0.attn_q.weight"].type.name == "Q8_0"  # rows of whole blocks
    fa, fb = str(tmp_path / "fa"), str(tmp_path / "fb")
    convert(mt, fa, to="compressed-tensors", quantize="fp8", progress=False)
    convert(src, fb, to="hf", quantize="fp8", progress=False)
    assert_same_model(fb, fa, set())


def _refused(args, code, *words, tmp_path=None):
    proc = run_cli("convert", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("ckptbridge: error:"), proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_bad_input_is_one_line_and_writes_nothing(checkpoints, tmp_path):
    src = checkpoints["qwen3_untied_bf16_sharded"]
    dst = str(tmp_path / "out")
    gg = str(tmp_path / "m.gguf")
    assert convert(src, gg, progress=False).tensors > 0
    truncated = str(tmp_path / "cut.gguf")
    with open(gg, "rb") as f, open(truncated, "wb") as g:
        g.write(f.read()[: os.path.getsize(gg) // 2])
    cases = [
        (["--to", "safetensors"], 8, "format 'safetensors'", "ckptbridge formats"),
        (["--to", "peft"], 8, src, "holds an adapter", "hf, compressed-tensors"),
        (["--to", "tunix", "--scan-layers"], 8, "--scan-layers", "writing maxtext", "drop it"),
        (["--to", "hf", "--outtype", "q8_0"], 8, "--outtype", "writing gguf"),
        (["--to", "compressed-tensors"], 8, "--quantize int8|fp8"),
        ([], 8, "--to"),  # no format said, and DST's name says none
    ]
    for extra, code, *words in cases:
        _refused([src, dst, *extra], code, *words)
    _refused([gg, dst, "--to", "hf"], 8, gg, "--config")
    _refused([truncated, dst, "--to", "hf", "--config", src], 4, truncated, "truncated")
    _refused([src, dst, "--to", "tunix", "--adapter", src], 8, src, "not an adapter")
    _refused([src, dst, "--to", "tunix", "--base", src, "--adapter", src], 8, src, "--base", "drop it")
    assert not os.path.exists(dst)
    assert not [n for n in os.listdir(tmp_path) if ".ckptbridge-tmp-" in n]
    with pytest.raises(ConfigError, match="scan_layer: not an option of convert"):
        convert(src, dst, to="maxtext", scan_layer=True)
    with pytest.raises(ConfigError, match="format 'safetensors'"):
        convert(src, dst, to="safetensors")
