"""MaxText LoRA checkpoints: PEFT -> MaxText (`convert peft-to-maxtext`), MaxText -> PEFT
(`convert orbax-to-peft`), and `merge` with a MaxText LoRA checkpoint.

What MaxText holds: qwix's dot_general factors beside each kernel (checked here against qwix
itself: its LoRA forward with our factors equals the kernel with the delta merged), written the way
MaxText's to_maxtext converts a PEFT adapter (its formula, copied below). Then round trips and
merges: bitwise where no value transform applies, one rounding of B for a scaled query."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from ckptbridge import layout, mapping
from ckptbridge.formats.maxtext import layout as maxtext_layout
from ckptbridge import convert_orbax_to_peft, convert_peft_to_maxtext
from ckptbridge.cli import main
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io.hf import HFModelDir
from ckptbridge.io.safetensors import SafetensorsFile
from ckptbridge.lora.base import open_base
from ckptbridge.formats.maxtext.lora import factor_leaves
from ckptbridge.formats.maxtext.model import ITEM, ROOT
from ckptbridge import merge_lora
from ckptbridge.testing import write_random_adapter, write_random_checkpoint

FAMILIES = {"qwen3": {}, "llama3": {}, "gemma4": {}, "gemma3": dict(model_type="gemma3_text"), "gemma2": {}}
SCALED_Q = {"llama3", "gemma2"}  # MaxText folds 1/sqrt(head_dim) into the query kernel, and so into B


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("mt-lora")
    made = {}

    def get(family: str, dtype: str = "bfloat16") -> tuple[str, str]:
        if (family, dtype) not in made:
            base = write_random_checkpoint(str(root / f"{family}-{dtype}"), family=family, dtype=dtype,
                                           **FAMILIES[family])
            made[family, dtype] = base, write_random_adapter(base, str(root / f"{family}-{dtype}-peft"), r=4,
                                                             lora_alpha=8, seed=5, dtype=dtype)
        return made[family, dtype]

    return get


def _peft(path: str) -> dict[str, np.ndarray]:
    f = SafetensorsFile(os.path.join(path, "adapter_model.safetensors"))
    return {k: f.array(k) for k in f.keys()}


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_qwix_computes_with_the_factors_what_the_merged_kernel_computes(bases, family):
    """A MaxText DenseGeneral (kernel [in..., out...], dot_general over the input's last axes) wrapped
    by qwix's LoraProvider: with our factors of a PEFT pair it computes x (K + scale * delta), delta
    the PEFT delta B A in MaxText's layout with the kernel's value transforms (Llama's RoPE order and
    query scale)."""
    jax = pytest.importorskip("jax")
    qwix = pytest.importorskip("qwix")
    from flax import nnx

    jnp = jax.numpy
    base, _ = bases(family, "float32")
    b = open_base(base)
    leaves = maxtext_layout.plan(mapping.entries(b.cfg, b.spec, b.prefix), b.spec.maxtext, False, b.cfg.flags)
    facs = {f.leaf.entries[0].rule.name: f for f in factor_leaves(b, leaves) if f.leaf.path[1] == "layers_0"}
    rng = np.random.default_rng(0)
    rank, alpha = 4, 8.0
    for rule in ("q", "o", "down"):
        f = facs[rule]
        e = f.leaf.entries[0]
        in_axes = layout.parse(e.rule.hf_layout)[1]
        n_in = sum(all(a in in_axes for a in g) for g in layout.parse(f.leaf.part.layout))
        sizes = f.sizes(0, rank)
        a_peft = rng.standard_normal(layout.shape(f.a_peft, sizes)).astype(np.float32)
        b_peft = rng.standard_normal(layout.shape(f.b_peft, sizes)).astype(np.float32)
        a_mt, b_mt = f.to_maxtext(0, a_peft, b_peft)
        kernel = rng.standard_normal(f.leaf.shape).astype(np.float32)

        class Dense(nnx.Module):
            def __init__(self):
                self.kernel = nnx.Param(jnp.asarray(kernel))

            def __call__(self, x):
                dims = ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))
                return jax.lax.dot_general(x, self.kernel[...], dims, precision="highest")

        x = rng.standard_normal((3, *f.leaf.shape[:n_in])).astype(np.float32)
        model = qwix.apply_lora_to_model(Dense(), qwix.LoraProvider([qwix.LoraRule(module_path=".*", rank=rank, alpha=alpha)]),
                                         jnp.asarray(x), rngs=nnx.Rngs(0))
        assert (model.kernel_lora_a[...].shape, model.kernel_lora_b[...].shape) == (a_mt.shape, b_mt.shape)
        model.kernel_lora_a[...] = jnp.asarray(a_mt)
        model.kernel_lora_b[...] = jnp.asarray(b_mt)
        with jax.default_matmul_precision("highest"):
            got = np.asarray(model(jnp.asarray(x)))
        delta_hf = (b_peft @ a_peft).reshape(layout.shape(e.rule.hf_layout, e.sizes))
        delta = layout.rearrange(delta_hf, e.rule.hf_layout, f.leaf.part.layout, e.sizes)
        delta = maxtext_layout.apply(delta, f.leaf.part.layout, e.sizes, list(f.transforms), True)
        merged = kernel + alpha / rank * delta
        want = np.tensordot(x, merged, axes=n_in)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"{family} {rule}")


def _to_maxtext_formula(w: np.ndarray, hf_module: str, kind: str, cfg: dict, llama31: bool) -> np.ndarray:
    """One layer's factor as MaxText's to_maxtext makes it from a PEFT adapter (e591f30,
    convert_lora_to_maxtext_adapter and _process_and_stack_weights): float32 from torch, transposed;
    for Llama 3.1 B of the query scaled by 1/sqrt(head_dim), B of query and key in interleaved RoPE
    order. The caller stacks layers on axis 1 and casts to bfloat16, as it does."""
    w = w.astype(np.float32).T
    if llama31 and kind == "b" and hf_module.endswith(("q_proj", "k_proj")):
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        if hf_module.endswith("q_proj"):
            w = w * (1.0 / np.sqrt(head_dim))
        heads = cfg["num_attention_heads"] if hf_module.endswith("q_proj") else cfg["num_key_value_heads"]
        work = w.reshape(w.shape[0], heads, head_dim)
        half = head_dim // 2
        w = np.stack([work[..., :half], work[..., half:]], axis=-1).reshape(work.shape).reshape(w.shape)
    return w


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_peft_to_maxtext_writes_what_maxtexts_to_maxtext_writes(bases, family, scan, tmp_path):
    import ml_dtypes

    base, peft = bases(family)
    report = convert_peft_to_maxtext(peft, str(tmp_path / "mt"), base=base, scan_layers=scan, progress=False)
    b = open_base(base)
    leaves = maxtext_layout.plan(mapping.entries(b.cfg, b.spec, b.prefix), b.spec.maxtext, scan, b.cfg.flags)
    factors = factor_leaves(b, leaves)
    tensors = _peft(peft)
    with orbax_io.OrbaxCheckpoint(str(tmp_path / "mt" / "0" / ITEM)) as ckpt:
        assert ckpt.custom_metadata["lora"] == {"enable_lora": True, "lora_rank": 4, "lora_alpha": 8}
        assert ckpt.custom_metadata["scan_layers"] is scan
        paths = {p for p in ckpt.leaves if p[:2] == ROOT}
        want_paths = {ROOT + p + ("value",) for f in factors for p in f.paths}
        assert paths == want_paths and report.modules == len(b.by_hf_module())
        got = ckpt.read(paths)
    scaled = []
    for f in factors:
        for kind, path in zip("ab", f.paths):
            layers = [_to_maxtext_formula(tensors[f"base_model.model.{mod.hf_modules[i]}.lora_{kind.upper()}.weight"],
                                          mod.hf_modules[i], kind, b.cfg.hf_config, family == "llama3")
                      for mod, i in f.targets]
            want = (np.stack(layers, axis=1) if scan else layers[0]).astype(ml_dtypes.bfloat16)
            have = got[ROOT + path + ("value",)]
            assert have.shape == want.shape and have.dtype == want.dtype, path
            if have.tobytes() != want.tobytes():  # the scaled query B: rounded once from float32 here, float64 there
                steps = np.abs(have.view(np.int16).astype(np.int32) - want.view(np.int16).astype(np.int32))
                assert path[-2] == "query" and kind == "b" and steps.max() <= 1, path
                scaled.append(int((steps > 0).sum()))
    print(f"{family} {'scanned' if scan else 'unscanned'}: query B elements one bf16 step from MaxText's: {scaled}")


@pytest.mark.parametrize("scan", [False, True], ids=["unscanned", "scanned"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_peft_maxtext_peft_and_merges_agree(bases, family, scan, tmp_path):
    """PEFT -> MaxText LoRA -> PEFT gives the adapter back bitwise (B of a scaled query within one
    bf16 step), and merging the MaxText checkpoint gives the model merging the PEFT adapter gives."""
    base, peft = bases(family)
    mt, back = str(tmp_path / "mt"), str(tmp_path / "back")
    assert main(["convert", "peft-to-maxtext", peft, mt, "--base", base, *(["--scan-layers"] if scan else []),
                 "--quiet"]) == 0
    assert main(["convert", "orbax-to-peft", mt, back, "--base", base, "--quiet"]) == 0
    a, b = _peft(peft), _peft(back)
    assert sorted(a) == sorted(b)
    with open(os.path.join(back, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    rounded = {k for k in a if a[k].tobytes() != b[k].tobytes()}
    for k in rounded:
        steps = np.abs(a[k].view(np.int16).astype(np.int32) - b[k].view(np.int16).astype(np.int32))
        assert k.endswith("q_proj.lora_B.weight") and family in SCALED_Q and steps.max() <= 1, k
    assert bool(rounded) == (family in SCALED_Q)
    merge_lora(base, peft, str(tmp_path / "m1"), progress=False)
    assert main(["merge", base, mt, str(tmp_path / "m2"), "--quiet"]) == 0
    with HFModelDir(str(tmp_path / "m1")) as m1, HFModelDir(str(tmp_path / "m2")) as m2:
        assert sorted(m1.keys()) == sorted(m2.keys())
        differ = {k for k in m1.keys() if m1.array(k).tobytes() != m2.array(k).tobytes()}
    assert all(k.endswith("q_proj.weight") for k in differ) and bool(differ) == (family in SCALED_Q), differ


def test_an_nnx_lora_tree_reads_as_the_linen_one_and_inspect_says_lora(bases, tmp_path, capsys):
    """MaxText's NNX trainers save LoRA under model_params with NNX layer lists (``layers/0``) and a
    ``value`` level: read as the Linen tree is. ``inspect`` names a MaxText LoRA checkpoint."""
    base, peft = bases("qwen3")
    mt = str(tmp_path / "mt")
    convert_peft_to_maxtext(peft, mt, base=base, progress=False)
    with orbax_io.OrbaxCheckpoint(os.path.join(mt, "0", ITEM)) as ckpt:
        got = ckpt.read([p for p in ckpt.leaves if p[:2] == ROOT])
        custom = ckpt.custom_metadata
    nnx = {}
    for p, v in got.items():
        names = [q for n in p[2:] for q in (n.split("_", 1) if n.startswith("layers_") else [n])]
        nnx[tuple(names)] = v
    assert any(p[:3] == ("decoder", "layers", "0") for p in nnx)
    orbax_io.save_manager_step(str(tmp_path / "nnx"), 7, orbax_io.nest(nnx),
                               {"lora": custom["lora"], "scan_layers": False}, item="model_params")
    assert main(["convert", "orbax-to-peft", str(tmp_path / "nnx"), str(tmp_path / "back"), "--base", base,
                 "--quiet"]) == 0
    a, b = _peft(peft), _peft(str(tmp_path / "back"))
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "nnx"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["maxtext"] == {"tree": "nnx (model_params)", "scan_layers": False, "lora": True}, out


def test_lora_errors_are_one_line_and_write_nothing(bases, tmp_path, capsys):
    base, peft = bases("qwen3")
    other, _ = bases("llama3")
    mt = str(tmp_path / "mt")
    assert main(["convert", "peft-to-maxtext", peft, mt, "--base", base, "--scan-layers", "--quiet"]) == 0
    no_alpha = str(tmp_path / "no-alpha")
    with orbax_io.OrbaxCheckpoint(os.path.join(mt, "0", ITEM)) as ckpt:
        tree = orbax_io.nest(ckpt.read(list(ckpt.leaves)))
    orbax_io.save_manager_step(no_alpha, 0, tree, {"scan_layers": True}, item=ITEM)
    cases = [
        (["convert", "orbax-to-peft", mt, "X", "--base", other], None, "LoRA of family 'qwen3'"),
        (["convert", "orbax-to-peft", no_alpha, "X", "--base", other], None, "do not fit the base"),
        (["convert", "orbax-to-peft", no_alpha, "X", "--base", base], None, "pass alpha (--alpha)"),
        (["merge", base, no_alpha, "X"], None, "pass alpha (--alpha)"),
        (["convert", "maxtext-to-safetensors", mt, "X", "--config", base], None, "ckptbridge merge"),
        (["convert", "peft-to-maxtext", peft, "X", "--base", other], None, "llama"),
    ]
    for argv, code, text in cases:
        capsys.readouterr()
        rc = main([str(tmp_path / "out") if a == "X" else a for a in argv])
        err = capsys.readouterr().err.strip()
        assert rc != 0 and (code is None or rc == code), (argv, rc, err)
        assert len(err.splitlines()) == 1 and text in err, (argv, err)
        assert not os.path.exists(tmp_path / "out"), argv
    assert main(["convert", "orbax-to-peft", no_alpha, str(tmp_path / "out"), "--base", base, "--alpha", "8",
                 "--quiet"]) == 0


def test_factors_stacked_in_front_read_as_those_stacked_like_the_kernel(bases, tmp_path):
    """Scanned factors with the layers on axis 0 (``[layers, in, r]``, a form MaxText's
    to_huggingface also reads) give the adapter those stacked on axis 1 give."""
    base, peft = bases("llama3")
    mt, front = str(tmp_path / "mt"), str(tmp_path / "front")
    convert_peft_to_maxtext(peft, mt, base=base, scan_layers=True, progress=False)
    with orbax_io.OrbaxCheckpoint(os.path.join(mt, "0", ITEM)) as ckpt:
        got = ckpt.read(list(ckpt.leaves))
        custom = ckpt.custom_metadata
    moved = {p: np.ascontiguousarray(np.moveaxis(v, 1, 0)) if v.ndim == 3 else v for p, v in got.items()}
    assert sum(v.ndim == 3 for v in moved.values()) == 14
    orbax_io.save_manager_step(front, 0, orbax_io.nest(moved), custom, item=ITEM)
    convert_orbax_to_peft(mt, str(tmp_path / "a"), base=base, progress=False)
    convert_orbax_to_peft(front, str(tmp_path / "b"), base=base, progress=False)
    a, b = _peft(str(tmp_path / "a")), _peft(str(tmp_path / "b"))
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)
