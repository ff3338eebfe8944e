"""Gemma 4 only, on top of the family contract (tests/test_contract*.py): the k_eq_v global layers
(K-only attention, its LoRA in PEFT and vLLM form), the per_layer_config dialect, E2B/E4B
(per-layer embeddings, kv-shared layers) and its later Tunix layout, and the MoE block.
The checkpoints are rows of tests/families.py (``checkpoints`` fixture) or built here."""

import json
import os

import numpy as np
import pytest

from ckptbridge.lora import modules as lora_modules
from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax
from ckptbridge import convert_orbax_to_safetensors, convert_safetensors_to_orbax
from ckptbridge.errors import MismatchError, UnsupportedError
from ckptbridge.io.safetensors import SafetensorsFile
from ckptbridge.lora.base import open_base
from ckptbridge import merge_lora
from ckptbridge.formats.hf import open_hf_source
from ckptbridge.testing import build_checkpoint, build_peft_adapter, build_tunix_lora, save_tunix_lora
from ckptbridge.verify import compare_tensors, hf_logits, logits_parity, peft_logits, rel_l2, tunix_logits

from conftest import flat_state, run_cli
from families import TOKENS

KEQV = "keqv_lm_f32_sharded"  # k_eq_v global layer 5; the LoRA rows of the table give kv its own rank 8


# ------------------------------------------------------------------------------------ k_eq_v


def test_orbax_tree_of_k_eq_v_layers(converted):
    """The global layer of a k_eq_v model has a K-only k_einsum (no kv_einsum); sliding layers the
    fused kv_einsum. (That every leaf is the map's value: tests/test_contract.py.)"""
    import orbax.checkpoint as ocp

    orbax_dir, _ = converted[KEQV]
    tree = ocp.StandardCheckpointer().restore(os.path.abspath(orbax_dir))
    assert set(tree) == {"embedder", "layers", "final_norm"}
    assert sorted(tree["layers"], key=int) == [str(i) for i in range(6)]
    k = tree["layers"]["5"]["attn"]["k_einsum"]["w"]
    assert k.shape == (1, 40, 20) and k.dtype == np.float32
    assert "kv_einsum" not in tree["layers"]["5"]["attn"]
    assert tree["layers"]["0"]["attn"]["kv_einsum"]["w"].shape == (2, 2, 40, 12)


@pytest.mark.slow
def test_per_layer_config_dialect(checkpoints, tmp_path, precise):
    """A config in the per_layer_config dialect converts, round-trips and gives the same model."""
    import shutil

    from ckptbridge.specs.gemma4 import to_per_layer_config
    from ckptbridge.tunix_model import load_tunix_model

    legacy = checkpoints[KEQV]
    src = str(tmp_path / "plc")
    shutil.copytree(legacy, src)
    to_per_layer_config(os.path.join(src, "config.json"))
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")
    convert_safetensors_to_orbax(src, orbax_dir, progress=False)
    convert_orbax_to_safetensors(orbax_dir, back, progress=False)
    assert compare_tensors(src, back).identical
    assert "per_layer_config" in json.load(open(os.path.join(back, "config.json")))["text_config"]
    model, _ = load_tunix_model(orbax_dir)
    tokens = np.random.default_rng(3).integers(0, 300, size=(1, 11))
    ours, ref = tunix_logits(model, tokens), hf_logits(legacy, tokens)
    assert np.linalg.norm(ours - ref) / np.linalg.norm(ref) <= 1e-5


def test_lora_layouts_follow_from_the_table():
    from ckptbridge.specs import GEMMA4

    got = {r.name: lora_modules.lora_layouts(r) for r in GEMMA4.rules if r.lora}
    assert (got["q"].a_tunix, got["q"].b_tunix, got["q"].a_peft, got["q"].b_peft) == \
        ("d r", "r n h", "r (d)", "(n h) r")
    assert (got["kv"].a_tunix, got["kv"].b_tunix, got["kv"].b_peft_stacked) == ("d r", "r c k h", "c (k h) r")
    assert (got["o"].a_tunix, got["o"].b_tunix, got["o"].a_peft) == ("n h r", "r d", "r (n h)")
    assert (got["down"].a_tunix, got["down"].b_tunix) == ("f r", "r d")
    assert (got["k"].a_tunix, got["k"].b_tunix) == ("d r", "r k h")


