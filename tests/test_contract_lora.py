"""The family contract, LoRA: on every row of tests/families.py with the ``lora`` check, a PEFT
adapter (made by PEFT) and a Tunix+qwix LoRA checkpoint (saved by Tunix's CheckpointManager) convert
each way, merge, and round-trip, checked by logits against the framework that made them; training
(``train``). Below: what the LoRA verbs do whatever the family, checked on one row."""

import json
import os
import re

import numpy as np
import pytest

from ckptbridge.formats import peft
from ckptbridge.lora import rules as lora_rules
from ckptbridge.adapter_check import lint_adapter
from ckptbridge import convert_orbax_to_peft, convert_peft_to_orbax
from ckptbridge.errors import ConfigError, OutputError, UnsupportedError
from ckptbridge.io.orbax import OrbaxCheckpoint, nest
from ckptbridge.lora.base import open_base
from ckptbridge import merge_lora
from ckptbridge.testing import build_peft_adapter, build_tunix_lora, lora_targets, save_tunix_lora
from ckptbridge.verify import hf_logits, peft_logits, rel_l2, tunix_logits

from conftest import run_cli, tree_hash
from families import CASES, TOKENS, rows

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", rows("lora"))
def test_peft_to_orbax_gives_peft_logits(adapters, name):
    """A PEFT adapter as a Tunix checkpoint root (``<step>/model_params``, rules recorded; --kv exact,
    the default) gives PEFT's logits in Tunix with qwix (and the adapter does change them)."""
    import orbax.checkpoint as ocp

    from ckptbridge.tunix_model import load_tunix_adapter

    a = adapters[name]
    dst, r = a.peft_as_orbax
    assert r.modules > 0 and r.step == 0 and r.kv == "exact"
    assert os.path.isfile(os.path.join(dst, "0", "model_params", "_METADATA"))
    with ocp.CheckpointManager(os.path.abspath(dst)) as mngr:
        assert mngr.metadata(0).custom_metadata["ckptbridge"]["lora"]["rules"] == r.rules
    got = tunix_logits(load_tunix_adapter(a.base, dst), TOKENS)
    assert rel_l2(got, a.peft_logits) <= 1e-5
    assert rel_l2(a.base_logits, a.peft_logits) > 1e-2  # the adapter does something


def _vllm_aliases(base) -> int:
    """HF modules a vLLM export fills besides each module's own (Gemma 4's K-only k_einsum: v_proj)."""
    return sum(len(m.entry.rule.vllm_lora_aliases) for m in base.modules)


@pytest.mark.parametrize("target", ["hf", "vllm"])
@pytest.mark.parametrize("name", rows("lora"))
def test_orbax_to_peft_gives_tunix_logits(adapters, tmp_path, name, target):
    """A Tunix+qwix checkpoint as a PEFT adapter for transformers (``hf``) or vLLM: every module,
    named as PEFT matches them; PEFT on transformers gives the Tunix+qwix logits; the lint of
    ``verify adapter`` finds nothing."""
    a = adapters[name]
    if target == "hf":  # the default
        dst, r = a.tunix_as_peft
    else:
        dst = str(tmp_path / "peft")
        r = convert_orbax_to_peft(a.tunix, dst, base=a.base, target=target, progress=False)
    assert r.target == target
    b = open_base(a.base)
    assert r.modules == sum(len(m.hf_modules) for m in b.modules) + (_vllm_aliases(b) if target == "vllm" else 0)
    cfg = json.load(open(os.path.join(dst, "adapter_config.json")))
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert all(re.fullmatch(cfg["target_modules"], n) for m in b.modules for n in m.hf_modules)  # as PEFT matches
    got = peft_logits(a.base, dst, TOKENS)
    assert rel_l2(got, a.tunix_logits) <= 1e-5
    lint = lint_adapter(dst, a.base, target=target)  # `ckptbridge verify adapter --lint-only`
    assert lint.errors == [] and lint.modules == r.modules


@pytest.mark.parametrize("name", rows("lora"))
def test_merge_equals_adapter(adapters, tmp_path, name):
    """Both kinds merge into the base (here in several files), giving the adapter's logits."""
    a = adapters[name]
    for kind, adapter, ref in (("peft", a.peft, a.peft_logits), ("orbax", a.tunix, a.tunix_logits)):
        merged = str(tmp_path / kind)
        r = merge_lora(a.base, adapter, merged, max_shard_size="150KB", progress=False)
        assert r.merged_tensors > 0 and len(r.files) > 2, kind
        assert len([f for f in r.files if f.endswith(".safetensors")]) > 1, kind
        assert rel_l2(hf_logits(merged, TOKENS), ref) <= 1e-5, kind


