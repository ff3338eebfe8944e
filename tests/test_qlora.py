"""QLoRA: a LoRA trained on a base that qwix holds quantized (``base_quant``), exported and merged
exactly: the merged model of ``merge --as-trained`` is the model trained."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "training", "data_files",
                      "codev_sample.jsonl")


def _train(base: str, out: str, scheme: str, *extra: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "training", "--preset", "tiny-cpu", "--quiet", "--base", base,
                           "--data", SAMPLE, "--out", out, "--max-steps", "2", "max_length=256", "grad_accum=1",
                           "learning_rate=2e-2", "warmup_steps=0", f"base_quant={scheme}", *extra],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def qlora_runs(tmp_path_factory):
    """QLoRA runs on tiny random bases, each trained once for the module's tests: ``get(family,
    scheme, tile)`` -> (base directory, checkpoints directory)."""
    from ckptbridge.testing import build_checkpoint

    made: dict = {}

    def get(family: str, scheme: str, tile: int | None = None) -> tuple[str, str]:
        if (family, scheme, tile) not in made:
            root = tmp_path_factory.mktemp(f"qlora-{family}-{scheme}")
            base = build_checkpoint(str(root / "hf"), family=family)
            _train(base, str(root / "run"), scheme, *([f"base_quant_tile={tile}"] if tile else []))
            made[family, scheme, tile] = base, str(root / "run" / "checkpoints")
        return made[family, scheme, tile]

    return get


@pytest.mark.slow
@pytest.mark.pinned_only
@pytest.mark.parametrize("family,scheme,tile", [("gemma4", "int8", None), ("gemma4", "nf4", None),
                                                ("gemma4", "int4", 4), ("qwen3", "int4", None)])
def test_merge_as_trained_is_the_model_trained(qlora_runs, tmp_path, family, scheme, tile):
    """Tunix's logits of the QLoRA model (qwix's quantized base + the trained LoRA, float32) equal
    transformers' logits of ``merge --as-trained`` within 1e-5 relative; the merge into the base
    as it is differs by the quantization (reported, not zero); the checkpoint records the scheme;
    the rebuilt weights equal qwix's own dequantization of the trained model's, bit for bit."""
    import jax

    from ckptbridge import merge_lora
    from ckptbridge.merge import AsTrained
    from ckptbridge.metadata import KEY, Metadata
    from ckptbridge.tunix_model import load_tunix_lora_model
    from ckptbridge.verify import hf_logits, rel_l2, tunix_logits

    jax.config.update("jax_default_matmul_precision", "highest")
    base, ckpts = qlora_runs(family, scheme, tile)

    with open(os.path.join(ckpts, "2", "_CHECKPOINT_METADATA")) as f:
        meta = Metadata.from_json(json.load(f)["custom_metadata"][KEY])
    assert meta.base_quant["scheme"] == scheme and meta.base_quant["tile"] == tile
    assert meta.base_quant["param_dtype"] == "float32" and meta.base_quant["qwix_version"]
    assert len(meta.base_quant["base_digest"]) == 32

    as_trained, plain = str(tmp_path / "as-trained"), str(tmp_path / "plain")
    merge_lora(base, ckpts, as_trained, as_trained=True, progress=False)
    merge_lora(base, ckpts, plain, progress=False)
    model, _, _ = load_tunix_lora_model(base, ckpts)
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 11))
    want = tunix_logits(model, tokens)
    assert rel_l2(hf_logits(as_trained, tokens), want) <= 1e-5
    assert rel_l2(hf_logits(plain, tokens), want) > 1e-5  # the quantization is in the model trained

    # the weights: qwix's dequantization of the trained model's MLP up projection (a Linear
    # kernel, (in, out)) against the rebuilt HF weight (out, in); for Gemma 4 also the output
    # projection (heads, head_dim, out), whose tiles take every head's inputs at once
    import qwix
    from safetensors.numpy import load_file

    kernel = model.layers[0].mlp.up_proj.kernel
    trained = np.asarray(qwix.dequantize(kernel.array))
    hf = load_file(os.path.join(base, "model.safetensors"))
    key = next(k for k in hf if ".layers.0.mlp.up_proj.weight" in k)
    np.testing.assert_array_equal(AsTrained(scheme, tile, "float32")(hf[key], key), trained.T)
    if family == "gemma4":
        w = np.asarray(qwix.dequantize(model.layers[0].attn.attn_vec_einsum.w.array))
        key = next(k for k in hf if ".layers.0.self_attn.o_proj.weight" in k)
        rebuilt = AsTrained(scheme, tile, "float32", {key: w.shape[:2]})(hf[key], key)
        np.testing.assert_array_equal(rebuilt, w.reshape(-1, w.shape[-1]).T)


@pytest.mark.slow
@pytest.mark.pinned_only
def test_peft_export_of_a_qlora_run(qlora_runs, tmp_path):
    """The PEFT export of a QLoRA run records its quantized base beside the adapter (base_quant.json,
    the weights' header, the model card), not in adapter_config.json, and PEFT loads it; ``merge
    --as-trained`` of the export writes the same tensors as of the checkpoint; ``verify adapter``
    and ``inspect`` say it; ``verify logits`` between the two merges gives their gap in one line; a
    base other than the one trained on is refused in one line, nothing written."""
    import shutil

    from conftest import run_cli
    from safetensors.numpy import load_file, save_file

    from ckptbridge.verify import hf_logits, rel_l2

    base, ckpts = qlora_runs("gemma4", "nf4")
    peft_dir, from_peft, from_orbax, plain = (str(tmp_path / n) for n in ("peft", "m-peft", "m-orbax", "m-plain"))
    for args in (("convert", ckpts, peft_dir, "--to", "peft", "--base", base),
                 ("merge", base, peft_dir, from_peft, "--as-trained"),
                 ("merge", base, ckpts, from_orbax, "--as-trained"), ("merge", base, peft_dir, plain)):
        proc = run_cli(*args, "--quiet")
        assert proc.returncode == 0, proc.stderr[-2000:]
    with open(os.path.join(peft_dir, "base_quant.json")) as f:
        record = json.load(f)
    assert record["scheme"] == "nf4" and record["tile"] is None and len(record["base_digest"]) == 32
    with open(os.path.join(peft_dir, "adapter_config.json")) as f:
        assert "base_quant" not in json.load(f)
    with open(os.path.join(peft_dir, "README.md")) as f:
        assert "--as-trained" in f.read()
    from ckptbridge import convert
    from ckptbridge.conversion import open_adapter
    from ckptbridge.lora.base import open_base

    for fmt in ("tunix-lora", "maxtext-lora"):  # the record travels through every adapter format
        again = str(tmp_path / fmt)
        convert(peft_dir, again, to=fmt, base=base, progress=False)
        with open_adapter(again, open_base(base)) as ad:
            assert ad.base_quant == record, fmt
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (from_peft, from_orbax))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), peft_dir)
    assert sum("lora_A" in n for n, _ in model.named_parameters()) > 0

    lint = json.loads(run_cli("verify", "adapter", peft_dir, "--base", base, "--lint-only", "--json").stdout)
    said = [f["message"] for f in lint["lint"]["findings"] if f["check"] == "base-quant"]
    assert len(said) == 1 and "nf4 quantization of the base" in said[0] and "--as-trained" in said[0], lint
    inspected = json.loads(run_cli("inspect", peft_dir, "--json").stdout)
    assert inspected["ckptbridge"]["base_quant"]["scheme"] == "nf4"

    proc = run_cli("verify", "logits", plain, "--tunix", from_orbax)
    tokens = np.random.default_rng(0).integers(0, 300, size=(2, 11))
    assert rel_l2(hf_logits(plain, tokens), hf_logits(from_orbax, tokens)) > 1e-5
    line = [ln for ln in proc.stdout.splitlines() if "relative L2" in ln]
    assert proc.returncode == 6 and len(line) == 1, proc.stdout  # the gap, over the tolerance

    other = str(tmp_path / "other")
    shutil.copytree(base, other)
    weights = load_file(os.path.join(other, "model.safetensors"))
    key = next(k for k in weights if k.endswith("layers.0.mlp.up_proj.weight"))
    weights[key] = weights[key] * np.float32(1.01)
    save_file(weights, os.path.join(other, "model.safetensors"))
    proc = run_cli("merge", other, peft_dir, str(tmp_path / "m-other"), "--as-trained")
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode != 0 and "is not the base" in last and len(proc.stderr.strip().splitlines()) == 1, last
    assert not os.path.exists(tmp_path / "m-other")


def test_as_trained_needs_a_qlora_adapter(tmp_path):
    """``--as-trained`` with an adapter that records no quantized base: one line, nothing written."""
    from ckptbridge.testing import build_checkpoint, write_random_adapter

    base = build_checkpoint(str(tmp_path / "hf"))
    adapter = write_random_adapter(base, str(tmp_path / "adapter"), dtype="float32")
    dst = tmp_path / "merged"
    proc = subprocess.run([sys.executable, "-m", "ckptbridge", "merge", base, adapter, str(dst), "--as-trained"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 8 and "was not trained on a quantized base" in proc.stderr.strip().splitlines()[-1]
    assert not dst.exists()


def test_qwix_still_needs_the_astype_interception():
    """ckptbridge.formats.qwix gives QLoRA models a provider that takes ``jnp.astype`` of a quantized
    weight; this fails once qwix intercepts it itself (the subclass can then go)."""
    import qwix

    assert "jax.numpy.astype" not in qwix.LoraProvider([qwix.LoraRule(module_path=".*", rank=2, alpha=2.0)]) \
        .get_intercept_map()


def test_qlora_settings_and_bad_tiles(tmp_path):
    """The QLoRA presets build; a scheme qwix lacks and a tile that does not divide a LoRA module's
    inputs end in one line, exit 8, before the run directory is made."""
    from ckptbridge.errors import ConfigError
    from ckptbridge.testing import build_checkpoint
    from training.config import PAPER_TARGETS, build_config

    assert build_config("gemma4-31b-v6e1-qlora").lora_rules(PAPER_TARGETS)[0]["weight_qtype"] == "int4"
    assert build_config("gemma4-31b-v5e4-qlora").tp == 4
    with pytest.raises(ConfigError, match="base_quant 'fp3': one of none, int8, int4, nf4"):
        build_config("tiny-cpu", None, ["base_quant=fp3"])
    base = build_checkpoint(str(tmp_path / "hf"))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "training", "--preset", "tiny-cpu", "--base", base, "--out", str(out),
                           "base_quant=int8", "base_quant_tile=7"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 8 and last.startswith("training: error: base_quant_tile=7: does not divide"), last
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.pinned_only
def test_a_qlora_base_stored_quantized(tmp_path):
    """``convert HF --to tunix --quantize int4 --tile 4`` stores what training's loader computes: the
    QLoRA model loaded from it holds the arrays quantized on the fly from the HF base, bit for bit.
    Training takes it as --base (scheme and tile from its metadata, the HF base's digest recorded);
    ``merge --as-trained`` into it writes the tensors of the merge into the HF base; ``inspect`` says
    what it is; a setting that disagrees, LoRA targets that leave a quantized weight out, and a plain
    conversion of it end in one line, nothing written."""
    from conftest import run_cli
    from flax import nnx
    from safetensors.numpy import load_file

    from ckptbridge import qlora_base
    from ckptbridge.metadata import KEY, Metadata
    from ckptbridge.testing import build_checkpoint
    from ckptbridge.tunix_model import open_tunix_model
    from training.config import PAPER_TARGETS

    # bfloat16 as real bases are (qwix's scales then are too); small chunks: values in row blocks
    base = build_checkpoint(str(tmp_path / "hf"), family="gemma4", dtype="bfloat16")
    stored = str(tmp_path / "q")
    proc = run_cli("convert", base, stored, "--to", "tunix", "--quantize", "int4", "--tile", "4",
                   "--chunk-size", "1KiB")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "QLoRA base:" in proc.stdout and "int4 (tile 4)" in proc.stdout

    rules = [dict(qlora_base.rule(PAPER_TARGETS, "int4", 4), rank=4, alpha=8.0)]
    states = []
    for src in (base, stored):
        with open_tunix_model(src, lora_rules=rules, param_dtype="bfloat16") as plan:
            states.append(nnx.to_flat_state(nnx.state(plan.load(), nnx.Param)))
    quantized = 0
    for (k1, v1), (k2, v2) in zip(*states, strict=True):
        a, b = np.asarray(v1.get_value()), np.asarray(v2.get_value())
        assert k1 == k2 and a.dtype == b.dtype and a.shape == b.shape, k1
        assert np.array_equal(a.astype(np.float32), b.astype(np.float32)), k1
        quantized += "qvalue" in map(str, k1)
    assert quantized == 6 * 6  # q, kv (k on the k_eq_v layer), output, gate, up, down of the 6 layers

    info = run_cli("inspect", stored)
    assert "QLoRA base:" in info.stdout and "int4 arrays in tiles of 4" in info.stdout, info.stdout

    run = str(tmp_path / "run")
    _train(stored, run, "none", "param_dtype=bfloat16")  # base_quant and its tile read from the base
    ckpts = os.path.join(run, "checkpoints")
    with open(os.path.join(ckpts, "2", "_CHECKPOINT_METADATA")) as f:
        meta = Metadata.from_json(json.load(f)["custom_metadata"][KEY])
    with open(os.path.join(stored, "_CHECKPOINT_METADATA")) as f:
        held = Metadata.from_json(json.load(f)["custom_metadata"][KEY]).base_quant
    assert meta.base_quant["scheme"] == "int4" and meta.base_quant["tile"] == 4
    assert meta.base_quant["base_digest"] == held["base_digest"] and len(held["base_digest"]) == 32

    from_hf, from_stored = str(tmp_path / "m-hf"), str(tmp_path / "m-q")
    for src, dst in ((base, from_hf), (stored, from_stored)):
        proc = run_cli("merge", src, ckpts, dst, "--as-trained", "--quiet")
        assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (from_hf, from_stored))
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]) for k in a)

    dst = str(tmp_path / "refused")
    for args, code, words in (
            (("convert", stored, dst, "--to", "hf"), 5, "a QLoRA base"),
            (("merge", stored, ckpts, dst), 5, "--as-trained"),
            (("convert", base, dst, "--to", "tunix", "--quantize", "fp8"), 8, "qwix's types"),
            (("convert", base, dst, "--to", "tunix", "--tile", "4"), 8, "give the scheme")):
        proc = run_cli(*args)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == code and words in last and len(proc.stderr.strip().splitlines()) == 1, last
        assert not os.path.exists(dst)
    for settings, words in ((("base_quant=int8", "param_dtype=bfloat16"), "base_quant=int8: "),
                            (("targets=q_einsum", "param_dtype=bfloat16"), "targets: "),
                            ((), "param_dtype=float32: ")):
        out = tmp_path / "refused-run"
        proc = subprocess.run([sys.executable, "-m", "training", "--preset", "tiny-cpu", "--base", stored, "--data",
                               SAMPLE, "--out", str(out), *settings], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "JAX_PLATFORMS": "cpu"})
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 8 and words in last, last
        assert not out.exists()