@pytest.mark.slow
def test_orbax_to_peft_k_eq_v(adapters):
    """The hf target: kv's own rank and alpha as patterns; the k_eq_v layer's K-only module is
    k_proj, with no v_proj. (Its logits: test_contract_lora's test_orbax_to_peft_gives_tunix_logits
    on this row, the same conversion.)"""
    a = adapters[KEQV]
    dst, r = a.tunix_as_peft
    cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4 and cfg["lora_alpha"] == 10
    assert "language_model" in cfg["target_modules"]
    assert set(cfg["rank_pattern"].values()) == {8} and set(cfg["alpha_pattern"].values()) == {32}
    with SafetensorsFile(os.path.join(dst, "adapter_model.safetensors")) as f:
        keys = f.keys()
    assert "base_model.model.model.language_model.layers.5.self_attn.k_proj.lora_A.weight" in keys
    assert not any("layers.5.self_attn.v_proj" in k for k in keys)  # k_eq_v layer, hf target
    assert r.modules == 5 * 7 + 6  # sliding: q k v o gate up down; global: q k o gate up down


@pytest.mark.slow
def test_vllm_target_repeats_k_as_v_and_warns_on_rank(adapters, tmp_path):
    a = adapters[KEQV]
    dst = str(tmp_path / "vllm")
    r = convert_orbax_to_peft(a.tunix, dst, base=a.base, target="vllm", progress=False)
    cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
    # vLLM ignores rank/alpha patterns: one rank, per-module scales folded into B
    assert cfg["r"] == 8 and not cfg["rank_pattern"] and not cfg["alpha_pattern"]
    assert any("padded" in w for w in r.warnings)
    with SafetensorsFile(os.path.join(dst, "adapter_model.safetensors")) as f:
        pre = "base_model.model.model.language_model.layers.5.self_attn."
        for ab in ("A", "B"):
            assert f.raw(f"{pre}v_proj.lora_{ab}.weight") == f.raw(f"{pre}k_proj.lora_{ab}.weight")
    # the same adapter still gives the same model where v_proj exists: merge drops the repeats
    merged = str(tmp_path / "merged")
    merge_lora(a.base, dst, merged, progress=False)
    assert rel_l2(hf_logits(merged, TOKENS), a.tunix_logits) <= 1e-5


@pytest.mark.slow
def test_peft_to_orbax_stacks_k_and_v_exactly(adapters):
    """PEFT's k_proj and v_proj (different A) become one kv_einsum at twice the rank and alpha
    (--kv exact, the default), which Tunix's own CheckpointManager restores into the qwix model,
    giving PEFT's logits. (The layout and ckptbridge's reader: test_contract_lora's
    test_peft_to_orbax_gives_peft_logits on this row, the same conversion.)"""
    import orbax.checkpoint as ocp

    from ckptbridge.tunix_model import load_tunix_lora_model

    a = adapters[KEQV]
    dst, r = a.peft_as_orbax
    assert r.modes["exact"] == 5  # every sliding layer: k and v with different A
    with ocp.CheckpointManager(os.path.abspath(dst)) as mngr:
        rules = mngr.metadata(0).custom_metadata["ckptbridge"]["lora"]["rules"]
    assert {(x["rank"], x["alpha"]) for x in rules} >= {(4, 10), (8, 20)}
    model, step, _ = load_tunix_lora_model(a.base, dst)
    assert step == 0
    assert rel_l2(tunix_logits(model, TOKENS), a.peft_logits) <= 1e-5


@pytest.mark.slow
def test_peft_to_orbax_svd_reports_error(adapters, tmp_path):
    a = adapters[KEQV]
    dst = str(tmp_path / "ckpt")
    r = convert_peft_to_orbax(a.peft, dst, base=a.base, kv="svd", progress=False)
    errors = r.svd_relative_error
    assert len(errors) == 5 and all(0 < e < 1 for e in errors.values())
    assert all(rule["rank"] != 8 for rule in r.rules)  # rank kept at r


