"""LoRA both ways: Tunix/qwix checkpoints <-> PEFT adapters, and merge_lora, checked by logits."""

import json
import os

import numpy as np
import pytest

from ckptbridge import lora
from ckptbridge.adapters import convert_orbax_to_peft, convert_peft_to_orbax
from ckptbridge.errors import ConfigError, MismatchError, OutputError, UnsupportedError
from ckptbridge.io.orbax import OrbaxCheckpoint, nest
from ckptbridge.io.safetensors import SafetensorsFile
from ckptbridge.merge import merge_lora
from ckptbridge.lora import open_base
from ckptbridge.testing import lora_targets, build_peft_adapter, build_tunix_lora, save_tunix_lora
from ckptbridge.verify import hf_logits, peft_logits, rel_l2, tunix_logits

from conftest import tree_hash

pytestmark = pytest.mark.slow
TOKENS = np.random.default_rng(11).integers(0, 300, size=(2, 11))
# alpha != rank everywhere; kv at its own rank
RULES = [{"module_path": ".*kv_einsum", "rank": 8, "alpha": 32.0},
         {"module_path": lora_targets(), "rank": 4, "alpha": 10.0}]


@pytest.fixture(scope="module")
def precise():
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="module")
def tunix_lora(checkpoints, tmp_path_factory, precise):
    """A qwix LoRA model on all seven targets, saved by Tunix's CheckpointManager with our rules."""
    base = checkpoints["keqv_lm_f32_sharded"]
    model, rules = build_tunix_lora(base, RULES, seed=1)
    root = str(tmp_path_factory.mktemp("lora") / "ckpt")
    save_tunix_lora(model, root, step=3, custom_metadata={"ckptbridge": {"kind": "lora", "family": "gemma4",
                                                                        "lora": {"rules": rules}}})
    return {"base": base, "root": root, "logits": tunix_logits(model, TOKENS)}


@pytest.fixture(scope="module")
def plain_tunix_lora(checkpoints, tmp_path_factory, precise):
    """The same without any metadata (as a plain Tunix run writes it): alpha must be given."""
    base = checkpoints["kv_text_f32_sharded"]
    model, _ = build_tunix_lora(base, [{"module_path": lora_targets(), "rank": 4, "alpha": 6.0}], seed=2)
    root = str(tmp_path_factory.mktemp("plain") / "ckpt")
    save_tunix_lora(model, root, step=5)
    return {"base": base, "root": root, "logits": tunix_logits(model, TOKENS)}


@pytest.fixture(scope="module")
def peft_adapter(checkpoints, tmp_path_factory):
    """An adapter made by PEFT (k_proj and v_proj with different A), alpha != r, rsLoRA off."""
    base = checkpoints["keqv_lm_f32_sharded"]
    path = build_peft_adapter(base, str(tmp_path_factory.mktemp("peft") / "adapter"), r=4, lora_alpha=10, seed=3,
                              rank_pattern={"down_proj": 6}, alpha_pattern={"down_proj": 3})
    return {"base": base, "path": path, "logits": peft_logits(base, path, TOKENS)}


def test_layouts_follow_from_the_table():
    from ckptbridge.specs import GEMMA4

    got = {r.name: lora.lora_layouts(r) for r in GEMMA4.rules if r.lora}
    assert (got["q"].a_tunix, got["q"].b_tunix, got["q"].a_peft, got["q"].b_peft) == ("d r", "r n h", "r (d)", "(n h) r")
    assert (got["kv"].a_tunix, got["kv"].b_tunix, got["kv"].b_peft_stacked) == ("d r", "r c k h", "c (k h) r")
    assert (got["o"].a_tunix, got["o"].b_tunix, got["o"].a_peft) == ("n h r", "r d", "r (n h)")
    assert (got["down"].a_tunix, got["down"].b_tunix) == ("f r", "r d")
    assert (got["k"].a_tunix, got["k"].b_tunix) == ("d r", "r k h")


