"""Weight quantization (ckptbridge/quantize.py) against the torch operations compressed-tensors runs.

The reference below is compressed-tensors' own sequence on a CPU, written with torch: min/max per
output row (llm-compressor's observer), ``calculate_qparams`` (symmetric: the larger magnitude
over half the quantized range, zero scales to the dtype's epsilon), then ``quantize`` (``x /
scale`` in the weight's dtype, clamp, ``torch.round`` or the cast to float8_e4m3fn).
"""

import json
import os

import ml_dtypes
import numpy as np
import pytest

from ckptbridge.errors import UnsupportedError
from ckptbridge.formats.compressed_tensors import SCHEMES, get_scheme, quantize_weight


def _torch_reference(w, scheme):
    import torch

    x = torch.from_numpy(w.astype(np.float32)).to({np.dtype(ml_dtypes.bfloat16): torch.bfloat16,
                                                    np.dtype(np.float16): torch.float16,
                                                    np.dtype(np.float32): torch.float32}[w.dtype])
    min_vals = torch.amin(x, dim=1, keepdim=True)
    max_vals = torch.amax(x, dim=1, keepdim=True)
    min_vals = torch.min(min_vals, torch.zeros_like(min_vals))
    max_vals = torch.max(max_vals, torch.zeros_like(max_vals))
    if scheme.ct_type == "int":
        q_min, q_max, dtype = torch.tensor(-128.0), torch.tensor(127.0), torch.int8
    else:
        q_min, q_max, dtype = torch.tensor(-448.0), torch.tensor(448.0), torch.float8_e4m3fn
    bit_range = q_max - q_min
    max_val_pos = torch.max(torch.abs(min_vals), torch.abs(max_vals))
    scales = max_val_pos / (float(bit_range) / 2)
    scales = torch.where(scales == 0, torch.tensor(torch.finfo(scales.dtype).eps, dtype=scales.dtype), scales)
    scaled = x / scales
    clamped = torch.clamp(scaled, q_min, q_max)
    rounded = torch.round(clamped) if scheme.ct_type == "int" else clamped.to(dtype)
    q = rounded.to(dtype)
    q_np = q.view(torch.int8).numpy().view(np.int8 if dtype == torch.int8 else ml_dtypes.float8_e4m3fn)
    return q_np, scales.to(torch.float32).numpy().astype(w.dtype)


def _weights(dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((64, 96)).astype(np.float32) * rng.uniform(1e-4, 30, size=(64, 1)).astype(np.float32)
    w[3] = 0.0  # a zero row: the scale becomes the dtype's epsilon
    w[4] = np.abs(w[4])  # all positive: the largest maps to 127
    w[5] = -np.abs(w[5])  # all negative: the largest magnitude maps to -128
    w[6, :] = 0.0
    w[6, 0] = 1e-30 if dtype == np.float32 else 0.0
    w[7] = np.linspace(-1, 1, 96)  # many values near a rounding tie after the first rounding
    return w.astype(dtype)


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32], ids=["bf16", "f16", "f32"])
def test_quantized_weight_and_scale_equal_compressed_tensors_operations(name, dtype, monkeypatch):
    import ckptbridge.formats.compressed_tensors

    monkeypatch.setattr(ckptbridge.formats.compressed_tensors, "_CACHE_ELEMENTS", 500)  # blocks of 5 rows, the last one short
    scheme = SCHEMES[name]
    for seed in range(3):
        w = _weights(dtype, seed)
        q, scale = quantize_weight(w, scheme)
        q_ref, scale_ref = _torch_reference(w, scheme)
        assert q.dtype == scheme.dtype and q.shape == w.shape
        assert scale.dtype == w.dtype and scale.shape == (w.shape[0], 1)
        assert scale.tobytes() == scale_ref.tobytes()
        assert q.tobytes() == q_ref.tobytes()
    if scheme.ct_type == "int":
        assert q[4].max() == 127 and q[5].min() == -128 and not q[3].any()


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float16, np.float32], ids=["bf16", "f16", "f32"])
def test_dequantized_error_is_within_half_a_step(dtype):
    """Every value: int8 within half a step of its scale (plus the first rounding of w / scale to the source
    dtype: a quarter step at most); e4m3 within half its own ulp (3 mantissa bits) of w / scale."""
    w = _weights(dtype)
    wide = w.astype(np.float32)
    first = {np.dtype(np.float32): 0.0, np.dtype(np.float16): 2.0**-11, np.dtype(ml_dtypes.bfloat16): 2.0**-8}
    for scheme in SCHEMES.values():
        q, scale = quantize_weight(w, scheme)
        s = scale.astype(np.float32)
        err = np.abs(q.astype(np.float32) - wide / s)  # in steps of the scale
        if scheme.ct_type == "int":
            assert (err <= 0.5 + 128 * first[np.dtype(dtype)] + 1e-3).all(), scheme.name
        else:
            assert (err <= np.abs(wide / s) * (2.0**-4 + first[np.dtype(dtype)]) + 2.0**-10 + 1e-6).all()
        rel = np.linalg.norm(q.astype(np.float32) * s - wide) / np.linalg.norm(wide)
        assert rel < (0.01 if scheme.name == "int8" else 0.05), (scheme.name, rel)


