"""GGUF export and import (``ckptbridge.formats.gguf``, ``ckptbridge convert ... --to gguf``).

The reference is ggml's own converter: ``convert_hf_to_gguf.py`` of llama.cpp, with its
``conversion/`` package and gguf-py, as vendored in the llama-cpp-python 0.3.36 sdist (which
scripts/setup.sh unpacks into build/ggml; tests/ggml_converter.py runs it). For every family row of
the contract table our file is the same bytes as the converter's for the same model and output
type: metadata (architecture keys, tokenizer, chat template), tensor names, order, shapes, stored
types and values (Gemma 1-3 norms + 1, Llama's q/k rows reordered, Qwen 3 MoE experts stacked,
Gemma 4's rope_freqs and per-layer arrays); and the converter's files read back give the source's
tensors. A multimodal row's towers go to the projector file beside the text file (``mmproj-``):
the same bytes as the converter's ``--mmproj`` output (Gemma 3's vision tower, Gemma 4's vision
and audio towers), read back with the text file. Then: values against the source without the
converter, an adapter merged on the way, an Orbax source, and bad input.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from families import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERTER = os.path.join(ROOT, "build", "ggml")
MAIN_ROWS = [n for n in CASES if not n.endswith("_bf16_sharded")] + ["kv_lm_bf16_sharded", "qwen3_moe_bf16_sharded"]
# not a row of the table (Tunix routes Gemma 4's experts differently: tests/test_gemma4_extras.py)
GEMMA4_MOE = dict(family="gemma4", enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=32)
WIDE_ROWS = ["keqv_lm_f32_sharded", "gemma4_e2b", "gemma3_text", "gemma2", "qwen3_moe", "qwen2_untied", "llama3_tied"]


def _export(src: str, dst: str, outtype: str, **kw) -> str:
    from ckptbridge import convert_to_gguf

    convert_to_gguf(src, dst, outtype=outtype, progress=False, **kw)
    return dst


def test_exports_are_the_bytes_of_ggmls_converter(checkpoints, wide, tmp_path):
    """Every family row (f32 and bf16; f16 and q8_0 at widths of whole Q8_0 blocks) and a Gemma 4
    MoE model, ours against the converter's, file for file."""
    from conftest import WIDE

    from ckptbridge.testing import build_checkpoint

    assert os.path.isfile(os.path.join(CONVERTER, "convert_hf_to_gguf.py")), \
        "build/ggml has no converter: scripts/setup.sh unpacks it"
    jobs, pairs = [], []
    for name in MAIN_ROWS:
        for outtype in ("f32", "bf16"):
            pairs.append((name, outtype, checkpoints[name]))
    for name in WIDE_ROWS:
        for outtype in ("f16", "q8_0"):
            pairs.append((name + "_wide", outtype, wide[name]))
    sampled = tmp_path / "llama3_sampled"  # general.sampling.* from generation_config.json
    shutil.copytree(checkpoints["llama3_tied"], sampled)
    (sampled / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20, "bos_token_id": 2, "eos_token_id": 1}))
    pairs.append(("llama3_sampled", "bf16", str(sampled)))
    moe = build_checkpoint(str(tmp_path / "gemma4_moe"), seed=5, **GEMMA4_MOE)
    moe_wide = build_checkpoint(str(tmp_path / "gemma4_moe_wide"), seed=5, **GEMMA4_MOE, **WIDE)
    pairs += [("gemma4_moe", "f32", moe), ("gemma4_moe", "bf16", moe), ("gemma4_moe_wide", "q8_0", moe_wide)]
    projectors = []
    for name, outtype, src in pairs:
        ours, theirs = tmp_path / f"{name}.{outtype}.gguf", tmp_path / f"{name}.{outtype}.ref.gguf"
        _export(src, str(ours), outtype)
        jobs.append([src, str(theirs), outtype])
        if CASES.get(name) is not None and CASES[name].multimodal:  # ggml reads Gemma 3's tower in the Hub's names
            from test_towers import hub_spelled

            hub = str(tmp_path / "hub" / name)  # (the same directory name: general.name)
            if CASES[name].family != "gemma3":
                hub = src
            elif not os.path.exists(hub):
                hub_spelled(src, hub)
            jobs.append([hub, str(tmp_path / f"mmproj-{name}.{outtype}.ref.gguf"), outtype, "mmproj"])
            projectors.append((name, outtype))
    assert {n for n, _ in projectors} == {n for n in MAIN_ROWS if CASES[n].multimodal}
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "ggml_converter.py"), CONVERTER,
                           str(tmp_path / "jobs.json")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    differ = []
    files = [f"{name}.{outtype}" for name, outtype, _ in pairs] + [f"mmproj-{n}.{o}" for n, o in projectors]
    for stem in files:
        ours = (tmp_path / f"{stem}.gguf").read_bytes()
        theirs = (tmp_path / f"{stem}.ref.gguf").read_bytes()
        if ours != theirs:
            differ.append(f"{stem}: {_difference(tmp_path / f'{stem}.gguf', tmp_path / f'{stem}.ref.gguf')}")
    assert not differ, "\n".join(differ)
    assert len(pairs) == 2 * len(MAIN_ROWS) + 2 * len(WIDE_ROWS) + 4
    # the converter's own files read back (GGUF in): the source's tensors, bit for bit where the file
    # stores the source's float type (norms ggml stores as 1 + w within their bound)
    from conftest import assert_same_model

    from ckptbridge import convert, formats
    from ckptbridge.formats.hf import open_hf_source

    read = 0
    for name, outtype, src in pairs:
        with open_hf_source(src, keep_towers=True) as s:
            spec, cfg = s.spec, s.cfg
            dtype = s.dtype(s.entries[0])
            inexact = formats.get("gguf").inexact(spec, cfg, outtype=outtype)
            allowed = {k for e in s.all_entries if (f"{e.tower}:{e.rule.name}" if e.tower else e.rule.name) in inexact
                       for k in e.hf_keys}
            coarse = {k for e in s.tower_entries if "float16" in inexact.get(f"{e.tower}:{e.rule.name}", "")
                      for k in e.hf_keys}
        if {"f32": "float32", "bf16": "bfloat16"}.get(outtype) != dtype.name:
            continue
        back = str(tmp_path / f"{name}.{outtype}.back")
        convert(str(tmp_path / f"{name}.{outtype}.ref.gguf"), back, to="hf", config=src, progress=False)
        assert_same_model(src, back, allowed, coarse=coarse)
        read += 1
    assert read >= len(MAIN_ROWS)
    from ckptbridge.io.gguf import read_gguf

    assert read_gguf(str(tmp_path / "llama3_sampled.bf16.gguf")).metadata["general.sampling.top_k"] == 20