def test_orbax_to_peft_gives_tunix_logits(tunix_lora, tmp_path):
    dst = str(tmp_path / "adapter")
    r = convert_orbax_to_peft(tunix_lora["root"], dst, base=tunix_lora["base"], progress=False)
    cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["r"] == 4 and cfg["lora_alpha"] == 10
    assert "language_model" in cfg["target_modules"]
    assert set(cfg["rank_pattern"].values()) == {8} and set(cfg["alpha_pattern"].values()) == {32}
    with SafetensorsFile(os.path.join(dst, "adapter_model.safetensors")) as f:
        keys = f.keys()
    assert "base_model.model.model.language_model.layers.5.self_attn.k_proj.lora_A.weight" in keys
    assert not any("layers.5.self_attn.v_proj" in k for k in keys)  # k_eq_v layer, hf target
    assert r.modules == 5 * 7 + 6  # sliding: q k v o gate up down; global: q k o gate up down
    ours = peft_logits(tunix_lora["base"], dst, TOKENS)
    assert rel_l2(ours, tunix_lora["logits"]) <= 1e-5


def test_alpha_flag_for_checkpoints_without_metadata(plain_tunix_lora, tmp_path):
    with pytest.raises(ConfigError, match="--alpha"):
        convert_orbax_to_peft(plain_tunix_lora["root"], str(tmp_path / "x"), base=plain_tunix_lora["base"], progress=False)
    assert not os.path.exists(tmp_path / "x")
    dst = str(tmp_path / "adapter")
    convert_orbax_to_peft(plain_tunix_lora["root"], dst, base=plain_tunix_lora["base"], alpha=6, progress=False)
    assert rel_l2(peft_logits(plain_tunix_lora["base"], dst, TOKENS), plain_tunix_lora["logits"]) <= 1e-5


def test_vllm_target_repeats_k_as_v_and_warns_on_rank(tunix_lora, tmp_path, caplog):
    dst = str(tmp_path / "vllm")
    r = convert_orbax_to_peft(tunix_lora["root"], dst, base=tunix_lora["base"], target="vllm", progress=False)
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
    merge_lora(tunix_lora["base"], dst, merged, progress=False)
    assert rel_l2(hf_logits(merged, TOKENS), tunix_lora["logits"]) <= 1e-5


def test_vllm_rank_warning(plain_tunix_lora, tmp_path):
    r = convert_orbax_to_peft(plain_tunix_lora["root"], str(tmp_path / "v"), base=plain_tunix_lora["base"],
                              alpha=6, target="vllm", progress=False)
    assert not r.warnings  # rank 4 fits vLLM's default
    model, _ = build_tunix_lora(plain_tunix_lora["base"], [{"module_path": ".*q_einsum", "rank": 24, "alpha": 8.0}])
    root = save_tunix_lora(model, str(tmp_path / "r24"))
    r = convert_orbax_to_peft(root, str(tmp_path / "v24"), base=plain_tunix_lora["base"], alpha=8, target="vllm",
                              progress=False)
    assert r.warnings == ["rank 24 exceeds vLLM's default --max-lora-rank 16: serve with --max-lora-rank 32"]


def test_peft_to_orbax_restores_into_qwix_exact(peft_adapter, tmp_path):
    from ckptbridge.tunix_model import load_tunix_lora_model

    dst = str(tmp_path / "ckpt")
    r = convert_peft_to_orbax(peft_adapter["path"], dst, base=peft_adapter["base"], progress=False)
    assert r.modes["exact"] == 5  # every sliding layer: k and v with different A
    assert os.path.isfile(os.path.join(dst, "0", "model_params", "_METADATA"))
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(os.path.abspath(dst)) as mngr:
        rules = mngr.metadata(0).custom_metadata["ckptbridge"]["lora"]["rules"]
    assert {(x["rank"], x["alpha"]) for x in rules} >= {(4, 10), (8, 20)}
    model, step, _ = load_tunix_lora_model(peft_adapter["base"], dst)
    assert step == 0
    assert rel_l2(tunix_logits(model, TOKENS), peft_adapter["logits"]) <= 1e-5