def test_bad_inputs_are_one_line():
    with pytest.raises(UnsupportedError, match="choose one of int8, fp8"):
        get_scheme("int4")
    with pytest.raises(UnsupportedError, match="layers.0.q_proj.weight: dtype int8 cannot be quantized"):
        quantize_weight(np.zeros((2, 2), np.int8), SCHEMES["int8"], "layers.0.q_proj.weight")
    with pytest.raises(UnsupportedError, match="not a matrix"):
        quantize_weight(np.zeros((2, 2, 2), np.float32), SCHEMES["fp8"])
    bad = np.ones((3, 4), np.float32)
    bad[2, 1] = np.nan
    with pytest.raises(UnsupportedError, match="k.weight: row 2 holds NaN or infinite values"):
        quantize_weight(bad, SCHEMES["int8"], "k.weight")


# --------------------------------------------------------------------------- whole models


def _files(path):
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = f.read()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tunix", "peft"])
def test_one_pass_merge_and_quantize_equals_merge_then_quantize(adapters, tmp_path, kind):
    from ckptbridge import merge_lora, quantize_model

    row = adapters["kv_lm_bf16_sharded"]
    adapter = row.tunix if kind == "tunix" else row.peft
    for scheme in SCHEMES:
        one, merged, two = (str(tmp_path / f"{scheme}.{n}") for n in ("one", "merged", "two"))
        report = merge_lora(row.base, adapter, one, quantize=scheme, max_shard_size="64KiB", progress=False)
        merge_lora(row.base, adapter, merged, max_shard_size="64KiB", progress=False)
        quantize_model(merged, two, scheme=scheme, max_shard_size="64KiB", progress=False)
        a, b = _files(one), _files(two)
        assert sorted(a) == sorted(b) and len([n for n in a if n.endswith(".safetensors")]) > 1
        for name in a:
            if name != "README.md":  # the cards say how each was made
                assert a[name] == b[name], name
        assert report.quantized == scheme and report.quantized_tensors == report.merged_tensors > 0
        config = json.loads(a["config.json"])
        assert config["quantization_config"]["format"] == SCHEMES[scheme].format
        assert "quantized in the same pass" in a["README.md"].decode()


def test_workers_and_budget_do_not_change_the_quantized_bytes(checkpoints, tmp_path):
    from ckptbridge import quantize_model

    src = checkpoints["kv_lm_bf16_sharded"]
    serial, parallel = str(tmp_path / "serial"), str(tmp_path / "parallel")
    quantize_model(src, serial, scheme="fp8", workers=1, memory_budget="4KiB", progress=False)
    quantize_model(src, parallel, scheme="fp8", workers=4, memory_budget="64MiB", progress=False)
    assert _files(serial) == _files(parallel)


