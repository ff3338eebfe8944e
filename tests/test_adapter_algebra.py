"""Adapter algebra (``ckptbridge adapter combine|resize|extract``) against its oracles: PEFT's own
``add_weighted_adapter`` on the same adapters (a tiny Qwen 3 and a Gemma 4 with k_eq_v global
layers), Eckart-Young for resize and extract, and the merged model for extract; the same results
from Tunix, MaxText and mixed inputs; every output read back by PEFT and Tunix
(``verify adapter``); bad inputs refused in one line with nothing written."""

import functools
import json
import os

import numpy as np
import pytest

from conftest import run_cli

ROWS = {"qwen3": "qwen3_untied", "gemma4": "keqv_lm_f32_sharded"}
WEIGHTS = [0.7, -0.4, 1.3]
# method -> (adapters used, options); linear-type methods need equal ranks (the first two adapters)
EXACT = {"cat": (3, {}), "linear": (2, {}), "ties": (2, {"density": 0.5}),
         "magnitude_prune": (2, {"density": 0.6})}
BY_DELTA = {"svd": (3, {}), "ties_svd": (3, {"density": 0.5}), "magnitude_prune_svd": (3, {"density": 0.4}),
            "dare_linear_svd": (3, {"density": 1.0}), "dare_ties_svd": (2, {"density": 1.0})}


@functools.lru_cache(maxsize=None)
def _adapters(base: str, root: str) -> tuple[str, ...]:
    """Three PEFT-made adapters of ``base``: ranks 4, 4, 6; alphas 8, 12 (rsLoRA-free), 6."""
    from ckptbridge.testing import build_peft_adapter

    return tuple(build_peft_adapter(base, os.path.join(root, f"p{i}"), r=r, lora_alpha=alpha, seed=10 + i)
                 for i, (r, alpha) in enumerate([(4, 8), (4, 12), (6, 6)]))


@pytest.fixture(scope="module")
def inputs(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("algebra")

    def get(family):
        base = checkpoints[ROWS[family]]
        return base, _adapters(base, str(root / family))

    return get


def _pairs(directory: str) -> dict:
    from safetensors.numpy import load_file

    out: dict = {}
    for key, value in load_file(os.path.join(directory, "adapter_model.safetensors")).items():
        module, which = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        out.setdefault(module, [None, None])[0 if which.startswith("A") else 1] = value.astype(np.float32)
    return out


def _config(directory: str) -> dict:
    with open(os.path.join(directory, "adapter_config.json")) as f:
        return json.load(f)


def _scale(cfg: dict, module: str, rank: int) -> float:
    import re

    alpha = next((v for k, v in cfg["alpha_pattern"].items() if re.search(k, module)), cfg["lora_alpha"])
    return alpha / rank


def _peft_combinations(base: str, adapters, runs: dict) -> dict:
    """PEFT's add_weighted_adapter for every ``runs`` name -> (method, n adapters, options): the
    combined factors per module (module -> (A, B))."""
    import torch
    from peft import PeftModel

    from ckptbridge.verify import hf_model_class

    model = hf_model_class(base).from_pretrained(base, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:], 1):
        peft_model.load_adapter(path, adapter_name=f"a{i}")
    out = {}
    for name, (method, n, opts) in runs.items():
        peft_model.add_weighted_adapter([f"a{i}" for i in range(n)], WEIGHTS[:n], name, combination_type=method,
                                        **opts)
        out[name] = {mod.removeprefix("base_model.model."): (m.lora_A[name].weight.detach().numpy(),
                                                              m.lora_B[name].weight.detach().numpy())
                     for mod, m in peft_model.named_modules() if hasattr(m, "lora_A") and name in m.lora_A}
    return out