def test_peft_to_orbax_svd_reports_error(peft_adapter, tmp_path):
    dst = str(tmp_path / "ckpt")
    r = convert_peft_to_orbax(peft_adapter["path"], dst, base=peft_adapter["base"], kv="svd", progress=False)
    errors = r.svd_relative_error
    assert len(errors) == 5 and all(0 < e < 1 for e in errors.values())
    assert all(rule["rank"] != 8 for rule in r.rules)  # rank kept at r


def test_merge_equals_adapter_from_both_kinds(tunix_lora, peft_adapter, tmp_path):
    for name, base, adapter, ref in (
        ("orbax", tunix_lora["base"], tunix_lora["root"], tunix_lora["logits"]),
        ("peft", peft_adapter["base"], peft_adapter["path"], peft_adapter["logits"]),
    ):
        dst = str(tmp_path / name)
        r = merge_lora(base, adapter, dst, max_shard_size="150KB", progress=False)
        assert r.merged_tensors > 0 and len(r.files) > 2
        assert rel_l2(hf_logits(dst, TOKENS), ref) <= 1e-5, name
        # the merged model converts with our own safetensors-to-orbax too
        from ckptbridge.convert import convert_safetensors_to_orbax

        convert_safetensors_to_orbax(dst, str(tmp_path / f"{name}-orbax"), progress=False)


def test_merge_keeps_bf16(checkpoints, tmp_path):
    base = checkpoints["keqv_text_bf16_single"]
    adapter = build_peft_adapter(base, str(tmp_path / "a"), r=2, lora_alpha=4, seed=5)
    dst = str(tmp_path / "merged")
    merge_lora(base, adapter, dst, progress=False)
    from ckptbridge.io.hf import HFModelDir

    with HFModelDir(dst) as m, HFModelDir(base) as b:
        assert {m.info(k).dtype for k in m.keys()} == {"BF16"}
        changed = [k for k in m.keys() if m.file_of(k).raw(k) != b.file_of(k).raw(k)]
    assert changed and all(k.endswith("_proj.weight") for k in changed)
    ref = peft_logits(base, adapter, TOKENS)
    assert rel_l2(hf_logits(dst, TOKENS), ref) <= 2e-2  # bf16 weights: rounding of W + delta


def test_round_trip_orbax_peft_orbax_is_bitwise(tunix_lora, tmp_path):
    adapter, back = str(tmp_path / "adapter"), str(tmp_path / "back")
    convert_orbax_to_peft(tunix_lora["root"], adapter, base=tunix_lora["base"], progress=False)
    r = convert_peft_to_orbax(adapter, back, base=tunix_lora["base"], step=3, progress=False)
    assert "exact" not in r.modes  # qwix shares A between k and v: nothing to stack
    with OrbaxCheckpoint(os.path.join(tunix_lora["root"], "3", "model_params")) as a, \
            OrbaxCheckpoint(os.path.join(back, "3", "model_params")) as b:
        assert a.leaves == b.leaves
        for leaf in a.leaves:
            assert a.read([leaf])[leaf].tobytes() == b.read([leaf])[leaf].tobytes(), leaf
        rules_a = a.ckptbridge_metadata["lora"]["rules"]
        rules_b = b.ckptbridge_metadata["lora"]["rules"]
    base = open_base(tunix_lora["base"])
    for mod in base.modules:  # the recorded rules give every module the same rank and alpha
        assert lora.scaling_from_rules(mod, rules_a, "a") == lora.scaling_from_rules(mod, rules_b, "b")


