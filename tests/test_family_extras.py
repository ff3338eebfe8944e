"""What only some families have, on top of the family contract (tests/test_contract*.py): fused
qkv LoRA (Gemma 3 and Gemma 1 with as many kv heads as query heads), LoRA on Qwen 3 MoE's experts,
Gemma 3's newer on-disk prefix, configs Tunix computes otherwise (RoPE), the one-line mismatch
note of each family, and bad inputs that mix families. (Gemma 4's: tests/test_gemma4_extras.py.)"""

import json
import os
import shutil

import numpy as np
import pytest

from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax
from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax
from ckptbridge.errors import MismatchError, UnsupportedError
from ckptbridge.lora.base import open_base
from ckptbridge import merge_lora
from ckptbridge.formats.hf import open_hf_source
from ckptbridge.testing import build_checkpoint, build_peft_adapter, build_tunix_lora, save_tunix_lora
from ckptbridge.verify import compare_tensors, hf_logits, logits_parity, peft_logits, rel_l2, tunix_logits

from conftest import rewrite_checkpoint, run_cli
from families import TOKENS


def test_gemma3_fused_qkv_lora(tmp_path):
    """Equal query and kv heads: Tunix fuses q, k and v into qkv_einsum with one LoRA A; PEFT's three
    modules come back exact at rank 3r, and an export gives three PEFT modules sharing A."""
    import jax

    from ckptbridge.tunix_model import load_tunix_adapter

    jax.config.update("jax_default_matmul_precision", "highest")
    base = build_checkpoint(str(tmp_path / "base"), family="gemma3", num_key_value_heads=4, seed=5)
    b = open_base(base)
    assert {m.entry.rule.name for m in b.modules} >= {"qkv"} and "q" not in {m.entry.rule.name for m in b.modules}
    peft_dir = build_peft_adapter(base, str(tmp_path / "peft"), r=2, lora_alpha=4, seed=1)
    r = convert_peft_to_orbax(peft_dir, str(tmp_path / "orbax"), base=base, kv="exact", progress=False)
    assert r.modes.get("exact") == 6 and r.rules[0]["rank"] in (2, 6)
    ref = peft_logits(base, peft_dir, TOKENS)
    got = tunix_logits(load_tunix_adapter(base, str(tmp_path / "orbax")), TOKENS)
    assert rel_l2(got, ref) <= 1e-5
    model, rules = build_tunix_lora(base, seed=4)
    ckpt = save_tunix_lora(model, str(tmp_path / "tunix"), custom_metadata={
        "ckptbridge": {"kind": "lora", "lora": {"rules": rules}}})
    convert_orbax_to_peft(ckpt, str(tmp_path / "exported"), base=base, progress=False)
    assert rel_l2(peft_logits(base, str(tmp_path / "exported"), TOKENS), tunix_logits(model, TOKENS)) <= 1e-5


def test_gemma1_fused_qkv_svd(adapters, tmp_path):
    """Gemma 1 7B-like (N == K): PEFT's three A's share one in qwix; `--kv svd` keeps rank r and
    reports each module's relative error; `--kv exact` (rank 3r) is exact (the parametrized tests)."""
    from ckptbridge.tunix_model import load_tunix_adapter

    a = adapters["gemma_fused"]
    r = convert_peft_to_orbax(a.peft, str(tmp_path / "svd"), base=a.base, kv="svd", progress=False)
    layers = len(open_base(a.base).cfg.layers)
    assert r.modes["svd"] == layers and len(r.svd_relative_error) == layers
    assert all(0 < e < 1 for e in r.svd_relative_error.values()) and r.rules[0]["rank"] == 4
    got = tunix_logits(load_tunix_adapter(a.base, str(tmp_path / "svd")), TOKENS)
    ref, base = a.peft_logits, a.base_logits
    assert rel_l2(got, ref) < rel_l2(base, ref)  # closer to the adapter than no adapter at all


