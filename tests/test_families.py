"""Every guarantee of the Gemma 4 tests, for the other families: Gemma 3 (text-only and the
text model of Gemma3ForConditionalGeneration) and Qwen 3 (untied and tied head).

Tiny random models built with transformers (all dims distinct, random norms): bitwise round
trips (float32 and bfloat16, one file and sharded); our Orbax tree equal to the one Tunix's own
safetensors loader builds; transformers vs Tunix logits; LoRA both ways and merged; inspect;
bad inputs.
"""

import json
import os
import re

import numpy as np
import pytest

from ckptbridge.adapter_check import lint_adapter
from ckptbridge.adapters import convert_orbax_to_peft, convert_peft_to_orbax
from ckptbridge.convert import convert_orbax_to_safetensors, convert_safetensors_to_orbax
from ckptbridge.errors import MismatchError, UnsupportedError
from ckptbridge.merge import merge_lora
from ckptbridge.sources import open_base, open_hf_source
from ckptbridge.testing import build_checkpoint, build_peft_adapter, build_tunix_lora, save_tunix_lora
from ckptbridge.verify import compare_tensors, hf_logits, logits_parity, peft_logits, rel_l2, tunix_logits

from conftest import flat_state, run_cli, tree_hash

CASES = {
    "gemma3_text": dict(family="gemma3", model_type="gemma3_text"),
    "gemma3_mm": dict(family="gemma3", model_type="gemma3"),  # vision tower, language_model.model. on disk
    "qwen3_untied": dict(family="qwen3"),
    "qwen3_tied": dict(family="qwen3", tie_word_embeddings=True),
    "qwen3_moe": dict(family="qwen3", model_type="qwen3_moe"),  # experts stacked from per-expert keys, router
    "qwen2_untied": dict(family="qwen2"),  # q/k/v biases
    "llama3_tied": dict(family="llama3", tie_word_embeddings=True),
    "gemma_mqa": dict(family="gemma"),  # Gemma 1 2B-like: one kv head
    "gemma_fused": dict(family="gemma", num_key_value_heads=4),  # Gemma 1 7B-like: N == K, qkv_einsum
    "gemma2": dict(family="gemma2"),  # sliding/global, softcaps
    # Gemma 4 E2B-shaped: per-layer embeddings, the last 2 layers kv-shared (no k/v of their own) with
    # a double-wide MLP; the pattern Tunix shares like transformers (the last unshared layer global)
    "gemma4_e2b": dict(family="gemma4", prefix="model.language_model.", attention_k_eq_v=False,
                       hidden_size_per_layer_input=8, vocab_size_per_layer_input=300, num_kv_shared_layers=2,
                       use_double_wide_mlp=True, layer_types=["sliding_attention"] * 3 + ["full_attention"]
                       + ["sliding_attention", "full_attention"]),
}
# Tunix's own loader cannot load these (what it says)
# On jax 0.10.0 (the floor) each of these fails one step earlier, on its tree of missing leaves.
_EARLIER = "|Expected None, got ShapeDtypeStruct"
LOADER_FAILS = {
    "gemma_mqa": "pre_ffw_norm|post_attn_norm" + _EARLIER,  # maps Gemma 1's post_attention_layernorm to a norm it lacks
    "gemma_fused": "pre_ffw_norm|post_attn_norm" + _EARLIER,
    "gemma4_e2b": "_key_norm|kv_einsum" + _EARLIER,  # wants k/v of kv-shared layers, which HF files do not have
}
MULTIMODAL = {"gemma3_mm"}
TOKENS = np.random.default_rng(7).integers(3, 300, size=(2, 11))  # longer than 2 x the sliding window (4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """case name (+ "/bf16-sharded") -> tiny HF checkpoint, built lazily once per module."""
    root = tmp_path_factory.mktemp("families")

    class Lazy(dict):
        def __missing__(self, name):
            case, _, variant = name.partition("/")
            kw = dict(CASES[case])
            if variant == "bf16-sharded":
                kw.update(dtype="bfloat16", shards=2)
            path = build_checkpoint(str(root / name.replace("/", "-")), seed=len(self) + 11, **kw)
            self[name] = path
            return path

    return Lazy()


def _skip(case: str) -> dict:
    return {"skip_multimodal": True} if case in MULTIMODAL else {}