def test_tunix_checkpoint_read_directly_equals_orbax_restore(tunix_lora):
    """The LoRA tree Tunix's CheckpointManager wrote is read without Orbax (TensorStore directly),
    leaf for leaf the bytes Orbax restores."""
    import orbax.checkpoint as ocp

    item = os.path.join(tunix_lora["root"], "3", "model_params")
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(item).item_metadata.tree
    paths = []

    def walk(node, prefix):
        for k, v in node.items():
            walk(v, prefix + (k,)) if isinstance(v, dict) else paths.append(prefix + (k,))

    walk(meta, ())
    restore_args = nest({p: ocp.RestoreArgs(restore_type=np.ndarray) for p in paths})
    with ocp.PyTreeCheckpointer() as ckptr:
        restored = ckptr.restore(item, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    with OrbaxCheckpoint(item) as ck:
        assert ck.reader == "tensorstore" and sorted(ck.leaves) == sorted(paths)
        assert ck.ckptbridge_metadata["lora"]["rules"]
        got = ck.read(paths)
    for p in paths:
        want = restored
        for k in p:
            want = want[k]
        assert got[p].dtype == want.dtype and got[p].tobytes() == np.asarray(want).tobytes(), p


def test_round_trip_peft_orbax_peft_keeps_deltas(peft_adapter, tmp_path):
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    convert_peft_to_orbax(peft_adapter["path"], ckpt, base=peft_adapter["base"], progress=False)
    convert_orbax_to_peft(ckpt, back, base=peft_adapter["base"], progress=False)
    base = open_base(peft_adapter["base"])
    with lora.open_peft_lora(peft_adapter["path"], base) as a, lora.open_peft_lora(back, base) as b:
        assert set(a.keys) == set(b.keys)
        for module in a.keys:
            (aa, ab), (ba, bb) = a.pair(module), b.pair(module)
            da = a.scaling[module].scale * (ab.astype(np.float64) @ aa)
            db = b.scaling[module].scale * (bb.astype(np.float64) @ ba)
            np.testing.assert_allclose(db, da, rtol=1e-6, atol=1e-7, err_msg=module)


def test_rslora_and_patterns_are_honoured(checkpoints, tmp_path):
    from ckptbridge.tunix_model import load_tunix_lora_model

    base = checkpoints["kv_text_f32_sharded"]
    adapter = build_peft_adapter(base, str(tmp_path / "a"), r=4, lora_alpha=8, seed=7, use_rslora=True,
                                 rank_pattern={"q_proj": 2}, alpha_pattern={"o_proj": 5})
    ref = peft_logits(base, adapter, TOKENS)
    dst = str(tmp_path / "ckpt")
    convert_peft_to_orbax(adapter, dst, base=base, progress=False)
    model, _, _ = load_tunix_lora_model(base, dst)
    assert rel_l2(tunix_logits(model, TOKENS), ref) <= 1e-5
    merged = str(tmp_path / "merged")
    merge_lora(base, adapter, merged, progress=False)
    assert rel_l2(hf_logits(merged, TOKENS), ref) <= 1e-5


@pytest.mark.parametrize("field, value, error, needle", [
    ("use_dora", True, UnsupportedError, "DoRA"),
    ("modules_to_save", ["lm_head"], UnsupportedError, "modules_to_save"),
    ("peft_type", "IA3", UnsupportedError, "peft_type"),
    ("r", 0, Exception, "r must be"),
])
def test_adapter_config_rejections(peft_adapter, tmp_path, field, value, error, needle):
    import shutil

    src = str(tmp_path / "a")
    shutil.copytree(peft_adapter["path"], src)
    path = os.path.join(src, "adapter_config.json")
    cfg = json.load(open(path))
    cfg[field] = value
    json.dump(cfg, open(path, "w"))
    before = tree_hash(src)
    with pytest.raises(error, match=needle):
        convert_peft_to_orbax(src, str(tmp_path / "out"), base=peft_adapter["base"], progress=False)
    with pytest.raises(error, match=needle):
        merge_lora(peft_adapter["base"], src, str(tmp_path / "m"), progress=False)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "m")
    assert tree_hash(src) == before