def _difference(a, b) -> str:
    """What differs between two GGUF files, read with gguf-py's reader (for the failure message)."""
    from gguf import GGUFReader

    def load(p):
        r = GGUFReader(p)
        kv = {f.name: f.contents() for f in r.fields.values() if not f.name.startswith("GGUF.")}
        return kv, {t.name: (tuple(t.shape), t.tensor_type.name, t.data.tobytes()) for t in r.tensors}

    (ka, ta), (kb, tb) = load(a), load(b)
    out = [f"{k}: {str(ka.get(k))[:80]} vs {str(kb.get(k))[:80]}" for k in sorted(set(ka) | set(kb))
           if ka.get(k) != kb.get(k)]
    out += [f"{n}: {ta.get(n, ('-',))[:2]} vs {tb.get(n, ('-',))[:2]}" for n in sorted(set(ta) | set(tb))
            if ta.get(n) != tb.get(n)]
    return "; ".join(out[:8]) or f"tensor order: {list(ta)[:5]} vs {list(tb)[:5]}"


def test_values_follow_the_source(wide, tmp_path):
    """Without the converter: bf16 from a bf16 source is the same bits, q8_0 is gguf-py's quantizer
    of the source, norms stay float32, and the tokenizer is the HF one's."""
    import gguf as ggufpy

    from ckptbridge.io.gguf import read_gguf
    from ckptbridge.io.hf import HFModelDir

    name = "keqv_text_bf16_single"
    src = wide[name]
    bf16 = read_gguf(_export(src, str(tmp_path / "bf16.gguf"), "bf16"))
    q8 = read_gguf(_export(src, str(tmp_path / "q8.gguf"), "q8_0"))
    with HFModelDir(src) as model:
        w = model.array("model.layers.0.self_attn.q_proj.weight")
        assert w.dtype.name == "bfloat16"
        assert np.array_equal(bf16.array("blk.0.attn_q.weight").view(np.uint16), w.view(np.uint16))
        expect = ggufpy.quants.quantize(w.astype(np.float32), ggufpy.GGMLQuantizationType.Q8_0)
        assert np.array_equal(q8.array("blk.0.attn_q.weight"), expect)
        norm = model.array("model.layers.0.input_layernorm.weight")
        assert q8.tensors["blk.0.attn_norm.weight"].type.name == "F32"
        assert np.array_equal(q8.array("blk.0.attn_norm.weight"), norm.astype(np.float32))  # Gemma 4: no + 1
    tok = json.load(open(os.path.join(src, "tokenizer.json")))
    tokens = bf16.metadata["tokenizer.ggml.tokens"]
    assert [tokens[i] for i in sorted(tok["model"]["vocab"].values())[:300]] == \
        [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]
    assert bf16.metadata["tokenizer.chat_template"] == open(os.path.join(src, "chat_template.jinja")).read()