def test_quantized_model_lists_what_it_left_alone(checkpoints, tmp_path):
    from ckptbridge.io.hf import HFModelDir
    from ckptbridge import quantize_model

    src = checkpoints["gemma4_e2b_bf16_sharded"]  # per-layer projections: linear modules no LoRA targets
    dst = str(tmp_path / "q")
    report = quantize_model(src, dst, scheme="int8", progress=False)
    with HFModelDir(src) as before, HFModelDir(dst) as after:
        config = after.config["quantization_config"]
        scaled = {k[: -len(".weight_scale")] for k in after.keys() if k.endswith(".weight_scale")}
        assert len(scaled) == report.quantized_tensors
        for key in before.keys():
            module = key.removesuffix(".weight")
            if module in scaled:
                assert after.info(key).dtype == "I8" and tuple(after.info(f"{module}.weight_scale").shape) == \
                    (before.info(key).shape[0], 1)
            else:
                assert after.file_of(key).raw(key) == before.file_of(key).raw(key), key
        left = [m for m in config["ignore"] if m != "lm_head"]
        assert left and all("per_layer" in m for m in left), left
        assert config["ignore"][-1] == "lm_head" and not any("embed" in m for m in config["ignore"])


def test_bad_models_are_one_line_and_write_nothing(checkpoints, tmp_path):
    from conftest import run_cli, tree_hash


    src = checkpoints["keqv_text_bf16_single"]
    before = tree_hash(src)
    done = str(tmp_path / "done")
    assert run_cli("quantize", src, done, "--scheme", "int8").returncode == 0
    f64 = _with_float64_projection(src, str(tmp_path / "f64"))
    cases = [
        (["quantize", done, "--scheme", "fp8"], 5, "already quantized (its config.json has a quantization_config"),
        (["quantize", checkpoints["qwen3_moe_bf16_sharded"], "--scheme", "int8"], 5, "mixture-of-experts"),
        (["merge", checkpoints["qwen3_moe_bf16_sharded"], src, "--quantize", "int8"], 5, "mixture-of-experts"),
        (["merge", done, src], 5, "already quantized (its config.json has a quantization_config: compressed-tensors, "
                                  "int-quantized); merge into the unquantized model it was made from"),
        (["quantize", f64, "--scheme", "int8"], 5, "model.layers.0.self_attn.q_proj.weight is F64; int8 quantizes "
                                                   "BF16, F16 or F32 weights"),
        (["quantize", src, "--scheme", "int4"], 2, "invalid choice: 'int4'"),
        (["merge", src, src, "--quantize", "nf4"], 8, "nf4 is a QLoRA base's (--to tunix)"),
        (["quantize", src], 2, "the following arguments are required: --scheme"),
    ]
    for args, code, words in cases:
        dst = tmp_path / "out"
        proc = run_cli(*args[:2], *args[2:3], str(dst), *args[3:]) if args[0] == "merge" else \
            run_cli(args[0], args[1], str(dst), *args[2:])
        assert proc.returncode == code, (args, proc.stderr)
        assert words in proc.stderr, proc.stderr
        if code != 2:
            assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not dst.exists()
    assert tree_hash(src) == before


def _with_float64_projection(src: str, dst: str) -> str:
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    key = "model.layers.0.self_attn.q_proj.weight"
    tensors[key] = tensors[key].astype(np.float64)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def test_scheme_names_are_the_options_choices():
    from ckptbridge.options import QUANT_SCHEMES

    assert tuple(SCHEMES) == QUANT_SCHEMES
    with pytest.raises(UnsupportedError, match=r"quantize \(--quantize\) 'int4': choose one of int8, fp8"):
        get_scheme("int4", "quantize (--quantize)")


@pytest.mark.slow
def test_orbax_to_safetensors_quantizes_in_the_same_pass(checkpoints, tmp_path):
    from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax
    from ckptbridge import quantize_model

    orbax = str(tmp_path / "orbax")  # stored in chunks of 4 KiB: the projections are read in boxes of rows
    convert_safetensors_to_orbax(checkpoints["kv_lm_bf16_sharded"], orbax, chunk_size="4KiB", progress=False)
    plain, one, two = (str(tmp_path / n) for n in ("plain", "one", "two"))
    convert_orbax_to_safetensors(orbax, plain, progress=False)
    for scheme in SCHEMES:
        report = convert_orbax_to_safetensors(orbax, f"{one}.{scheme}", quantize=scheme, chunk_size="4KiB",
                                              memory_budget="64KiB", progress=False)
        quantize_model(plain, f"{two}.{scheme}", scheme=scheme, progress=False)
        a, b = _files(f"{one}.{scheme}"), _files(f"{two}.{scheme}")
        assert a["model.safetensors"] == b["model.safetensors"] and a["config.json"] == b["config.json"]
        assert report.quantized == scheme and report.quantized_tensors > 0