def test_expert_lora_merges_and_is_refused_by_peft_to_orbax(checkpoints, tmp_path, precise):
    """A PEFT adapter on Qwen 3 MoE's experts (target_parameters: transformers' fused gate_up_proj and
    down_proj) merges exactly into the per-expert keys on disk; peft-to-orbax refuses it in one line
    (qwix puts no LoRA on Tunix's expert parameters) and writes nothing."""
    base = checkpoints["qwen3_moe"]
    peft_dir = build_peft_adapter(base, str(tmp_path / "peft"), r=2, lora_alpha=6, seed=4, scale=1.0,
                                  target_modules=["q_proj", "o_proj"],
                                  target_parameters=["mlp.experts.down_proj", "mlp.experts.gate_up_proj"])
    r = merge_lora(base, peft_dir, str(tmp_path / "merged"), progress=False)
    cfg = open_base(base).cfg
    assert r.merged_tensors == cfg.num_layers * (3 * cfg.sizes["e"] + 2)
    ref = peft_logits(base, peft_dir, TOKENS)
    assert rel_l2(hf_logits(str(tmp_path / "merged"), TOKENS), ref) <= 1e-5
    assert rel_l2(hf_logits(base, TOKENS), ref) > 1e-2  # the experts' LoRA does something
    cli = run_cli("convert", "peft-to-orbax", peft_dir, str(tmp_path / "orbax"), "--base", base)
    assert cli.returncode == 5 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert "mlp.experts.gate_up_proj" in cli.stderr and "ckptbridge merge" in cli.stderr
    assert not os.path.exists(str(tmp_path / "orbax"))


