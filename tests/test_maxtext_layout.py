"""MaxText's parameter tree from the family rows (ckptbridge/maxtext_layout.py) against what MaxText's
own mapping gives for the same configs (tests/data/maxtext/expected.json, scripts/maxtext_expected.py):
every key, its shape and the HF tensors it holds, scanned and unscanned."""

from __future__ import annotations

import pytest
from conftest import MAXTEXT_ROWS

from ckptbridge import mapping, specs
from ckptbridge.errors import MismatchError
from ckptbridge.maxtext_layout import plan


def _ours(row: dict) -> dict:
    hf = row["hf_config"]
    spec = specs.family_for(hf)
    cfg = spec.parse_config(hf, "expected.json")
    leaves = plan(mapping.entries(cfg, spec, "model."), spec.maxtext, row["scan_layers"])
    out = {}
    for leaf in leaves:
        keys = [e.hf_keys for e in leaf.entries]
        if len(leaf.entries) > 1:  # one per layer; stacked experts: [[expert 0 of every layer], ...]
            hf_keys = ([list(k) for k in zip(*keys)] if len(keys[0]) > 1 else [k[0] for k in keys])
        else:
            hf_keys = keys[0][0] if len(keys[0]) == 1 else list(keys[0])
        out[leaf.key] = {"maxtext_shape": list(leaf.shape), "hf": hf_keys}
    return out


@pytest.mark.parametrize("scan", ["scanned", "unscanned"])
@pytest.mark.parametrize("family", MAXTEXT_ROWS)
def test_keys_shapes_and_hf_tensors_are_maxtexts(maxtext_rows, family, scan):
    row = maxtext_rows[f"{family}/{scan}"]
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