@pytest.mark.parametrize("name", rows("lora"))
def test_lora_round_trips(adapters, tmp_path, name):
    """Orbax -> PEFT -> Orbax gives every LoRA leaf back bit for bit, with rules that give every
    module the same rank and alpha (qwix shares A between fused modules: nothing to stack); PEFT ->
    Orbax -> PEFT keeps every module's delta (scale * B @ A)."""
    a = adapters[name]
    base = open_base(a.base)
    (adapter, _), back = a.tunix_as_peft, str(tmp_path / "back")
    r = convert_peft_to_orbax(adapter, back, base=a.base, step=a.step, progress=False)
    assert "exact" not in r.modes
    with OrbaxCheckpoint(os.path.join(a.tunix, str(a.step), "model_params")) as x, \
            OrbaxCheckpoint(os.path.join(back, str(a.step), "model_params")) as y:
        assert x.leaves == y.leaves
        got_x, got_y = x.read(list(x.leaves)), y.read(list(y.leaves))
        for leaf in x.leaves:
            assert got_x[leaf].tobytes() == got_y[leaf].tobytes(), leaf
        rules_x = x.ckptbridge_metadata["lora"]["rules"]
        rules_y = y.ckptbridge_metadata["lora"]["rules"]
    for mod in base.modules:  # the recorded rules give every module the same rank and alpha
        assert lora_rules.scaling_from_rules(mod, rules_x, "a") == lora_rules.scaling_from_rules(mod, rules_y, "b")

    (ckpt, _), peft_back = a.peft_as_orbax, str(tmp_path / "peft-back")
    convert_orbax_to_peft(ckpt, peft_back, base=a.base, progress=False)
    with peft.open_peft_lora(a.peft, base) as x, peft.open_peft_lora(peft_back, base) as y:
        assert set(x.keys) == set(y.keys)
        for module in x.keys:
            (xa, xb), (ya, yb) = x.pair(module), y.pair(module)
            dx = x.scaling[module].scale * (xb.astype(np.float64) @ xa)
            dy = y.scaling[module].scale * (yb.astype(np.float64) @ ya)
            np.testing.assert_allclose(dy, dx, rtol=1e-6, atol=1e-7, err_msg=module)


@pytest.mark.parametrize("name", rows("train"))
def test_training_on_a_mesh_then_export(checkpoints, tmp_path, name):
    """`python -m training --preset tiny-cpu --base DIR` takes the family from the base's config and
    the LoRA targets from its spec; on 2 simulated devices (tp=2) the base is loaded sharded; the
    checkpoint converts with no flags and PEFT on transformers gives the Tunix+qwix logits."""
    import subprocess
    import sys

    import jax

    from ckptbridge.specs import get_family
    from ckptbridge.tunix_model import load_tunix_lora_model
    from training.cli import SAMPLE_DATA

    base, run = checkpoints[name], str(tmp_path / "run")
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
    spec = get_family(CASES[name].family)
    names = {n.rsplit(".", 1)[-1] for m in open_base(base).modules for n in m.hf_modules}
    assert r.modules == sum(len(m.hf_modules) for m in open_base(base).modules)
    # qwix puts no LoRA on experts (raw parameters); E2B adds the per-layer input gate and projection
    assert len(names) == CASES[name].lora_names
    model, step, recorded = load_tunix_lora_model(base, os.path.join(run, "checkpoints"))
    assert step == 3 and all(t in recorded[0]["module_path"] for t in spec.lora_targets)
    assert rel_l2(peft_logits(base, adapter, TOKENS), tunix_logits(model, TOKENS)) <= 1e-5


# ----------------------------------------------------------------- independent of the family, one row


@pytest.fixture(scope="module")
def plain_tunix_lora(checkpoints, tmp_path_factory, precise):
    """A Tunix LoRA checkpoint without any metadata (as a plain Tunix run writes it): alpha must be given."""
    base = checkpoints["kv_text_f32_sharded"]
    model, _ = build_tunix_lora(base, [{"module_path": lora_targets("gemma4"), "rank": 4, "alpha": 6.0}], seed=2)
    root = str(tmp_path_factory.mktemp("plain") / "ckpt")
    save_tunix_lora(model, root, step=5)
    return {"base": base, "root": root, "logits": tunix_logits(model, TOKENS)}


def test_alpha_flag_for_checkpoints_without_metadata(plain_tunix_lora, tmp_path):
    with pytest.raises(ConfigError, match="--alpha"):
        convert_orbax_to_peft(plain_tunix_lora["root"], str(tmp_path / "x"), base=plain_tunix_lora["base"],
                              progress=False)
    assert not os.path.exists(tmp_path / "x")
    dst = str(tmp_path / "adapter")
    convert_orbax_to_peft(plain_tunix_lora["root"], dst, base=plain_tunix_lora["base"], alpha=6, progress=False)
    assert rel_l2(peft_logits(plain_tunix_lora["base"], dst, TOKENS), plain_tunix_lora["logits"]) <= 1e-5