def test_an_adapter_merged_on_the_way_is_the_merged_models_export(checkpoints, adapters, tmp_path):
    """``--adapter``: a PEFT adapter and a Tunix LoRA checkpoint, each merged while exporting, give
    the file the export of the merged model gives (same bytes)."""
    from ckptbridge import merge_lora

    name = "qwen3_untied"
    base = checkpoints[name]
    for kind, adapter in (("peft", adapters[name].peft), ("tunix", adapters[name].tunix)):
        merged = str(tmp_path / f"merged-{kind}")
        merge_lora(base, adapter, merged, progress=False)
        a = _export(base, str(tmp_path / f"{kind}-on-the-way.gguf"), "f32", adapter=adapter, name="m")
        b = _export(merged, str(tmp_path / f"{kind}-merged.gguf"), "f32", name="m")
        assert open(a, "rb").read() == open(b, "rb").read(), kind
        plain = _export(base, str(tmp_path / f"{kind}-base.gguf"), "f32", name="m")
        assert open(a, "rb").read() != open(plain, "rb").read()


def test_an_orbax_checkpoint_exports_as_its_hf_model(checkpoints, converted, tmp_path):
    """From the Tunix Orbax checkpoint of a row: the same metadata and tensors as from its HF
    directory (written in the checkpoint's own order)."""
    from ckptbridge.io.gguf import read_gguf

    for name in ("keqv_lm_f32_sharded", "qwen3_moe"):
        hf = read_gguf(_export(checkpoints[name], str(tmp_path / f"{name}-hf.gguf"), "bf16", name="m"))
        orbax = read_gguf(_export(converted[name][0], str(tmp_path / f"{name}-orbax.gguf"), "bf16", name="m"))
        assert orbax.metadata == hf.metadata
        assert sorted(orbax.tensors) == sorted(hf.tensors)
        for t in hf.tensors:
            assert np.array_equal(orbax.array(t), hf.array(t)), (name, t)


def test_bad_input_ends_in_one_line_and_writes_nothing(checkpoints, converted, tmp_path):
    src = checkpoints["llama3_tied"]
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"keep")

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", "ckptbridge", "convert", "to-gguf", *args],
                              capture_output=True, text=True, cwd=ROOT)
        return proc.returncode, proc.stderr.strip()

    code, err = run(src, str(dst))
    assert code == 7 and "already exists" in err and dst.read_bytes() == b"keep"
    from ckptbridge.errors import ConfigError

    with pytest.raises(ConfigError, match="outtype"):
        _export(src, str(tmp_path / "x.gguf"), "q4")
    assert not (tmp_path / "x.gguf").exists()
    code, err = run(converted["llama3_tied"][0], str(tmp_path / "y.gguf"), "--adapter", src)
    assert code == 8 and "not an adapter" in err and not (tmp_path / "y.gguf").exists()  # a model as --adapter
    # a tokenizer GGUF cannot express: a WordPiece one
    odd = tmp_path / "wordpiece"
    shutil.copytree(src, odd)
    tok = json.loads((odd / "tokenizer.json").read_text())
    tok["model"] = {"type": "WordPiece", "vocab": tok["model"]["vocab"], "unk_token": "<unk>"}
    (odd / "tokenizer.json").write_text(json.dumps(tok))
    code, err = run(str(odd), str(tmp_path / "z.gguf"))
    assert code != 0 and len(err.splitlines()) == 1 and "WordPiece" in err and "--no-tokenizer" in err
    assert not (tmp_path / "z.gguf").exists()
    code, err = run(str(odd), str(tmp_path / "z.gguf"), "--no-tokenizer", "--quiet")
    assert code == 0, err
    from ckptbridge.io.gguf import read_gguf

    assert not any(k.startswith("tokenizer.") for k in read_gguf(str(tmp_path / "z.gguf")).metadata)