def test_wrong_base_is_named(tunix_lora, peft_adapter, checkpoints, tmp_path):
    other = checkpoints["kv_text_f32_sharded"]  # no k_eq_v: the global layer has kv_einsum, not k_einsum
    with pytest.raises(MismatchError, match="k_einsum"):
        convert_orbax_to_peft(tunix_lora["root"], str(tmp_path / "x"), base=other, progress=False)
    with pytest.raises(MismatchError, match="wrong --base|not a LoRA-able module"):
        convert_peft_to_orbax(peft_adapter["path"], str(tmp_path / "y"), base=other, progress=False)
    assert not os.path.exists(tmp_path / "x") and not os.path.exists(tmp_path / "y")


def test_existing_destination_and_corrupt_adapter(peft_adapter, tmp_path):
    import shutil

    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputError, match="--overwrite"):
        convert_peft_to_orbax(peft_adapter["path"], str(out), base=peft_adapter["base"], progress=False)
    src = str(tmp_path / "a")
    shutil.copytree(peft_adapter["path"], src)
    weights = os.path.join(src, "adapter_model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    from ckptbridge.errors import CorruptFileError

    with pytest.raises(CorruptFileError, match="adapter_model.safetensors"):
        convert_peft_to_orbax(src, str(tmp_path / "o2"), base=peft_adapter["base"], progress=False)
    assert not os.path.exists(tmp_path / "o2")


def test_cli_lora_verbs(tunix_lora, tmp_path):
    from conftest import run_cli

    adapter, ckpt, merged = str(tmp_path / "adapter"), str(tmp_path / "ckpt"), str(tmp_path / "merged")
    proc = run_cli("convert", "orbax-to-peft", tunix_lora["root"], adapter, "--base", tunix_lora["base"], "--target", "vllm")
    assert proc.returncode == 0, proc.stderr
    assert "orbax-to-peft (vllm)" in proc.stdout and "padded every module to rank 8" in proc.stdout
    proc = run_cli("convert", "peft-to-orbax", adapter, ckpt, "--base", tunix_lora["base"], "--step", "9")
    assert proc.returncode == 0, proc.stderr
    assert "dropped 1 v_proj copies" in proc.stdout and "rule: rank" in proc.stdout
    proc = run_cli("merge", tunix_lora["base"], ckpt, merged, "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["merged_tensors"] == 41
    assert rel_l2(hf_logits(merged, TOKENS), tunix_lora["logits"]) <= 1e-5

    info = json.loads(run_cli("inspect", ckpt, "--json").stdout)
    assert info["kind"] == "orbax-lora" and info["metadata"]["lora"]["rules"]
    info = json.loads(run_cli("inspect", adapter, "--json").stdout)
    assert info["kind"] == "peft-adapter" and info["r"] == 8 and info["ckptbridge"]["target"] == "vllm"


def test_cli_errors(tunix_lora, plain_tunix_lora, tmp_path):
    from ckptbridge.io.safetensors import PlannedTensor, write_file
    from conftest import run_cli

    before = tree_hash(plain_tunix_lora["root"])
    dst = str(tmp_path / "x")
    proc = run_cli("convert", "orbax-to-peft", plain_tunix_lora["root"], dst, "--base", plain_tunix_lora["base"])
    assert proc.returncode == 8 and "--alpha" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not os.path.exists(dst) and tree_hash(plain_tunix_lora["root"]) == before

    # an adapter of another architecture (GPT-2 style module names)
    foreign = tmp_path / "gpt2"
    foreign.mkdir()
    (foreign / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    t = np.zeros((2, 8), np.float32)
    write_file(str(foreign / "adapter_model.safetensors"),
               [PlannedTensor("base_model.model.transformer.h.0.attn.c_attn.lora_A.weight", t.dtype, t.shape, lambda: t)])
    proc = run_cli("merge", tunix_lora["base"], str(foreign), dst)
    assert proc.returncode == 6 and "transformer.h.0.attn.c_attn" in proc.stderr and "another model" in proc.stderr
    assert not os.path.exists(dst)

    proc = run_cli("convert", "peft-to-orbax", str(foreign), dst, "--base", tunix_lora["base"], "--kv", "best")
    assert proc.returncode == 2