def test_vllm_rank_warning(plain_tunix_lora, tmp_path):
    r = convert_orbax_to_peft(plain_tunix_lora["root"], str(tmp_path / "v"), base=plain_tunix_lora["base"],
                              alpha=6, target="vllm", progress=False)
    assert not r.warnings  # rank 4 fits vLLM's default
    model, _ = build_tunix_lora(plain_tunix_lora["base"], [{"module_path": ".*q_einsum", "rank": 24, "alpha": 8.0}])
    root = save_tunix_lora(model, str(tmp_path / "r24"))
    r = convert_orbax_to_peft(root, str(tmp_path / "v24"), base=plain_tunix_lora["base"], alpha=8, target="vllm",
                              progress=False)
    assert r.warnings == ["rank 24 exceeds vLLM's default --max-lora-rank 16: serve with --max-lora-rank 32"]


def test_tunix_checkpoint_read_directly_equals_orbax_restore(adapters):
    """The LoRA tree Tunix's CheckpointManager wrote is read without Orbax (TensorStore directly),
    leaf for leaf the bytes Orbax restores."""
    import orbax.checkpoint as ocp

    a = adapters["keqv_lm_f32_sharded"]
    item = os.path.join(a.tunix, str(a.step), "model_params")
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


def test_merged_models_convert(adapters, tmp_path):
    """A merged model (of either kind of adapter, in several files) is an HF checkpoint like any
    other: it converts to Orbax with ckptbridge."""
    from ckptbridge import convert_safetensors_to_orbax

    a = adapters["keqv_lm_f32_sharded"]
    for kind, adapter in (("peft", a.peft), ("orbax", a.tunix)):
        merged = str(tmp_path / kind)
        merge_lora(a.base, adapter, merged, max_shard_size="150KB", progress=False)
        r = convert_safetensors_to_orbax(merged, str(tmp_path / f"{kind}-orbax"), progress=False)
        assert r.tensors > 0 and r.key_prefix == "model.language_model.", kind


def test_merge_keeps_bf16(checkpoints, tmp_path, precise):
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


def test_rslora_and_patterns_are_honoured(checkpoints, tmp_path, precise):
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
def test_adapter_config_rejections(adapters, tmp_path, field, value, error, needle):
    import shutil

    a = adapters["keqv_lm_f32_sharded"]
    src = str(tmp_path / "a")
    shutil.copytree(a.peft, src)
    path = os.path.join(src, "adapter_config.json")
    cfg = json.load(open(path))
    cfg[field] = value
    json.dump(cfg, open(path, "w"))
    before = tree_hash(src)
    with pytest.raises(error, match=needle):
        convert_peft_to_orbax(src, str(tmp_path / "out"), base=a.base, progress=False)
    with pytest.raises(error, match=needle):
        merge_lora(a.base, src, str(tmp_path / "m"), progress=False)
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "m")
    assert tree_hash(src) == before


def test_existing_destination_and_corrupt_adapter(adapters, tmp_path):
    import shutil

    from ckptbridge.errors import CorruptFileError

    a = adapters["keqv_lm_f32_sharded"]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputError, match="--overwrite"):
        convert_peft_to_orbax(a.peft, str(out), base=a.base, progress=False)
    src = str(tmp_path / "a")
    shutil.copytree(a.peft, src)
    weights = os.path.join(src, "adapter_model.safetensors")
    data = open(weights, "rb").read()
    open(weights, "wb").write(data[: len(data) // 2])
    with pytest.raises(CorruptFileError, match="adapter_model.safetensors"):
        convert_peft_to_orbax(src, str(tmp_path / "o2"), base=a.base, progress=False)
    assert not os.path.exists(tmp_path / "o2")


def test_cli_errors(adapters, plain_tunix_lora, tmp_path):
    from ckptbridge.io.safetensors import PlannedTensor, write_file

    base = adapters["keqv_lm_f32_sharded"].base
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
    key = "base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"
    write_file(str(foreign / "adapter_model.safetensors"), [PlannedTensor(key, t.dtype, t.shape, lambda: t)])
    proc = run_cli("merge", base, str(foreign), dst)
    assert proc.returncode == 6 and "transformer.h.0.attn.c_attn" in proc.stderr and "another model" in proc.stderr
    assert not os.path.exists(dst)

    proc = run_cli("convert", "peft-to-orbax", str(foreign), dst, "--base", base, "--kv", "best")
    assert proc.returncode == 2