@pytest.mark.parametrize("variant", ["", "/bf16-sharded"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_round_trip_is_bitwise(models, tmp_path, case, variant):
    src = models[case + variant]
    before = tree_hash(src)
    orbax_dir, back = str(tmp_path / "orbax"), str(tmp_path / "back")
    r = convert_safetensors_to_orbax(src, orbax_dir, progress=False, **_skip(case))
    r2 = convert_orbax_to_safetensors(orbax_dir, back, max_shard_size="60KB" if variant else "5GB", progress=False)
    cmp = compare_tensors(src, back)
    assert cmp.differing == [] and cmp.only_in_b == []
    with open_hf_source(src, skip_multimodal=True) as source:
        towers = sorted(source.tower_keys)
        assert r.key_prefix == r2.key_prefix == source.prefix
    assert cmp.only_in_a == towers and (bool(towers) == (case in MULTIMODAL))
    if case == "gemma3_mm":  # the prefix found on disk is the one written back
        assert r.key_prefix == "language_model.model."
        assert all(k.startswith("language_model.model.") for k in cmp.only_in_b + sorted(
            json.load(open(os.path.join(back, "model.safetensors.index.json")))["weight_map"]
            if os.path.exists(os.path.join(back, "model.safetensors.index.json")) else []))
    if case == "qwen3_untied":
        assert any(k == "lm_head.weight" for k in _keys(back))
    if variant:
        assert len([f for f in r2.files if f.endswith(".safetensors")]) > 1
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(src, "config.json")))
    assert tree_hash(src) == before


def _keys(model_dir):
    from ckptbridge.io.hf import HFModelDir

    with HFModelDir(model_dir) as m:
        return m.keys()