# --------------------------------------------------------------------------- serving a quantized model


def test_serving_takes_quantized_models_where_the_hardware_runs_them(checkpoints, tmp_path):
    import subprocess
    import sys

    from ckptbridge import quantize_model
    from serving.bench import table
    from serving.vllm_facts import weights_memory

    src = checkpoints["keqv_text_bf16_single"]
    models = {s: quantize_model(src, str(tmp_path / s), scheme=s, progress=False).destination for s in SCHEMES}

    def serve(profile, model):
        return subprocess.run([sys.executable, "-m", "serving", "serve", "--profile", profile, "--model", model,
                               "--dry-run"], capture_output=True, text=True, timeout=300)

    refused = serve("tpu-v6e-8", models["fp8"])
    assert refused.returncode == 8 and refused.stderr.strip() == (
        "serving: error: profile tpu-v6e-8 cannot run fp8 (FP8_DYNAMIC) weights: its hardware runs int8; quantize "
        "the unquantized model with `ckptbridge quantize SRC DST --scheme int8`")
    for profile, scheme in (("tpu-v6e-8", "int8"), ("gpu-h100x2", "fp8"), ("cpu", "fp8"), ("cpu", "int8")):
        ok = serve(profile, models[scheme])
        assert ok.returncode == 0, ok.stderr
        assert f"{scheme}, {SCHEMES[scheme].preset}): vLLM reads its quantization_config" in ok.stderr
        assert "--quantization" not in ok.stdout  # vLLM detects it
    plain = serve("cpu", src)
    assert plain.returncode == 0 and "quantized model" not in plain.stderr

    before, after = weights_memory(src), weights_memory(models["int8"])
    assert before["quantization"] is None and after["quantization"].startswith("int8 (W8A8")
    from ckptbridge.io.hf import HFModelDir

    with HFModelDir(models["int8"]) as m:
        scales = sum(m.info(k).nbytes for k in m.keys() if k.endswith(".weight_scale"))
    # each quantized projection: half its bfloat16 bytes, plus one bfloat16 scale per row
    assert after["dtypes"]["I8"] * 2 + after["dtypes"]["BF16"] - scales == before["bytes"]
    assert after["bytes"] < before["bytes"]
    assert "weights: " in table({"points": [], "weights": after}) and "int8 (W8A8" in table({"points": [],
                                                                                                "weights": after})


@pytest.mark.slow
def test_verify_quantized_reports_what_each_scheme_cost(checkpoints, tmp_path):
    from conftest import run_cli

    from ckptbridge import quantize_model
    from ckptbridge.verify import quantized_cost

    src = checkpoints["qwen3_untied_bf16_sharded"]
    reports = {}
    for scheme in SCHEMES:
        dst = quantize_model(src, str(tmp_path / scheme), scheme=scheme, progress=False).destination
        reports[scheme] = quantized_cost(dst, src)
    int8, fp8 = reports["int8"], reports["fp8"]
    # per-channel int8 keeps about 7 bits of each weight, e4m3 about 4: the weights' error and the logits' follow
    assert 0 < int8.weight_rel_l2 < 0.01 < fp8.weight_rel_l2 < 0.05
    assert 0 < int8.rel_l2_weights_only < fp8.rel_l2_weights_only
    assert int8.rel_l2 > 0 and fp8.rel_l2 > int8.rel_l2 and int8.ok and fp8.ok
    assert int8.quantized_tensors == fp8.quantized_tensors > 0
    proc = run_cli("verify", "quantized", str(tmp_path / "fp8"), "--source", src, "--tolerance", "1e-6", "--json")
    assert proc.returncode == 6 and json.loads(proc.stdout)["ok"] is False, proc.stderr
    proc = run_cli("verify", "quantized", src, "--source", src)
    assert proc.returncode == 5 and "not a model quantized to int8 or fp8" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
