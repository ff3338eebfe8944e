"""MaxText's parameter tree from the family rows (ckptbridge/maxtext_layout.py) against what MaxText's
own mapping gives for the same configs (tests/data/maxtext/expected.json, scripts/maxtext_expected.py):
every key, its shape and the HF tensors it holds, scanned and unscanned."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from conftest import MAXTEXT_ROWS, maxtext_plan

from ckptbridge import mapping, specs
from ckptbridge.errors import MismatchError
from ckptbridge.formats.maxtext.layout import _times, plan


def _hf_of(leaf, e):
    """The HF key(s) of one row of ``leaf`` as MaxText's mapping writes them."""
    keys = e.hf_keys
    if leaf.part.select and e.rule.stack_axis == leaf.part.select[0]:  # one HF tensor per part (k, v)
        keys = (keys[leaf.part.select[1]],)
    return keys[0] if len(keys) == 1 else list(keys)


def _ours(row: dict) -> dict:
    out = {}
    for leaf in maxtext_plan(row):
        keys = [_hf_of(leaf, e) for e in leaf.entries]
        if len(leaf.stack) == 2:  # blocks of nested positions
            hf_keys = [keys[b * leaf.stack[1]:(b + 1) * leaf.stack[1]] for b in range(leaf.stack[0])]
        elif leaf.stack:  # one per layer; stacked experts: [[expert 0 of every layer], ...]
            hf_keys = [list(k) for k in zip(*keys)] if isinstance(keys[0], list) else keys
        else:
            hf_keys = keys[0]
        out[leaf.key] = {"maxtext_shape": list(leaf.shape), "hf": hf_keys}
    return out


@pytest.mark.parametrize("name", MAXTEXT_ROWS)
def test_keys_shapes_and_hf_tensors_are_maxtexts(maxtext_rows, name):
    row = maxtext_rows[name]
    ours = _ours(row)
    theirs = {k: {"maxtext_shape": v["maxtext_shape"], "hf": v["hf"]} for k, v in row["keys"].items()}
    assert sorted(ours) == sorted(theirs)
    for key in theirs:
        assert ours[key] == theirs[key], key


def test_a_row_maxtext_lacks_is_one_line(maxtext_rows):
    row = maxtext_rows["qwen3-dense/unscanned"]
    spec = specs.family_for(row["hf_config"])
    cfg = spec.parse_config(row["hf_config"], "expected.json")
    names = dict(spec.maxtext.names)
    del names["q_norm"]
    with pytest.raises(MismatchError, match=r"model\.layers\.0\.self_attn\.q_norm\.weight: MaxText has no parameter"):
        plan(mapping.entries(cfg, spec, "model."), type(spec.maxtext)(names), False)


def test_scanning_layers_that_differ_is_one_line(maxtext_rows):
    """MaxText scans identical layers: a Qwen 3 MoE whose first layer is dense cannot be scanned."""
    hf = {**maxtext_rows["qwen3-moe/scanned"]["hf_config"], "mlp_only_layers": [0]}
    spec = specs.family_for(hf)
    ents = mapping.entries(spec.parse_config(hf, "config.json"), spec, "model.")
    with pytest.raises(MismatchError, match="the layers differ in this tensor .* convert without --scan-layers"):
        plan(ents, spec.maxtext, True)
    assert any(leaf.key == "params-decoder-layers_0-mlp-wi_0-kernel" for leaf in plan(ents, spec.maxtext, False))


def test_every_row_maxtext_maps_is_tested(maxtext_rows):
    """Every family row of expected.json is one of ours (a new row fails here until it converts)."""
    assert sorted(MAXTEXT_ROWS) == sorted(maxtext_rows)


@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("factor", [float(np.sqrt(5376)), float(ml_dtypes.bfloat16(np.sqrt(3840))), 1 / np.sqrt(128), 3e38])
def test_the_scale_in_integer_passes_gives_numpys_bytes(factor, divide):
    """The value transforms' scale (a 31B embedding is 1.4 G values) runs bfloat16 through float32
    and back with integer operations: for every bfloat16 value but NaN, in more than one pass and a
    part of one, the bytes NumPy's casts give."""
    bf16 = ml_dtypes.bfloat16
    every = np.arange(1 << 16, dtype=np.uint16).view(bf16)
    every = np.concatenate([every[~np.isnan(every.astype(np.float32))]] * 3)[:150_001]
    with np.errstate(over="ignore"):
        y = every.astype(np.float32)
        want = (y / np.float32(factor) if divide else y * np.float32(factor)).astype(bf16)
        got = _times(every, factor, divide)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