def test_bad_inputs_across_families(checkpoints, adapters, tmp_path):
    qwen, gemma = checkpoints["qwen3_untied"], checkpoints["gemma3_text"]
    # an adapter of one family on a base of another (the tiny Gemma 3 and Qwen 3 text models share
    # module names and shapes, so a multimodal Gemma 3 adapter is the one that cannot fit Qwen 3)
    with pytest.raises(MismatchError, match="not a LoRA-able module of the qwen3 base"):
        convert_peft_to_orbax(adapters["gemma3_mm"].peft, str(tmp_path / "x"), base=qwen, progress=False)
    with pytest.raises(MismatchError, match="family 'gemma3'.*'qwen3'|not a LoRA factor"):
        convert_orbax_to_peft(adapters["gemma3_text"].tunix, str(tmp_path / "y"), base=qwen, progress=False)
    # a Qwen 3 Orbax checkpoint with a Gemma 3 config
    orbax_dir = str(tmp_path / "orbax")
    convert_safetensors_to_orbax(qwen, orbax_dir, progress=False)
    with pytest.raises(MismatchError):
        convert_orbax_to_safetensors(orbax_dir, str(tmp_path / "z"), config=gemma, progress=False)
    assert not os.path.exists(tmp_path / "z")
    # the untied head missing, a tensor too many, a tower ckptbridge has no rows for (SigLIP's pooling head)
    r = run_cli("inspect", qwen, "--json")
    assert r.returncode == 0
    broken = rewrite_checkpoint(qwen, tmp_path / "no-head", drop="lm_head.weight")
    with pytest.raises(MismatchError, match="'lm_head.weight' is missing"):
        convert_safetensors_to_orbax(broken, str(tmp_path / "o1"), progress=False)
    extra = rewrite_checkpoint(gemma, tmp_path / "extra", add="model.layers.0.self_attn.q_proj.bias")
    with pytest.raises(MismatchError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        convert_safetensors_to_orbax(extra, str(tmp_path / "o2"), progress=False)
    headed = str(tmp_path / "headed")
    shutil.copytree(checkpoints["gemma3_mm"], headed)
    config = json.load(open(os.path.join(headed, "config.json")))
    config["vision_config"]["vision_use_head"] = True
    json.dump(config, open(os.path.join(headed, "config.json"), "w"))
    with pytest.raises(UnsupportedError, match="vision_use_head.*--skip-multimodal"):
        convert_safetensors_to_orbax(headed, str(tmp_path / "o3"), progress=False)
    # prefix mix-up: one tensor under the other prefix of the family
    mixed = rewrite_checkpoint(checkpoints["gemma3_mm"], tmp_path / "mixed", rename=(
        "language_model.model.layers.1.mlp.up_proj.weight", "model.language_model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MismatchError, match="unexpected tensor 'model.language_model.layers.1.mlp.up_proj.weight'"):
        convert_safetensors_to_orbax(mixed, str(tmp_path / "o4"), skip_multimodal=True, progress=False)
    for name in ("o1", "o2", "o3", "o4"):
        assert not os.path.exists(tmp_path / name)
    # LoRA on Qwen 3's untied lm_head (a `.*` rule): named, with the rule that avoids it
    model, rules = build_tunix_lora(qwen, [{"module_path": ".*", "rank": 2, "alpha": 4.0}], seed=1)
    assert any("lm_head" in r["module_path"] or r["module_path"] == ".*" for r in rules)
    ckpt = save_tunix_lora(model, str(tmp_path / "head-lora"), custom_metadata={
        "ckptbridge": {"kind": "lora", "lora": {"rules": rules}}})
    with pytest.raises(UnsupportedError, match=r"LoRA on lm_head/w.*module_path '\.\*\(q_proj\|"):
        convert_orbax_to_peft(ckpt, str(tmp_path / "o6"), base=qwen, progress=False)
    r = run_cli("convert", "safetensors-to-orbax", broken, str(tmp_path / "o5"))
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "lm_head.weight" in r.stderr


def test_gemma3_newer_writers_prefix(checkpoints, tmp_path):
    """Gemma3ForConditionalGeneration files written as `model.language_model.` / `model.vision_tower.`
    (newer writers) read as well, and the prefixes found are the ones written back, the tower's too."""
    from safetensors.numpy import load_file, save_file

    src = str(tmp_path / "newer")
    shutil.copytree(checkpoints["gemma3_mm"], src)
    path = os.path.join(src, "model.safetensors")
    renamed = {}
    for key, value in load_file(path).items():
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model."):]
        elif key.startswith(("vision_tower.", "multi_modal_projector.")):
            key = "model." + key
        renamed[key] = value
    save_file(renamed, path, metadata={"format": "pt"})
    r = convert_safetensors_to_orbax(src, str(tmp_path / "orbax"), progress=False)
    assert r.key_prefix == "model.language_model." and r.towers_dropped == 0 and r.towers["vision"]["tensors"] == 39
    convert_orbax_to_safetensors(str(tmp_path / "orbax"), str(tmp_path / "back"), progress=False)
    assert compare_tensors(src, str(tmp_path / "back")).identical
    # and the original (older) layout of the same model gives the same Tunix tree
    with open_hf_source(src, skip_multimodal=True) as a, \
            open_hf_source(checkpoints["gemma3_mm"], skip_multimodal=True) as b:
        assert [e.tunix_path for e in a.entries] == [e.tunix_path for e in b.entries]
        assert all(np.array_equal(a.tunix_value(e), b.tunix_value(f)) for e, f in zip(a.entries, b.entries))


@pytest.mark.parametrize("family, rope", [
    ("llama3", {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),  # Llama 3.1 8B
    ("qwen3", {"rope_type": "default", "rope_theta": 5_000_000.0}),  # Qwen3-4B-2507
])
@pytest.mark.pinned_only  # Tunix is the same release at the floors
def test_config_tunix_cannot_compute(tmp_path, family, rope):
    """Files convert bit-exact, saying in one line what Tunix computes differently; building the
    Tunix model (verify logits, training) refuses unless allowed, then the gap is measured."""
    import subprocess
    import sys

    from training.cli import SAMPLE_DATA

    src = build_checkpoint(str(tmp_path / "hf"), family=family, rope_parameters=rope)
    cli = run_cli("convert", "safetensors-to-orbax", src, str(tmp_path / "orbax"), "--quiet")
    assert cli.returncode == 0, cli.stderr
    notes = [line for line in cli.stderr.splitlines() if "rope_theta" in line]
    assert len(notes) == 1 and "convert exactly" in notes[0] and f"Tunix {family}" in notes[0], cli.stderr
    if family == "llama3":
        assert "rope_type 'llama3'" in notes[0]
    info = json.loads(run_cli("inspect", src, "--json").stdout)
    assert any(p.startswith("rope_theta") for p in info["tunix_mismatch"])
    r = convert_orbax_to_safetensors(str(tmp_path / "orbax"), str(tmp_path / "back"), progress=False)
    assert compare_tensors(src, str(tmp_path / "back")).identical and "rope_theta" in r.config_mismatch
    with pytest.raises(UnsupportedError, match=r"rope_theta .*--allow-config-mismatch"):
        logits_parity(src)
    gap = logits_parity(src, allow_config_mismatch=True)
    assert gap.rel_l2 > 1e-4  # measured, not hidden
    assert any(p.startswith("rope_theta") for p in gap.config_mismatch)
    cli = run_cli("verify", "logits", src, "--allow-config-mismatch", "--json")
    assert cli.returncode == 6 and json.loads(cli.stdout)["rel_l2"] == pytest.approx(gap.rel_l2, rel=1e-3)
    # training: refused before anything is written, then trains with the flag
    run = str(tmp_path / "run")
    argv = [sys.executable, "-m", "training", "--preset", "tiny-cpu", "--quiet", "--base", src, "--data", SAMPLE_DATA,
            "--out", run, "--max-steps", "1", "max_length=128", "grad_accum=1"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 5 and "--allow-config-mismatch" in proc.stderr.splitlines()[-1], proc.stderr[-2000:]
    assert not os.path.exists(run)
    proc = subprocess.run(argv + ["--allow-config-mismatch"], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and json.loads(proc.stdout)["steps"] == 1, proc.stderr[-2000:]
    assert json.load(open(os.path.join(run, "config.json")))["allow_config_mismatch"] is True


@pytest.mark.parametrize("family, fields, expected", [
    ("llama3", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0}},
     ["rope_theta 500000 (Tunix llama3 always uses 1e+06)", "rope_type 'llama3'"]),
    ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0}}, ["rope_theta 5e+06"]),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}, ["use_sliding_window"]),
    ("gemma2", {"query_pre_attn_scalar": 144}, ["query_pre_attn_scalar 144 (Tunix gemma scales"]),
    ("gemma", {"hidden_act": "gelu"}, ["hidden_act 'gelu' (Tunix gemma uses tanh GELU)"]),
    ("gemma", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, ["rope_theta 1e+06"]),
    ("gemma3", {"final_logit_softcapping": 30.0}, ["final_logit_softcapping 30.0"]),
    ("gemma4", {"rms_norm_eps": 1e-5}, ["rms_norm_eps 1e-05"]),
    ("gemma4", {"num_kv_shared_layers": 2, "attention_k_eq_v": False,  # layer 3, the last unshared, is sliding
                "layer_types": ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 2
                + ["full_attention"]}, ["num_kv_shared_layers 2 with this layer pattern (Tunix shares layers [4, 5]"]),
])
def test_mismatch_line_names_each_field(family, fields, expected):
    """One line per config, naming every field Tunix's model of the family does not compute; none for
    the tiny configs the tests use."""
    from ckptbridge.specs import get_family, parse_config
    from ckptbridge.tunix_model import mismatch_line

    spec = get_family(family)
    assert mismatch_line(parse_config(spec.tiny_config(spec.model_types[0]))) is None
    line = mismatch_line(parse_config(spec.tiny_config(spec.model_types[0], **fields)))
    assert line and "\n" not in line and all(e in line for e in expected), line