@pytest.mark.parametrize("family", sorted(ROWS))
def test_combine_equals_peft(inputs, tmp_path, family):
    from ckptbridge.adapter import combine

    base, adapters = inputs(family)
    runs = {m: (m, n, o) for m, (n, o) in {**EXACT, **BY_DELTA}.items()}
    reference = _peft_combinations(base, adapters, runs)
    for method, (n, opts) in {**EXACT, **BY_DELTA}.items():
        dst = str(tmp_path / method)
        report = combine(adapters[:n], dst, method=method, weights=WEIGHTS[:n], base=base, progress=False, **opts)
        ours, ref = _pairs(dst), reference[method]
        assert set(ours) == set(ref) and report.modules == len(ref)
        cfg = _config(dst)
        assert cfg["lora_alpha"] == cfg["r"] and not cfg["alpha_pattern"], method  # scale 1, as PEFT's
        for module, (a, b) in ref.items():
            got_a, got_b = ours[module]
            if method in EXACT:  # the factors themselves, within float32 rounding
                np.testing.assert_allclose(got_a, a, rtol=1e-6, atol=1e-7 * np.abs(a).max(), err_msg=method)
                np.testing.assert_allclose(got_b, b, rtol=1e-6, atol=1e-7 * np.abs(b).max(), err_msg=method)
            else:  # the delta (PEFT defines the factors up to the SVD's signs)
                delta = b @ a
                rel = np.linalg.norm(got_b @ got_a - delta) / np.linalg.norm(delta)
                assert rel < 1e-5, (method, module, rel)


def test_dare_keeps_a_fraction_and_rescales(inputs, tmp_path):
    """dare uses its own seeded stream, so it is checked for its definition: each entry of the
    combined A is the weighted sum of the inputs' entries kept, divided by the density, and each
    input keeps about ``density`` of its entries."""
    from ckptbridge.adapter import combine

    base, adapters = inputs("qwen3")
    density = 0.3
    combine(adapters[:2], str(tmp_path / "d"), method="dare_linear", weights=WEIGHTS[:2], density=density, seed=7,
            base=base, progress=False)
    again = combine(adapters[:2], str(tmp_path / "d2"), method="dare_linear", weights=WEIGHTS[:2], density=density,
                    seed=7, base=base, progress=False)
    ours, same = _pairs(str(tmp_path / "d")), _pairs(str(tmp_path / "d2"))
    inputs_ = [_pairs(a) for a in adapters[:2]]
    cfgs = [_config(a) for a in adapters[:2]]
    kept, total = np.zeros(2), 0
    for module, (a, _) in ours.items():
        np.testing.assert_array_equal(a, same[module][0])  # the seed fixes the result
        ws = [w * _scale(c, module, p[module][0].shape[0]) for w, c, p in zip(WEIGHTS, cfgs, inputs_)]
        terms = [np.sign(w) * np.sqrt(abs(w)) * p[module][0] / density for w, p in zip(ws, inputs_)]
        # which inputs were kept at each entry: the subset whose sum the entry is
        subsets = [(k0, k1) for k0 in (0, 1) for k1 in (0, 1)]
        sums = np.stack([k0 * terms[0] + k1 * terms[1] for k0, k1 in subsets])
        best = np.abs(sums - a[None]).argmin(axis=0)
        np.testing.assert_allclose(np.take_along_axis(sums, best[None], 0)[0], a, rtol=1e-5,
                                   atol=1e-6 * np.abs(a).max())
        kept += [np.isin(best, [2, 3]).sum(), np.isin(best, [1, 3]).sum()]
        total += a.size
    assert again.method == "dare_linear" and again.modules == len(ours)
    sigma = np.sqrt(density * (1 - density) / total)
    assert np.all(np.abs(kept / total - density) < 5 * sigma), (kept / total, density)