def _tunix_loader(spec, src, tcfg):
    """The model Tunix's own safetensors loader builds from ``src``."""
    import importlib

    module = {"qwen3": "tunix.models.qwen3.params", "gemma3": "tunix.models.gemma3.params_safetensors",
              "qwen2": "tunix.models.qwen2.params", "llama3": "tunix.models.llama3.params",
              "gemma2": "tunix.models.gemma.params_safetensors", "gemma": "tunix.models.gemma.params_safetensors",
              "gemma4": "tunix.models.gemma4.params_safetensors"}[spec.name]
    return importlib.import_module(module).create_model_from_safe_tensors(src, tcfg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_equals_tunix_loader(models, case):
    """Our map gives exactly the tree Tunix's own loader builds from the same HF files."""
    from ckptbridge.tunix_model import tunix_model_config

    src = models[case]
    with open_hf_source(src, skip_multimodal=True) as source:
        if case in LOADER_FAILS:
            with pytest.raises(Exception, match=LOADER_FAILS[case]):
                _tunix_loader(source.spec, src, tunix_model_config(source.cfg, param_dtype=np.float32))
            return
        theirs = _tunix_loader(source.spec, src, tunix_model_config(source.cfg, param_dtype=np.float32))
        flat = {path: np.asarray(leaf) for path, leaf in flat_state(theirs).items()}
        ours = {e.tunix_path: source.tunix_value(e) for e in source.entries}
    assert set(ours) == set(flat)
    for path, value in ours.items():
        assert value.shape == flat[path].shape and np.array_equal(value, flat[path]), path


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(models, tmp_path, case):
    """transformers on the HF files vs Tunix on the converted Orbax checkpoint, float32."""
    src = models[case]
    orbax_dir = str(tmp_path / "orbax")
    convert_safetensors_to_orbax(src, orbax_dir, progress=False, **_skip(case))
    r = logits_parity(src, orbax_dir)
    assert r.rel_l2 <= 1e-5 and r.argmax_agreement == 1.0, r
    if r.sliding_window:
        assert r.tokens[1] > 2 * r.sliding_window


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory):
    """Per case: a PEFT-made adapter, and a Tunix+qwix LoRA checkpoint with its logits."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    root = tmp_path_factory.mktemp("family-adapters")
    out = {}

    class Lazy(dict):
        def __missing__(self, case):
            base = models[case]
            peft_dir = build_peft_adapter(base, str(root / f"{case}-peft"), r=4, lora_alpha=10, seed=3)
            model, rules = build_tunix_lora(base, seed=2)
            ckpt = save_tunix_lora(model, str(root / f"{case}-tunix"), custom_metadata={
                "ckptbridge": {"kind": "lora", "lora": {"rules": rules}}})
            out[case] = {"base": base, "peft": peft_dir, "tunix": ckpt, "tunix_logits": tunix_logits(model, TOKENS)}
            self[case] = out[case]
            return out[case]

    return Lazy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_to_orbax_gives_peft_logits(adapters, tmp_path, case):
    from ckptbridge.tunix_model import load_tunix_adapter

    a = adapters[case]
    dst = str(tmp_path / "orbax-lora")
    r = convert_peft_to_orbax(a["peft"], dst, base=a["base"], kv="exact", progress=False)
    assert r.modules > 0
    ref = peft_logits(a["base"], a["peft"], TOKENS)
    model = load_tunix_adapter(a["base"], dst)
    got = tunix_logits(model, TOKENS)
    assert rel_l2(got, ref) <= 1e-5
    assert rel_l2(hf_logits(a["base"], TOKENS), ref) > 1e-2  # the adapter does something


@pytest.mark.parametrize("target", ["hf", "vllm"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_orbax_to_peft_gives_tunix_logits(adapters, tmp_path, case, target):
    a = adapters[case]
    dst = str(tmp_path / "peft")
    r = convert_orbax_to_peft(a["tunix"], dst, base=a["base"], target=target, progress=False)
    b = open_base(a["base"])
    assert r.modules == sum(len(m.hf_modules) for m in b.modules)
    cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
    assert all(re.fullmatch(cfg["target_modules"], n) for m in b.modules for n in m.hf_modules)  # as PEFT matches
    got = peft_logits(a["base"], dst, TOKENS)
    assert rel_l2(got, a["tunix_logits"]) <= 1e-5
    lint = lint_adapter(dst, a["base"], target=target)  # `ckptbridge verify adapter --lint-only`
    assert lint.errors == [] and lint.modules == r.modules


@pytest.mark.parametrize("case", sorted(CASES))
def test_merge_equals_adapter(adapters, tmp_path, case):
    a = adapters[case]
    ref = peft_logits(a["base"], a["peft"], TOKENS)
    merged = str(tmp_path / "merged")
    r = merge_lora(a["base"], a["peft"], merged, progress=False)
    assert r.merged_tensors > 0
    assert rel_l2(hf_logits(merged, TOKENS), ref) <= 1e-5
    merged_tunix = str(tmp_path / "merged-tunix")  # the Orbax LoRA checkpoint merges too
    merge_lora(a["base"], a["tunix"], merged_tunix, progress=False)
    assert rel_l2(hf_logits(merged_tunix, TOKENS), a["tunix_logits"]) <= 1e-5


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
    r = convert_peft_to_orbax(a["peft"], str(tmp_path / "svd"), base=a["base"], kv="svd", progress=False)
    layers = len(open_base(a["base"]).cfg.layers)
    assert r.modes["svd"] == layers and len(r.svd_relative_error) == layers
    assert all(0 < e < 1 for e in r.svd_relative_error.values()) and r.rules[0]["rank"] == 4
    got = tunix_logits(load_tunix_adapter(a["base"], str(tmp_path / "svd")), TOKENS)
    ref, base = peft_logits(a["base"], a["peft"], TOKENS), hf_logits(a["base"], TOKENS)
    assert rel_l2(got, ref) < rel_l2(base, ref)  # closer to the adapter than no adapter at all


def test_expert_lora_merges_and_is_refused_by_peft_to_orbax(models, tmp_path):
    """A PEFT adapter on Qwen 3 MoE's experts (target_parameters: transformers' fused gate_up_proj and
    down_proj) merges exactly into the per-expert keys on disk; peft-to-orbax refuses it in one line
    (qwix puts no LoRA on Tunix's expert parameters) and writes nothing."""
    base = models["qwen3_moe"]
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_inspect(models, case):
    r = run_cli("inspect", models[case], "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["family"] == CASES[case]["family"] and info["valid"] is True
    assert info["key_prefix"] == {"gemma3_mm": "language_model.model.", "gemma4_e2b": "model.language_model."}.get(
        case, "model.")


def test_bad_inputs(models, adapters, tmp_path):
    qwen, gemma = models["qwen3_untied"], models["gemma3_text"]
    # an adapter of one family on a base of another (the tiny Gemma 3 and Qwen 3 text models share
    # module names and shapes, so a multimodal Gemma 3 adapter is the one that cannot fit Qwen 3)
    with pytest.raises(MismatchError, match="not a LoRA-able module of the qwen3 base"):
        convert_peft_to_orbax(adapters["gemma3_mm"]["peft"], str(tmp_path / "x"), base=qwen, progress=False)
    with pytest.raises(MismatchError, match="family 'gemma3'.*'qwen3'|not a LoRA factor"):
        convert_orbax_to_peft(adapters["gemma3_text"]["tunix"], str(tmp_path / "y"), base=qwen, progress=False)
    # a Qwen 3 Orbax checkpoint with a Gemma 3 config
    orbax_dir = str(tmp_path / "orbax")
    convert_safetensors_to_orbax(qwen, orbax_dir, progress=False)
    with pytest.raises(MismatchError):
        convert_orbax_to_safetensors(orbax_dir, str(tmp_path / "z"), config=gemma, progress=False)
    assert not os.path.exists(tmp_path / "z")
    # the untied head missing, a tensor too many, a multimodal checkpoint without --skip-multimodal
    r = run_cli("inspect", qwen, "--json")
    assert r.returncode == 0
    broken = _rewrite(qwen, tmp_path / "no-head", drop="lm_head.weight")
    with pytest.raises(MismatchError, match="'lm_head.weight' is missing"):
        convert_safetensors_to_orbax(broken, str(tmp_path / "o1"), progress=False)
    extra = _rewrite(gemma, tmp_path / "extra", add="model.layers.0.self_attn.q_proj.bias")
    with pytest.raises(MismatchError, match="unexpected tensor 'model.layers.0.self_attn.q_proj.bias'"):
        convert_safetensors_to_orbax(extra, str(tmp_path / "o2"), progress=False)
    with pytest.raises(UnsupportedError, match="--skip-multimodal"):
        convert_safetensors_to_orbax(models["gemma3_mm"], str(tmp_path / "o3"), progress=False)
    # prefix mix-up: one tensor under the other prefix of the family
    mixed = _rewrite(models["gemma3_mm"], tmp_path / "mixed", rename=(
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


def _rewrite(src, dst, *, drop=None, add=None, rename=None):
    """A copy of the HF directory ``src`` with one tensor dropped, added or renamed."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    name = "model.safetensors"
    tensors = load_file(os.path.join(dst, name))
    if drop:
        tensors.pop(drop)
    if add:
        tensors[add] = np.zeros(4, np.float32)
    if rename:
        tensors[rename[1]] = tensors.pop(rename[0])
    save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["qwen3_untied", "gemma3_mm", "qwen2_untied", "llama3_tied", "gemma_fused", "gemma2",
                                  "qwen3_moe", "gemma4_e2b"])
def test_training_on_a_mesh_then_export(models, tmp_path, case):
    """`python -m training --preset tiny-cpu --base DIR` takes the family from the base's config and
    the LoRA targets from its spec; on 2 simulated devices (tp=2) the base is loaded sharded; the
    checkpoint converts with no flags and PEFT on transformers gives the Tunix+qwix logits."""
    import subprocess
    import sys

    import jax

    from ckptbridge.specs import get_family
    from ckptbridge.tunix_model import load_tunix_lora_model
    from training.cli import SAMPLE_DATA

    base, run = models[case], str(tmp_path / "run")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-m", "training", "--preset", "tiny-cpu", "--quiet", "--base", base,
                           "--data", SAMPLE_DATA, "--out", run, "--max-steps", "3", "max_length=256", "grad_accum=1",
                           "tp=2", "learning_rate=5e-3"], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["steps"] == 3
    assert "'tp': 2" in proc.stderr and "LoRA factors" in proc.stderr  # the mesh line was logged
    rules = json.load(open(os.path.join(run, "config.json")))
    assert rules["targets"] == []  # all of the family's
    jax.config.update("jax_default_matmul_precision", "highest")
    adapter = str(tmp_path / "adapter")
    r = convert_orbax_to_peft(os.path.join(run, "checkpoints"), adapter, base=base, progress=False)
    spec = get_family(CASES[case]["family"])
    names = {n.rsplit(".", 1)[-1] for m in open_base(base).modules for n in m.hf_modules}
    assert r.modules == sum(len(m.hf_modules) for m in open_base(base).modules)
    # qwix puts no LoRA on experts (raw parameters); E2B adds the per-layer input gate and projection
    assert len(names) == {"qwen3_moe": 4, "gemma4_e2b": 9}.get(case, 7)
    model, step, recorded = load_tunix_lora_model(base, os.path.join(run, "checkpoints"))
    assert step == 3 and all(t in recorded[0]["module_path"] for t in spec.lora_targets)
    assert rel_l2(peft_logits(base, adapter, TOKENS), tunix_logits(model, TOKENS)) <= 1e-5


def test_gemma3_newer_writers_prefix(models, tmp_path):
    """Gemma3ForConditionalGeneration files written as `model.language_model.` / `model.vision_tower.`
    (newer writers) read as well, and the prefix found is the one written back."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src = str(tmp_path / "newer")
    shutil.copytree(models["gemma3_mm"], src)
    path = os.path.join(src, "model.safetensors")
    renamed = {}
    for key, value in load_file(path).items():
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model."):]
        elif key.startswith(("vision_tower.", "multi_modal_projector.")):
            key = "model." + key
        renamed[key] = value
    save_file(renamed, path, metadata={"format": "pt"})
    r = convert_safetensors_to_orbax(src, str(tmp_path / "orbax"), skip_multimodal=True, progress=False)
    assert r.key_prefix == "model.language_model." and r.towers_dropped > 0
    convert_orbax_to_safetensors(str(tmp_path / "orbax"), str(tmp_path / "back"), progress=False)
    cmp = compare_tensors(src, str(tmp_path / "back"))
    assert cmp.differing == [] and cmp.only_in_b == []
    assert all(k.startswith("model.vision_tower.") or k.startswith("model.multi_modal_projector.")
               for k in cmp.only_in_a)
    # and the original (older) layout of the same model gives the same Tunix tree
    with open_hf_source(src, skip_multimodal=True) as a, open_hf_source(models["gemma3_mm"], skip_multimodal=True) as b:
        assert [e.tunix_path for e in a.entries] == [e.tunix_path for e in b.entries]
        assert all(np.array_equal(a.tunix_value(e), b.tunix_value(f)) for e, f in zip(a.entries, b.entries))


@pytest.mark.parametrize("family, rope", [
    ("llama3", {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),  # Llama 3.1 8B
    ("qwen3", {"rope_type": "default", "rope_theta": 5_000_000.0}),  # Qwen3-4B-2507
])
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


def test_gemma4_kv_shared_layers_from_older_writers(models, tmp_path):
    """The first Hub release of E2B/E4B still carries k/v/k_norm on kv-shared layers, which
    transformers ignores: read (and ignored) as well, giving the same Tunix tree; written back
    without them, as save_pretrained writes them."""
    import shutil

    from safetensors.numpy import load_file, save_file

    src, old = models["gemma4_e2b"], str(tmp_path / "old")
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
        assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(model_dir, "config.json")))
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


def test_gemma4_ple_layout_of_later_tunix(models, tmp_path):
    """Tunix after 0.1.7 keeps the per-layer-embedding table and projection flat, (..., L*P): written
    for such a version on request (and recorded), read back in whichever layout a checkpoint has
    (recorded or not), bit-exact both ways, and loaded into the installed Tunix in its own layout."""
    from ckptbridge.io.orbax import OrbaxCheckpoint, nest, save_tree
    from ckptbridge.metadata import installed_tunix_version

    src = models["gemma4_e2b"]
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
    # peft-to-orbax in one line with nothing written
    experts = build_peft_adapter(src, str(tmp_path / "experts"), r=2, lora_alpha=4, seed=2, scale=1.0,
                                 target_modules=["q_proj"],
                                 target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    r = merge_lora(src, experts, str(tmp_path / "merged-experts"), progress=False)
    assert r.merged_tensors == 6 * 3  # per layer: q_proj and both expert tensors
    ref = peft_logits(src, experts, TOKENS)
    assert rel_l2(hf_logits(str(tmp_path / "merged-experts"), TOKENS), ref) <= 1e-5
    assert rel_l2(hf_logits(src, TOKENS), ref) > 1e-2
    for argv in (("convert", "peft-to-orbax", experts, str(tmp_path / "x"), "--base", src),):
        cli = run_cli(*argv)
        assert cli.returncode == 5 and "experts.gate_up_proj" in cli.stderr and "ckptbridge merge" in cli.stderr
        errors = [line for line in cli.stderr.splitlines() if line.startswith("ckptbridge: error:")]
        assert len(errors) == 1 and not os.path.exists(str(tmp_path / "x"))
