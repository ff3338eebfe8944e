"""`ckptbridge verify adapter`: each kind of adapter gets its verdict, one line per finding, exit 6
when it is wrong in its target, and figures in --json."""

import json
import os
import shutil

import numpy as np
import pytest

from ckptbridge.formats import peft
from ckptbridge.adapter_check import lint_adapter, verify_adapter
from ckptbridge.formats.peft import AdapterConfig
from ckptbridge import convert_orbax_to_peft
from ckptbridge.io.safetensors import PlannedTensor, SafetensorsFile, write_file
from ckptbridge.testing import lora_targets, build_checkpoint, build_peft_adapter, build_tunix_lora, save_tunix_lora

from conftest import run_cli, tree_hash

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(checkpoints, tmp_path_factory):
    """A k_eq_v base, a Tunix LoRA checkpoint on it and its two PEFT exports."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    base = checkpoints["keqv_lm_f32_sharded"]
    tmp = tmp_path_factory.mktemp("verify-adapter")
    model, rules = build_tunix_lora(base, [{"module_path": lora_targets(), "rank": 4, "alpha": 10.0}], seed=4)
    root = save_tunix_lora(model, str(tmp / "ckpt"), step=2, custom_metadata={
        "ckptbridge": {"kind": "lora", "family": "gemma4", "lora": {"rules": rules}}})
    plain = save_tunix_lora(model, str(tmp / "plain"), step=2)  # no metadata: alpha unknown
    adapters = {t: str(tmp / f"adapter-{t}") for t in ("hf", "vllm")}
    for target, path in adapters.items():
        convert_orbax_to_peft(root, path, base=base, target=target, progress=False)
    return {"base": base, "root": root, "plain": plain, "tmp": tmp, **adapters}


def rewrite(src: str, dst: str, *, tensor=None, rename=None, config=None) -> str:
    """A copy of the PEFT adapter ``src`` with tensors changed (``tensor(key, array) -> array``),
    keys renamed (``rename(key) -> key``) and config fields replaced."""
    shutil.copytree(src, dst)
    weights = os.path.join(dst, peft.ADAPTER_WEIGHTS)
    with SafetensorsFile(os.path.join(src, peft.ADAPTER_WEIGHTS)) as f:
        arrays = {(rename or (lambda k: k))(k): (tensor or (lambda k, a: a))(k, f.array(k)) for k in f.keys()}
    write_file(weights, [PlannedTensor(k, a.dtype, a.shape, lambda a=a: a) for k, a in arrays.items()])
    if config:
        path = os.path.join(dst, peft.ADAPTER_CONFIG)
        cfg = json.load(open(path))
        cfg.update(config)
        json.dump(cfg, open(path, "w"))
    return dst


def verify(adapter, base, **kw):
    """verify_adapter in this process: (the CLI's exit code, its --json result)."""
    r = json.loads(json.dumps(verify_adapter(adapter, base, **kw).to_json()))
    return (0 if r["ok"] else 6), r


def verify_cli(*args):
    proc = run_cli("verify", "adapter", *args, "--json", timeout=600)
    return proc.returncode, json.loads(proc.stdout)


def errors(r):
    return [f for f in r["lint"]["findings"] if f["severity"] == "error"]


def test_good_adapter_passes_both_ways(setup):
    before = tree_hash(setup["hf"])
    code, r = verify_cli(setup["hf"], "--base", setup["base"])
    assert code == 0 and r["ok"], r
    assert not errors(r) and r["lint"]["modules"] == 5 * 7 + 6 and r["lint"]["max_rank"] == 4
    assert r["live"]["ok"] and r["live"]["rel_change"] > 1e-3 and r["live"]["applied_modules"] == 41
    assert r["exact"]["ok"] and r["exact"]["rel_l2"] <= 1e-5 and r["exact"]["via"] == "peft-to-orbax"
    assert tree_hash(setup["hf"]) == before  # the adapter is only read
    # the Tunix checkpoint itself, for vLLM: the export command is the one finding
    code, r = verify(setup["root"], setup["base"], target="vllm", ids=[5, 9, 33, 7, 120, 64, 3, 250])
    assert code == 0 and r["ok"] and r["tokens"] == 8, r
    assert [f["check"] for f in r["lint"]["findings"]] == ["export"]
    assert "--target vllm" in r["lint"]["findings"][0]["message"]
    assert r["exact"]["via"] == "orbax-to-peft" and r["exact"]["rel_l2"] <= 1e-5
    # the vLLM export is right for vLLM, and still the same model for transformers
    code, r = verify(setup["vllm"], setup["base"], target="vllm", exact=False)
    assert code == 0 and r["ok"] and r["lint"]["modules"] == 42 and r["exact"]["skipped"] == "--no-exact"
    code, r = verify(setup["vllm"], setup["base"], prompt="module TopModule(input clk);")
    assert code == 0 and r["exact"]["rel_l2"] <= 1e-5 and r["tokens"] > 3
    assert [f["check"] for f in r["lint"]["findings"]] == ["vllm-alias"]  # info: the v_proj copies are unused


def test_text_output_is_one_line_per_finding(setup):
    proc = run_cli("verify", "adapter", setup["hf"], "--base", setup["base"], "--target", "vllm", "--lint-only")
    assert proc.returncode == 6
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith(f"verify adapter {setup['hf']} (peft, target vllm)")
    assert lines[1].startswith("  lint: error: [vllm-alias]") and lines[-1] == "-> FAIL"
    # the fix names the checkpoint the adapter was exported from
    assert f"ckptbridge convert orbax-to-peft {setup['root']}" in lines[1] and "--target vllm" in lines[1]


def test_zero_b_adapter_is_not_live(setup):
    zero = rewrite(setup["hf"], str(setup["tmp"] / "zero-b"),
                   tensor=lambda k, a: np.zeros_like(a) if ".lora_B." in k else a)
    code, r = verify(zero, setup["base"])
    assert code == 6 and not r["ok"]
    assert [f["check"] for f in errors(r)] == ["live"] and "all-zero" in errors(r)[0]["message"]
    assert r["live"]["ok"] is False and r["live"]["rel_change"] == 0.0
    assert r["exact"]["ok"]  # zero in both frameworks


def test_targets_matching_nothing(setup):
    # an adapter of another architecture: fused qkv_proj modules that this base does not have
    other = rewrite(setup["hf"], str(setup["tmp"] / "qkv"), rename=lambda k: k.replace("self_attn.q_proj", "self_attn.qkv_proj"),
                    config={"target_modules": ["qkv_proj", "o_proj_x"]})
    code, r = verify(other, setup["base"])
    assert code == 6 and not r["ok"] and r["live"]["ok"] is False
    assert "NoMatchingPeftModuleError" in r["live"]["error"]
    msgs = [f["message"] for f in errors(r)]
    assert any("are not modules of BASE" in m and "qkv_proj" in m for m in msgs)
    assert any("match no module of BASE" in m for m in msgs)
    # target_modules that select modules, but not the ones the tensors are for: PEFT loads nothing of them
    unselected = rewrite(setup["hf"], str(setup["tmp"] / "unselected"), config={"target_modules": ["gate_proj"]})
    code, r = verify(unselected, setup["base"], exact=False)
    assert code == 6 and r["live"]["applied_modules"] == 6
    assert any("does not select" in f["message"] for f in errors(r))
    # the other key prefix of the family: PEFT wraps the modules but loads none of the tensors
    moved = rewrite(setup["hf"], str(setup["tmp"] / "prefix"), rename=lambda k: k.replace("model.language_model.", "model."),
                    config={"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]})
    code, r = verify(moved, setup["base"], exact=False)
    assert code == 6 and r["live"]["rel_change"] == 0.0 and r["live"]["applied_modules"] == 0
    assert [f["check"] for f in errors(r)] == ["targets"] and "key prefix model." in errors(r)[0]["message"]


def test_adapter_for_another_base(setup, tmp_path):
    other_base = build_checkpoint(str(tmp_path / "other"), prefix="model.language_model.", hidden_size=48, seed=9)
    other = build_peft_adapter(other_base, str(tmp_path / "adapter"), r=4, seed=2)
    before = tree_hash(other)
    code, r = verify(other, setup["base"], lint_only=True)
    assert code == 6 and r["live"] is None
    checks = {f["check"]: f["message"] for f in errors(r)}
    assert "hidden 48" in checks["base"] and "hidden 40" in checks["base"]
    assert "made for another base" in checks["shapes"]
    code, r = verify(other, setup["base"], exact=False)
    assert code == 6 and r["live"]["ok"] is False and "size mismatch" in r["live"]["error"]
    assert tree_hash(other) == before


def test_orbax_checkpoint_without_alpha(setup):
    code, r = verify(setup["plain"], setup["base"])
    assert code == 6 and [f["check"] for f in errors(r)] == ["alpha"] and "--alpha" in errors(r)[0]["message"]
    assert r["live"]["ok"] is False and "skipped" in r["live"]
    code, r = verify(setup["plain"], setup["base"], alpha=10, exact=False)
    assert code == 0 and r["live"]["ok"]


def test_vllm_lint_findings(setup, tmp_path):
    cfg = {"use_dora": True, "modules_to_save": ["lm_head"], "bias": "all"}
    odd = rewrite(setup["vllm"], str(tmp_path / "odd"), config=cfg)
    lint = lint_adapter(odd, setup["base"], target="vllm")
    assert {f.check for f in lint.errors} == {"dora", "modules_to_save", "bias"}
    assert not lint_adapter(odd, setup["base"], target="hf").errors  # transformers+PEFT apply them
    big = build_peft_adapter(setup["base"], str(tmp_path / "r64"), r=64, target_modules=r".*\.(q_proj|o_proj)")
    lint = lint_adapter(big, setup["base"], target="vllm")
    assert not lint.errors and lint.max_lora_rank == 64
    assert any(f.check == "rank" and "--max-lora-rank 64" in f.message for f in lint.findings)


def test_peft_selects_as_peft_does():
    from types import SimpleNamespace

    from peft.tuners.tuners_utils import check_target_module_exists

    names = [f"model.language_model.layers.{i}.{m}" for i in (0, 3, 11) for m in
             ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj", "self_attn.q_norm")] + ["lm_head",
                                                                                               "model.embed_tokens"]
    configs = [
        {"target_modules": ["q_proj", "down_proj"]},
        {"target_modules": r".*language_model.*\.(q_proj|k_proj)"},
        {"target_modules": ["self_attn.q_proj"], "layers_to_transform": [0, 11]},
        {"target_modules": ["q_proj"], "layers_to_transform": 3, "layers_pattern": "layers"},
        {"target_modules": ["q_proj", "k_proj"], "exclude_modules": ["k_proj"]},
        {"target_modules": r".*proj", "exclude_modules": r".*layers\.3\..*"},
        {"target_modules": ["lm_head", "q_proj"], "modules_to_save": ["lm_head"]},
        {"target_modules": ["qkv_proj"]},
    ]
    for cfg in configs:
        full = SimpleNamespace(**{"exclude_modules": None, "modules_to_save": None, "target_parameters": None,
                                  "layers_to_transform": None, "layers_pattern": None, **cfg})
        for name in names:
            assert AdapterConfig.from_json(cfg, "test").selects(name) == bool(check_target_module_exists(full, name)), (cfg, name)