@pytest.mark.pinned_only  # the Orbax readers and writers are in the floors' format matrix
def test_orbax_and_mixed_inputs_give_the_same_combination(inputs, tmp_path):
    """The same adapters as Tunix LoRA checkpoints (k and v sharing one A in ``kv_einsum``) and
    as MaxText LoRA combine to the same adapter as their PEFT exports; the outputs in the Orbax
    formats load in Tunix with the logits PEFT gives (``verify adapter``)."""
    from ckptbridge import convert
    from ckptbridge.adapter import combine
    from ckptbridge.adapter_check import verify_adapter

    base, peft_made = inputs("gemma4")
    tunix = [str(tmp_path / f"t{i}") for i in range(3)]
    back = [str(tmp_path / f"b{i}") for i in range(3)]
    for p, t, b in zip(peft_made, tunix, back):
        convert(p, t, to="tunix-lora", base=base, progress=False)
        convert(t, b, to="peft", base=base, progress=False)
    maxtext = str(tmp_path / "m2")
    convert(tunix[2], maxtext, to="maxtext-lora", base=base, progress=False)
    for method, opts in (("cat", {}), ("linear", {}), ("ties_svd", {"density": 0.5})):
        n = 2 if method == "linear" else 3
        combine(tunix[:n], str(tmp_path / f"ct-{method}"), method=method, weights=WEIGHTS[:n], base=base, to="peft",
                progress=False, **opts)
        combine(back[:n], str(tmp_path / f"cb-{method}"), method=method, weights=WEIGHTS[:n], base=base,
                progress=False, **opts)
        x, y = _pairs(str(tmp_path / f"ct-{method}")), _pairs(str(tmp_path / f"cb-{method}"))
        assert set(x) == set(y)
        for module in x:
            np.testing.assert_array_equal(x[module][0], y[module][0], err_msg=(method, module))
            np.testing.assert_array_equal(x[module][1], y[module][1], err_msg=(method, module))
    # mixed formats: a Tunix LoRA, a PEFT adapter and a MaxText LoRA, written as a Tunix LoRA
    mixed = str(tmp_path / "mixed")
    report = combine([tunix[0], back[1], maxtext], mixed, method="cat", weights=WEIGHTS, base=base, progress=False)
    assert report.format == "tunix-lora"
    as_peft = str(tmp_path / "mixed-peft")
    convert(mixed, as_peft, to="peft", base=base, progress=False)
    x, y = _pairs(as_peft), _pairs(str(tmp_path / "cb-cat"))
    for module, (a, b) in y.items():
        np.testing.assert_allclose(x[module][1] @ x[module][0], b @ a, rtol=1e-5, atol=1e-6 * np.abs(b @ a).max())
    for out in (mixed, str(tmp_path / "ct-cat")):
        checked = verify_adapter(out, base)
        assert checked.ok, checked.to_json()


def test_resize_is_eckart_young(inputs, tmp_path):
    from ckptbridge import convert
    from ckptbridge.adapter import resize
    from ckptbridge.adapter_check import verify_adapter

    base, adapters = inputs("gemma4")
    src = adapters[2]  # rank 6
    pairs, cfg = _pairs(src), _config(src)
    same = resize(src, str(tmp_path / "same"), rank=6, base=base, progress=False)
    assert same.max_error < 1e-6
    for module, (a, b) in _pairs(str(tmp_path / "same")).items():
        delta = pairs[module][1] @ pairs[module][0]
        np.testing.assert_allclose(b @ a, delta, rtol=1e-5, atol=1e-6 * np.abs(delta).max())
    small = resize(src, str(tmp_path / "r2"), rank=2, base=base, progress=False)
    out, out_cfg = _pairs(str(tmp_path / "r2")), _config(str(tmp_path / "r2"))
    assert out_cfg["lora_alpha"] == cfg["lora_alpha"] and out_cfg["r"] == 2  # each module keeps its alpha
    for module, (a, b) in pairs.items():
        delta = _scale(cfg, module, a.shape[0]) * (b @ a)
        s = np.linalg.svd(delta.astype(np.float64), compute_uv=False)
        bound = np.sqrt(np.sum(s[2:] ** 2)) / np.linalg.norm(s)
        got = _scale(out_cfg, module, 2) * (out[module][1] @ out[module][0])
        actual = np.linalg.norm(delta - got) / np.linalg.norm(delta)
        assert abs(small.relative_errors[module] - bound) <= 1e-5 * bound, module
        assert abs(actual - bound) <= 1e-5 * bound, module
    # --energy: the smallest rank keeping the fraction, per module, into a Tunix LoRA that Tunix loads
    tunix = str(tmp_path / "t")
    convert(src, tunix, to="tunix-lora", base=base, progress=False)
    kept = resize(tunix, str(tmp_path / "e"), energy=0.9, progress=False)
    assert kept.format == "tunix-lora" and 1 <= min(kept.ranks.values()) < max(kept.ranks.values()) <= 12
    assert max(kept.relative_errors.values()) <= np.sqrt(0.1) + 1e-6
    assert verify_adapter(str(tmp_path / "e"), base).ok
    # and into a MaxText LoRA, read back as a PEFT adapter
    resize(tunix, str(tmp_path / "m"), rank=3, to="maxtext-lora", progress=False)
    convert(str(tmp_path / "m"), str(tmp_path / "m-peft"), to="peft", base=base, progress=False)
    assert verify_adapter(str(tmp_path / "m-peft"), base).ok