@pytest.mark.slow
def test_wrong_base_is_named(adapters, checkpoints, tmp_path):
    a = adapters[KEQV]
    other = checkpoints["kv_text_f32_sharded"]  # no k_eq_v: the global layer has kv_einsum, not k_einsum
    with pytest.raises(MismatchError, match="k_einsum"):
        convert_orbax_to_peft(a.tunix, str(tmp_path / "x"), base=other, progress=False)
    with pytest.raises(MismatchError, match="wrong base|not a LoRA-able module"):
        convert_peft_to_orbax(a.peft, str(tmp_path / "y"), base=other, progress=False)
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


@pytest.mark.slow
def test_cli_lora_verbs(adapters, tmp_path):
    a = adapters[KEQV]
    adapter, ckpt, merged = str(tmp_path / "adapter"), str(tmp_path / "ckpt"), str(tmp_path / "merged")
    proc = run_cli("convert", "orbax-to-peft", a.tunix, adapter, "--base", a.base, "--target", "vllm")
    assert proc.returncode == 0, proc.stderr
    assert "orbax-to-peft (vllm)" in proc.stdout and "padded every module to rank 8" in proc.stdout
    proc = run_cli("convert", "peft-to-orbax", adapter, ckpt, "--base", a.base, "--step", "9")
    assert proc.returncode == 0, proc.stderr
    assert "dropped 1 v_proj copies" in proc.stdout and "rule: rank" in proc.stdout
    proc = run_cli("merge", a.base, ckpt, merged, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["merged_tensors"] == 41
    assert rel_l2(hf_logits(merged, TOKENS), a.tunix_logits) <= 1e-5

    info = json.loads(run_cli("inspect", ckpt, "--json").stdout)
    assert info["kind"] == "orbax-lora" and info["metadata"]["lora"]["rules"]
    info = json.loads(run_cli("inspect", adapter, "--json").stdout)
    assert info["kind"] == "peft-adapter" and info["r"] == 8 and info["ckptbridge"]["target"] == "vllm"


# ----------------------------------------------------------------- E2B / E4B, later Tunix, MoE


def test_gemma4_kv_shared_layers_from_older_writers(checkpoints, tmp_path):
    """The first Hub release of E2B/E4B still carries k/v/k_norm on kv-shared layers, which
    transformers ignores: read (and ignored) as well, giving the same Tunix tree; written back
    without them, as save_pretrained writes them."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src, old = checkpoints["gemma4_e2b"], str(tmp_path / "old")
    shutil.copytree(src, old)
    tensors = load_file(os.path.join(old, "model.safetensors"))
    prefix = "model.language_model.layers."
    for i in (4, 5):
        for name in ("k_proj", "v_proj"):
            tensors[f"{prefix}{i}.self_attn.{name}.weight"] = tensors[f"{prefix}{i - 2}.self_attn.{name}.weight"]
        tensors[f"{prefix}{i}.self_attn.k_norm.weight"] = tensors[f"{prefix}{i - 2}.self_attn.k_norm.weight"]
    save_file(tensors, os.path.join(old, "model.safetensors"), metadata={"format": "pt"})
    with open_hf_source(old) as a, open_hf_source(src) as b:
        assert [e.tunix_path for e in a.entries] == [e.tunix_path for e in b.entries]
        assert all(np.array_equal(a.tunix_value(e), b.tunix_value(f)) for e, f in zip(a.entries, b.entries))
        shared = [e for e in a.entries if not e.hf_keys]
        assert {e.layer.index for e in shared} == {4, 5} and all(not a.tunix_value(e).any() for e in shared)
    convert_safetensors_to_orbax(old, str(tmp_path / "orbax"), progress=False)
    convert_orbax_to_safetensors(str(tmp_path / "orbax"), str(tmp_path / "back"), progress=False)
    assert compare_tensors(src, str(tmp_path / "back")).identical


def test_gemma4_e4b_text_both_dialects(tmp_path):
    """Gemma 4 E4B-shaped (per-layer embeddings and kv-shared layers, no double-wide MLP) as
    Gemma4ForCausalLM (gemma4_text, ``model.``), in both config dialects: bitwise both ways, Tunix
    logits (from the per_layer_config files) equal transformers' (on the legacy ones), and a PEFT
    adapter with the per-layer gate and projection gives the same logits in Tunix."""
    import shutil

    import jax

    from ckptbridge.specs.gemma4 import to_per_layer_config
    from ckptbridge.tunix_model import load_tunix_adapter, load_tunix_model

    jax.config.update("jax_default_matmul_precision", "highest")
    legacy = build_checkpoint(str(tmp_path / "legacy"), family="gemma4", model_type="gemma4_text", seed=5,
                              attention_k_eq_v=False, hidden_size_per_layer_input=6, vocab_size_per_layer_input=300,
                              num_kv_shared_layers=2, layer_types=["sliding_attention"] * 3 + ["full_attention"]
                              + ["sliding_attention", "full_attention"])
    src = str(tmp_path / "plc")
    shutil.copytree(legacy, src)
    to_per_layer_config(os.path.join(src, "config.json"))
    for model_dir in (legacy, src):
        orbax_dir, back = str(tmp_path / f"orbax-{os.path.basename(model_dir)}"), str(tmp_path / "back")
        r = convert_safetensors_to_orbax(model_dir, orbax_dir, progress=False)
        assert r.key_prefix == "model." and r.config_mismatch is None
        convert_orbax_to_safetensors(orbax_dir, back, progress=False, overwrite=True)
        assert compare_tensors(model_dir, back).identical
        config = json.load(open(os.path.join(model_dir, "config.json")))
        assert json.load(open(os.path.join(back, "config.json"))) == config
    with open_hf_source(src) as source:
        assert {e.layer.index for e in source.entries if not e.hf_keys} == {4, 5}  # no k/v of their own
        assert source.cfg.sizes["p"] == 6 and source.cfg.sizes["l"] == 6
    model, _ = load_tunix_model(str(tmp_path / "orbax-plc"))
    assert rel_l2(tunix_logits(model, TOKENS), hf_logits(legacy, TOKENS)) <= 1e-5
    peft_dir = build_peft_adapter(legacy, str(tmp_path / "peft"), r=2, lora_alpha=4, seed=6)
    targets = json.load(open(os.path.join(peft_dir, "adapter_config.json")))["target_modules"]
    assert "per_layer_input_gate" in targets and "per_layer_projection" in targets
    convert_peft_to_orbax(peft_dir, str(tmp_path / "lora"), base=src, progress=False)
    got = tunix_logits(load_tunix_adapter(src, str(tmp_path / "lora")), TOKENS)
    assert rel_l2(got, peft_logits(legacy, peft_dir, TOKENS)) <= 1e-5


def test_gemma4_ple_layout_of_later_tunix(checkpoints, tmp_path):
    """Tunix after 0.1.7 keeps the per-layer-embedding table and projection flat, (..., L*P): written
    for such a version on request (and recorded), read back in whichever layout a checkpoint has
    (recorded or not), bit-exact both ways, and loaded into the installed Tunix in its own layout."""
    from ckptbridge.io.orbax import OrbaxCheckpoint, nest, save_tree
    from ckptbridge.metadata import installed_tunix_version

    src = checkpoints["gemma4_e2b"]
    new, old = str(tmp_path / "new"), str(tmp_path / "old")
    r = convert_safetensors_to_orbax(src, new, tunix_version="0.1.8", progress=False)
    r_old = convert_safetensors_to_orbax(src, old, progress=False)
    assert r.tunix_version == "0.1.8" and r_old.tunix_version == installed_tunix_version() == "0.1.7"
    table, projection = ("embedder", "per_layer_input_embedding"), ("embedder", "per_layer_model_projection", "w")
    with OrbaxCheckpoint(new) as a, OrbaxCheckpoint(old) as b:
        assert a.metadata.tunix_version == "0.1.8" and b.metadata.tunix_version == "0.1.7"
        assert a.leaves[table][0] == (300, 6 * 8) and b.leaves[table][0] == (300, 6, 8)
        d = b.leaves[projection][0][0]
        assert a.leaves[projection][0] == (d, 6 * 8) and b.leaves[projection][0] == (d, 6, 8)
        flat_a, flat_b = a.read(list(a.leaves)), b.read(list(b.leaves))
    assert set(flat_a) == set(flat_b)
    for path in flat_a:  # the same numbers; only the two PLE leaves differ in shape
        assert np.array_equal(flat_a[path], flat_b[path].reshape(flat_a[path].shape)), path
        assert (flat_a[path].shape != flat_b[path].shape) == (path in (table, projection))
    bare = str(tmp_path / "bare")  # a later Tunix's own checkpoint: flat, no ckptbridge metadata
    save_tree(bare, nest(flat_a))
    for orbax_dir, config in ((new, None), (bare, src)):
        back = str(tmp_path / f"back-{os.path.basename(orbax_dir)}")
        convert_orbax_to_safetensors(orbax_dir, back, config=config, progress=False)
        assert compare_tensors(src, back).identical, orbax_dir
    parity = logits_parity(src, new)  # loaded into the installed Tunix 0.1.7: (..., L, P) again
    assert parity.rel_l2 <= 1e-5 and parity.argmax_agreement == 1.0, parity
    p = run_cli("convert", "safetensors-to-orbax", src, str(tmp_path / "bad"), "--tunix-version", "next")
    assert p.returncode != 0 and "--tunix-version" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not os.path.exists(str(tmp_path / "bad"))


GEMMA4_MOE = dict(family="gemma4", enable_moe_block=True, num_experts=5, top_k_experts=2, moe_intermediate_size=28)


@pytest.mark.parametrize("prefix, dtype, shards", [("model.language_model.", "float32", 1),
                                                   ("model.", "bfloat16", 2)])
def test_gemma4_moe(tmp_path, prefix, dtype, shards):
    """Gemma 4 26B-A4B-shaped (MoE block beside the dense MLP on every layer; HF keeps each layer's
    experts in one tensor): bit-exact both ways and the tree Tunix's own loader builds; Tunix 0.1.7
    routes on moe_pre_ffw_norm(x) where transformers routes on x, so building the Tunix model needs
    --allow-config-mismatch and verify logits measures the gap, which vanishes when that norm's
    weights are constant (rms(c * rmsnorm(x)) == rmsnorm(x)): the router input is the whole gap.
    An attention adapter merges exactly."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from ckptbridge.tunix_model import tunix_model_config

    src = build_checkpoint(str(tmp_path / "hf"), prefix=prefix, dtype=dtype, shards=shards, seed=3, **GEMMA4_MOE)
    r = convert_safetensors_to_orbax(src, str(tmp_path / "orbax"), skip_multimodal=True, progress=False)
    assert r.layer_kinds == {"sliding + moe": 5, "global (k_eq_v) + moe": 1}
    assert "enable_moe_block" in r.config_mismatch
    convert_orbax_to_safetensors(str(tmp_path / "orbax"), str(tmp_path / "back"), progress=False)
    cmp = compare_tensors(src, str(tmp_path / "back"))
    assert cmp.differing == [] and cmp.only_in_b == [] and all("tower" in k for k in cmp.only_in_a)
    if dtype == "bfloat16":
        return
    with open_hf_source(src, skip_multimodal=True) as source:
        tcfg = tunix_model_config(source.cfg, param_dtype=np.float32, allow_config_mismatch=True)
        from tunix.models.gemma4 import params_safetensors

        theirs = {p: np.asarray(v) for p, v in flat_state(params_safetensors.create_model_from_safe_tensors(
            src, tcfg)).items()}
        ours = {e.tunix_path: source.tunix_value(e) for e in source.entries}
    assert set(ours) == set(theirs) and all(np.array_equal(v, theirs[p]) for p, v in ours.items())
    with pytest.raises(UnsupportedError, match="enable_moe_block .*--allow-config-mismatch"):
        logits_parity(src, str(tmp_path / "orbax"))
    gap = logits_parity(src, str(tmp_path / "orbax"), allow_config_mismatch=True).rel_l2
    const = str(tmp_path / "const")
    shutil.copytree(src, const)
    weights = os.path.join(const, "model.safetensors")
    tensors = load_file(weights)
    for key in tensors:
        if key.endswith("pre_feedforward_layernorm_2.weight"):
            tensors[key] = np.full_like(tensors[key], 0.7)
    save_file(tensors, weights, metadata={"format": "pt"})
    same = logits_parity(const, allow_config_mismatch=True)
    assert gap > 1e-3 and same.rel_l2 <= 1e-5 and same.argmax_agreement == 1.0
    # LoRA on attention and the dense MLP, both ways, checked through Tunix on that model (where Tunix
    # computes what transformers computes); building it still needs the flag
    from ckptbridge.tunix_model import load_tunix_adapter

    cpeft = build_peft_adapter(const, str(tmp_path / "cpeft"), r=2, lora_alpha=4, seed=4)
    r = convert_peft_to_orbax(cpeft, str(tmp_path / "corbax"), base=const, kv="exact", progress=False)
    assert r.modules == len(open_base(const).modules) == 6 * 6  # q, kv (k on the global layer), o, gate, up, down
    with pytest.raises(UnsupportedError, match="--allow-config-mismatch"):
        load_tunix_adapter(const, str(tmp_path / "corbax"))
    model = load_tunix_adapter(const, str(tmp_path / "corbax"), allow_config_mismatch=True)
    ref = peft_logits(const, cpeft, TOKENS)
    assert rel_l2(tunix_logits(model, TOKENS), ref) <= 1e-5 and rel_l2(hf_logits(const, TOKENS), ref) > 1e-2
    model, rules = build_tunix_lora(const, seed=5, allow_config_mismatch=True)
    ckpt = save_tunix_lora(model, str(tmp_path / "ctunix"), custom_metadata={
        "ckptbridge": {"kind": "lora", "lora": {"rules": rules}}})
    convert_orbax_to_peft(ckpt, str(tmp_path / "cback"), base=const, progress=False)
    assert rel_l2(peft_logits(const, str(tmp_path / "cback"), TOKENS), tunix_logits(model, TOKENS)) <= 1e-5
    # `verify adapter` cannot compare through a Tunix model that computes another model: it says why
    from ckptbridge.adapter_check import verify_adapter

    checked = verify_adapter(cpeft, const)
    assert checked.ok and checked.exact["ok"] is None and "enable_moe_block" in checked.exact["skipped"]
    peft_dir = build_peft_adapter(src, str(tmp_path / "peft"), r=2, lora_alpha=4, seed=1)
    merge_lora(src, peft_dir, str(tmp_path / "merged"), progress=False)
    ref = peft_logits(src, peft_dir, TOKENS)
    assert rel_l2(hf_logits(str(tmp_path / "merged"), TOKENS), ref) <= 1e-5
    # LoRA on the experts (target_parameters; one tensor per layer on disk): merged exactly, refused by
    # peft-to-orbax and peft-to-maxtext in one line with nothing written
    experts = build_peft_adapter(src, str(tmp_path / "experts"), r=2, lora_alpha=4, seed=2, scale=1.0,
                                 target_modules=["q_proj"],
                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    r = merge_lora(src, experts, str(tmp_path / "merged-experts"), progress=False)
    assert r.merged_tensors == 6 * 3  # per layer: q_proj and both expert tensors
    ref = peft_logits(src, experts, TOKENS)
    assert rel_l2(hf_logits(str(tmp_path / "merged-experts"), TOKENS), ref) <= 1e-5
    assert rel_l2(hf_logits(src, TOKENS), ref) > 1e-2
    for argv in (("convert", "peft-to-orbax", experts, str(tmp_path / "x"), "--base", src),
                 ("convert", "peft-to-maxtext", experts, str(tmp_path / "x"), "--base", src)):
        cli = run_cli(*argv)
        assert cli.returncode == 5 and "experts.gate_up_proj" in cli.stderr and "ckptbridge merge" in cli.stderr
        errors = [line for line in cli.stderr.splitlines() if line.startswith("ckptbridge: error:")]
        assert len(errors) == 1 and not os.path.exists(str(tmp_path / "x"))