def test_verify_gguf_finds_every_changed_tensor(checkpoints, wide, adapters, tmp_path):
    """``verify gguf``: our files (q8_0 with Gemma's norm shift, f16, an adapter merged) are
    identical to their sources; one changed byte is named; a file of another model is refused."""
    from ckptbridge.errors import MismatchError
    from ckptbridge.verify import verify_gguf

    src = wide["gemma3_text"]
    q8 = _export(src, str(tmp_path / "q8.gguf"), "q8_0")
    report = verify_gguf(q8, src)
    assert report.identical and report.tensors > 50 and not (report.differing or report.missing)
    f16 = _export(checkpoints["qwen3_moe"], str(tmp_path / "f16.gguf"), "f16")
    assert verify_gguf(f16, checkpoints["qwen3_moe"]).identical
    merged = _export(checkpoints["qwen3_untied"], str(tmp_path / "m.gguf"), "bf16", adapter=adapters["qwen3_untied"].peft)
    assert verify_gguf(merged, checkpoints["qwen3_untied"], adapter=adapters["qwen3_untied"].peft).identical
    assert verify_gguf(merged, checkpoints["qwen3_untied"]).differing  # the base alone differs
    from ckptbridge.io.gguf import read_gguf

    info = read_gguf(q8).tensors["blk.1.ffn_down.weight"]
    data = bytearray(open(q8, "rb").read())
    data[info.offset + 7] ^= 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    report = verify_gguf(str(bad), src)
    assert not report.identical and report.differing == ["blk.1.ffn_down.weight"]
    proc = subprocess.run([sys.executable, "-m", "ckptbridge", "verify", "gguf", str(bad), src], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 6 and "blk.1.ffn_down.weight" in proc.stdout
    with pytest.raises(MismatchError, match="general.architecture is 'gemma3'"):
        verify_gguf(q8, checkpoints["llama3_tied"])


def test_adapters_as_gguf_lora_are_ggmls_converters(checkpoints, adapters, tmp_path):
    """``adapter-to-gguf`` of PEFT adapters with one scale (Qwen 3, Llama 3 with its q/k rows
    reordered in B, Gemma 3) against ggml's ``convert_lora_to_gguf.py``: the same tensors, bytes and
    alpha (the converter's other general.* keys come from PEFT's model card). Adapters whose
    modules' scales differ (a PEFT rank/alpha pattern, a Tunix LoRA with kv at its own rank and
    alpha) get each scale folded into B and alpha 0."""
    from ckptbridge import convert_adapter_to_gguf
    from ckptbridge.io.gguf import read_gguf
    from ckptbridge.io.safetensors import SafetensorsFile

    for name in ("qwen3_untied", "llama3_tied", "gemma3_text"):
        base, peft = checkpoints[name], adapters[name].peft
        ours, theirs = tmp_path / f"{name}.gguf", tmp_path / f"{name}.ref.gguf"
        report = convert_adapter_to_gguf(peft, str(ours), base=base, progress=False)
        assert not report.scales_folded and report.alpha == 10
        proc = subprocess.run([sys.executable, os.path.join(CONVERTER, "convert_lora_to_gguf.py"), "--base", base,
                               "--outfile", str(theirs), "--outtype", "f32", peft], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        a, b = read_gguf(str(ours)), read_gguf(str(theirs))
        def kept(metadata):
            return {k: v for k, v in metadata.items() if not k.startswith("general.") or k in (
                "general.architecture", "general.type", "general.quantization_version")}

        assert kept(a.metadata) == kept(b.metadata) and a.metadata["adapter.lora.alpha"] == 10
        assert list(a.tensors) == list(b.tensors) and len(a.tensors) > 10
        for t in a.tensors:
            assert a.tensors[t].shape == b.tensors[t].shape and a.tensors[t].type == b.tensors[t].type, t
            assert np.array_equal(a.array(t), b.array(t)), t
    name = "keqv_lm_f32_sharded"  # PEFT rank and alpha patterns on down_proj; Tunix kv at rank 8, alpha 32
    for kind, adapter in (("peft", adapters[name].peft), ("tunix", adapters[name].tunix)):
        dst = tmp_path / f"{name}-{kind}.gguf"
        report = convert_adapter_to_gguf(adapter, str(dst), base=checkpoints[name], progress=False)
        f = read_gguf(str(dst))
        assert report.scales_folded and f.metadata["adapter.lora.alpha"] == 0.0 and f.metadata["general.type"] == "adapter"
    peft = adapters[name].peft
    cfg = json.load(open(os.path.join(peft, "adapter_config.json")))
    with SafetensorsFile(os.path.join(peft, "adapter_model.safetensors")) as st:
        key = next(k for k in st.keys() if "layers.0.mlp.down_proj.lora_B" in k)
        b_down = st.array(key).astype(np.float32)
    scale = cfg["alpha_pattern"]["down_proj"] / cfg["rank_pattern"]["down_proj"]
    got = read_gguf(str(tmp_path / f"{name}-peft.gguf")).array("blk.0.ffn_down.weight.lora_b")
    assert np.array_equal(got, b_down * np.float32(scale))