def test_extract_recovers_the_adapter(inputs, tmp_path):
    from ckptbridge import merge_lora
    from ckptbridge.adapter import extract
    from ckptbridge.adapter_check import verify_adapter

    base, adapters = inputs("gemma4")
    src = adapters[0]  # rank 4, alpha 8
    pairs, cfg = _pairs(src), _config(src)
    merged = str(tmp_path / "merged")
    merge_lora(base, src, merged, progress=False)  # float32, like the base
    for randomized in (False, True):
        dst = str(tmp_path / f"x{randomized}")
        report = extract(merged, dst, base=base, rank=6, randomized=randomized, progress=False)
        got = _pairs(dst)
        assert set(got) == set(pairs) and report.max_error < 1e-5 and not report.left_out
        for module, (a, b) in pairs.items():
            delta = _scale(cfg, module, a.shape[0]) * (b @ a)
            rel = np.linalg.norm(got[module][1] @ got[module][0] - delta) / np.linalg.norm(delta)
            assert rel < 1e-5, (randomized, module, rel)
    # the same model as a Tunix checkpoint and as a GGUF F32 file (with its HF config) gives the same factors
    from ckptbridge import convert

    exact = _pairs(str(tmp_path / "xFalse"))
    for fmt, name, opts in (("tunix", "tuned-tunix", {}), ("gguf", "tuned.gguf", {"outtype": "f32"})):
        convert(merged, str(tmp_path / name), to=fmt, progress=False, **opts)
        dst = str(tmp_path / f"x-{fmt}")
        extract(str(tmp_path / name), dst, base=base, rank=6, config=merged if fmt == "gguf" else None,
                progress=False)
        got = _pairs(dst)
        assert set(got) == set(exact), fmt
        for module, (a, b) in exact.items():
            np.testing.assert_allclose(got[module][1] @ got[module][0], b @ a, rtol=1e-6,
                                       atol=1e-6 * np.abs(b @ a).max(), err_msg=(fmt, module))
    # merged again: the merged model, within bf16 rounding of it
    again = str(tmp_path / "again")
    merge_lora(base, str(tmp_path / "xFalse"), again, progress=False)
    from safetensors.numpy import load_file

    for name in sorted(n for n in os.listdir(merged) if n.endswith(".safetensors")):
        want, have = load_file(os.path.join(merged, name)), load_file(os.path.join(again, name))
        for key in want:
            np.testing.assert_allclose(have[key], want[key], rtol=2 ** -8, atol=1e-6, err_msg=key)
    assert verify_adapter(str(tmp_path / "xFalse"), base).ok


def test_extract_of_a_dense_change_meets_the_bound(checkpoints, tmp_path):
    """A model whose q_proj weights all moved by a dense random change, and whose final norm
    moved: the error of each module is the Eckart-Young bound; the other tensors are listed, and
    with --keep-full saved whole (PEFT's modules_to_save) so that PEFT gives the model's logits."""
    from safetensors.numpy import load_file, save_file

    from ckptbridge.adapter import extract
    from ckptbridge.verify import hf_logits, peft_logits

    base = checkpoints["qwen3_untied"]
    model = str(tmp_path / "tuned")
    os.makedirs(model)
    rng = np.random.default_rng(0)
    deltas = {}
    for name in os.listdir(base):
        path = os.path.join(base, name)
        if name.endswith(".safetensors"):
            tensors = load_file(path)
            for key in list(tensors):
                if key.endswith("q_proj.weight") or key == "model.norm.weight":
                    deltas[key] = (0.02 * rng.standard_normal(tensors[key].shape)).astype(np.float32)
                    tensors[key] = tensors[key] + deltas[key]
            save_file(tensors, os.path.join(model, name), metadata={"format": "pt"})
        elif os.path.isfile(path):
            with open(path, "rb") as src, open(os.path.join(model, name), "wb") as dst:
                dst.write(src.read())
    report = extract(model, str(tmp_path / "x"), base=base, rank=3, modules=r"q_proj", progress=False)
    assert report.other_differences and list(report.other_differences) == ["model.norm.weight"]
    for key, delta in deltas.items():
        if key == "model.norm.weight":
            continue
        s = np.linalg.svd(delta.astype(np.float64), compute_uv=False)
        bound = np.sqrt(np.sum(s[3:] ** 2)) / np.linalg.norm(s)
        assert abs(report.relative_errors[key.removesuffix(".weight")] - bound) < 1e-5 * bound, key
    # full rank + --keep-full: nothing lost
    full = extract(model, str(tmp_path / "full"), base=base, energy=1.0, modules=r"q_proj", keep_full=True,
                   progress=False)
    assert full.kept_full == ["model.norm.weight"]
    assert _config(str(tmp_path / "full"))["modules_to_save"] == ["model.norm"]
    tokens = np.asarray([[3, 17, 42, 5, 99, 7]])
    want = hf_logits(model, tokens)
    got = peft_logits(base, str(tmp_path / "full"), tokens)
    assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()


BAD = [
    # (what, arguments after `adapter`, exit code, words the one line must have)
    ("weights of the wrong length", ["combine", "{p0}", "{p1}", "{dst}", "--method", "linear", "--weights", "1",
                                     "--base", "{base}"], 8, "--weights"),
    ("unequal ranks for linear", ["combine", "{p0}", "{p2}", "{dst}", "--method", "linear", "--base", "{base}"], 6,
     "ranks differ"),
    ("no density for ties", ["combine", "{p0}", "{p1}", "{dst}", "--method", "ties", "--base", "{base}"], 8,
     "--density"),
    ("a rank larger than a module allows", ["resize", "{p0}", "{dst}", "--rank", "4096", "--base", "{base}"], 8,
     "larger than module"),
    ("an adapter of another family", ["combine", "{p0}", "{other}", "{dst}", "--method", "cat", "--base", "{base}"],
     None, "{other}"),
    ("extract against the wrong base", ["extract", "{base}", "{dst}", "--base", "{other_base}", "--rank", "2"], 6,
     "fine-tuned from"),
    ("extract from an adapter", ["extract", "{p0}", "{dst}", "--base", "{base}", "--rank", "2"], 8, "adapter"),
    ("a model to resize", ["resize", "{base}", "{dst}", "--rank", "2"], 8, "adapter extract"),
]


@pytest.mark.parametrize("what,args,code,words", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs(inputs, tmp_path, what, args, code, words):
    from conftest import tree_hash

    base, adapters = inputs("qwen3")
    other_base, others = inputs("gemma4")
    names = dict(p0=adapters[0], p1=adapters[1], p2=adapters[2], base=base, other=others[0], other_base=other_base,
                 dst=str(tmp_path / "out"))
    before = {p: tree_hash(p) for p in (*adapters, base)}
    proc = run_cli("adapter", *(a.format(**names) for a in args))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and (code is None or proc.returncode == code), (what, proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("ckptbridge: error:"), (what, proc.stderr)
    assert words.format(**names) in lines[0], (what, lines[0])
    assert not os.path.exists(names["dst"])
    assert before == {p: tree_hash(p) for p in before}
