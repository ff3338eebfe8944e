"""One matrix instead of a test per verb, generated from the format registry (ckptbridge.formats).

Models: for every family (one row of tests/families.py each, bfloat16, and Gemma 4 in float32 too)
and every (source, destination) pair the registry declares, the row's tiny HF model is written in
the source format (its most exact options: GGUF ``outtype=auto``, MaxText scanned), converted to
the destination, and brought back to HF; every tensor must equal the original's bit for bit, or,
for the rows a format says it rounds (``Format.inexact``: MaxText's scaled embedding or query,
GGUF's norms stored as 1 + w), stay within two roundings of its dtype. compressed-tensors is
checked against quantizing the original directly: the same tensors from any source. A pair the
family has no form for ends in one line naming the file (UnsupportedError). The multimodal rows'
towers travel through every format that holds them; where one does not (MaxText for a Gemma 4
with an audio tower), converting ends in one line naming ``--skip-multimodal``, and with it the
text model goes through as every other row's.

Adapters: for every family row with LoRA, the row's PEFT adapter (made by PEFT) is written in
each adapter format, converted to each adapter format and brought back to PEFT: every module's
delta ``scale * B @ A`` equals the original's within float32 rounding (a GGUF LoRA, which is not
read back, is compared through its own factors and alpha).

Adding a format to the registry puts it in both matrices with no new test code.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from conftest import _Lazy, assert_same_model
from families import CASES

from ckptbridge import convert, formats
from ckptbridge.errors import UnsupportedError

pytestmark = pytest.mark.slow

MODEL_ROWS = ["kv_lm_bf16_sharded", "keqv_lm_f32_sharded", "gemma4_e2b_bf16_sharded", "gemma3_text_bf16_sharded",
              "gemma2_bf16_sharded", "gemma_fused_bf16_sharded", "qwen3_untied_bf16_sharded",
              "qwen3_moe_bf16_sharded", "qwen2_untied_bf16_sharded", "llama3_tied_bf16_sharded",
              # multimodal: Gemma 3 with its vision tower, Gemma 4 31B-shaped with its vision tower and
              # E2B-shaped with vision and audio
              "gemma3_mm_bf16_sharded", "gemma4_mm", "gemma4_e2b_mm_bf16_sharded"]
ADAPTER_ROWS = ["keqv_lm_f32_sharded", "gemma4_e2b", "gemma3_text", "gemma2", "gemma_fused", "qwen3_untied",
                "qwen3_moe", "qwen2_untied", "llama3_tied"]
if os.environ.get("CKPTBRIDGE_FLOOR"):  # at the floors: every reader and writer, on one family (test.sh --floor)
    MODEL_ROWS, ADAPTER_ROWS = MODEL_ROWS[:1], ADAPTER_ROWS[:1]
MODEL_PAIRS = [(s.name, d.name) for s, d in formats.pairs(formats.MODEL)]
ADAPTER_PAIRS = [(s.name, d.name) for s, d in formats.pairs(formats.ADAPTER)]
SOURCE_OPTIONS = {"maxtext": {"scan_layers": True}, "maxtext-lora": {"scan_layers": True}}


def _target(tmp, fmt: str) -> str:
    return str(tmp / (fmt + (".gguf" if formats.get(fmt).suffix else "")))


def _read_options(fmt: str, orig: str) -> dict:
    return {"config": orig} if fmt == "gguf" else {}


def _family(path: str):
    from ckptbridge.formats.hf import open_hf_source

    with open_hf_source(path, keep_towers=True) as s:
        keys: dict[str, list[str]] = {}
        for e in s.all_entries:  # a tower's rows as tower:rule (as Format.inexact names them)
            keys.setdefault(f"{e.tower}:{e.rule.name}" if e.tower else e.rule.name, []).extend(e.hf_keys)
        return s.spec, s.cfg, keys


def _towers(path: str) -> tuple[list[str], set[str]]:
    """The HF keys of a row's towers, and the formats that cannot hold them."""
    from ckptbridge.formats.hf import open_hf_source

    with open_hf_source(path, keep_towers=True) as s:
        keys = [k for e in s.tower_entries for k in e.hf_keys]
        dropping = {f.name for f in formats.FORMATS.values()
                    if f.kind == formats.MODEL and f.writes and (f.towers == "drop" or f.tower_refusal(s))}
        return keys, dropping if keys else set()


def _lossless(fmt: str) -> dict:
    return dict(formats.get(fmt).lossless)


class _Sources:
    """Each row's model (or PEFT adapter) written in each source format, made once."""

    def __init__(self, checkpoints, adapters, root):
        self.models = _Lazy(lambda key: self._model(*key))
        self.adapters = _Lazy(lambda key: self._adapter(*key))
        self.quantized = _Lazy(self._quantized)
        self._checkpoints, self._adapter_rows, self._root = checkpoints, adapters, root

    def _model(self, row: str, fmt: str) -> str:
        orig = self._checkpoints[row]
        if fmt == "hf":
            return orig
        (self._root / f"{row}-src").mkdir(exist_ok=True)
        dst = _target(self._root / f"{row}-src", fmt)
        skip = {"skip_multimodal": True} if fmt in _towers(orig)[1] else {}  # the text model, where it cannot hold them
        _written(orig, dst, fmt, {**_lossless(fmt), **SOURCE_OPTIONS.get(fmt, {}), **skip})
        return dst

    def _quantized(self, row: str) -> str:
        dst = str(self._root / f"{row}-int8")
        convert(self._checkpoints[row], dst, to="compressed-tensors", quantize="int8", progress=False)
        return dst

    def _adapter(self, row: str, fmt: str) -> str:
        a = self._adapter_rows[row]
        if fmt == "peft":
            return a.peft
        (self._root / f"{row}-lora-src").mkdir(exist_ok=True)
        dst = _target(self._root / f"{row}-lora-src", fmt)
        _written(a.peft, dst, fmt, {"base": a.base, **SOURCE_OPTIONS.get(fmt, {})})
        return dst


def _written(src: str, dst: str, fmt: str, opts: dict) -> None:
    """``src`` converted to ``fmt``, scanned where the options ask and the family allows it."""
    try:
        convert(src, dst, to=fmt, progress=False, **opts)
    except UnsupportedError:
        if not opts.pop("scan_layers", False):
            raise
        convert(src, dst, to=fmt, progress=False, **opts)  # a model MaxText scans no layers of


@pytest.fixture(scope="session")
def sources(checkpoints, adapters, tmp_path_factory):
    return _Sources(checkpoints, adapters, tmp_path_factory.mktemp("matrix"))


def _inexact(row: str, spec, cfg, *fmts: str) -> set[str]:
    rules: set[str] = set()
    for f in fmts:
        rules |= set(formats.get(f).inexact(spec, cfg, **_lossless(f)))
    return rules


def _supports(fmt: str, spec, cfg) -> bool:
    if fmt in ("maxtext", "maxtext-lora"):
        return spec.maxtext is not None
    if fmt in ("gguf", "gguf-lora"):
        return cfg.model_type in spec.gguf
    if fmt == "compressed-tensors":
        return not (spec.experts is not None and spec.experts(cfg) is not None)
    return True


def _refused(call) -> None:
    with pytest.raises(UnsupportedError) as e:
        call()
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("pair", MODEL_PAIRS, ids="->".join)
@pytest.mark.parametrize("row", MODEL_ROWS)
def test_model_pair(checkpoints, sources, tmp_path, row, pair):
    s, d = pair
    orig = checkpoints[row]
    spec, cfg, keys_of = _family(orig)
    if not all(_supports(f, spec, cfg) for f in pair):
        first = next(f for f in pair if not _supports(f, spec, cfg))
        _refused(lambda: convert(orig, _target(tmp_path, first), to=first, progress=False,
                                 **({"quantize": "int8"} if first == "compressed-tensors" else {})))
        return
    src = sources.models[(row, s)]
    out = _target(tmp_path, d)
    opts = {**_read_options(s, orig), **_lossless(d)}
    allowed = {k for rule in _inexact(row, spec, cfg, s, d) for k in keys_of.get(rule, ())}
    towers, dropping = _towers(orig)
    without = towers if dropping & {s, d} else []
    if d in dropping and s not in dropping and formats.get(d).towers != "drop":  # refused, then the text model
        _refused(lambda: convert(src, out, to=d, progress=False, **opts, **({"quantize": "int8"} if d ==
                                                                             "compressed-tensors" else {})))
        assert not os.path.exists(out)
        opts["skip_multimodal"] = True
    if d == "compressed-tensors":  # the same tensors as the original quantized (those the source rounds: as such)
        convert(src, out, to=d, quantize="int8", progress=False, **opts)
        assert_same_model(sources.quantized[row], out, allowed | {k[:-len("weight")] + "weight_scale" for k in allowed},
                          values=False, without=without)
        return
    convert(src, out, to=d, progress=False, **opts)
    back = out
    if d != "hf":
        back = str(tmp_path / "back")
        convert(out, back, to="hf", progress=False, **_read_options(d, orig))
    assert_same_model(orig, back, allowed, without=without)


# --------------------------------------------------------------------------- adapters


def _deltas(adapter: str, base: str) -> dict[str, np.ndarray]:
    """Every HF key's LoRA delta (float64) of a PEFT adapter."""
    from ckptbridge.formats.peft import open_peft_lora
    from ckptbridge.lora.base import open_base

    out: dict[str, np.ndarray] = {}
    with open_peft_lora(adapter, open_base(base)) as ad:
        for key, row, scale, (a, b) in ad.deltas():
            assert row == 0
            out[key] = out.get(key, 0) + scale * (b.astype(np.float64) @ a.astype(np.float64))
    return out


def _gguf_deltas(path: str, base: str) -> dict[str, np.ndarray]:
    """The deltas a GGUF LoRA adds, by HF key, as ggml computes them (alpha / rank, or 1 for alpha 0;
    q/k rows back in HF's order)."""
    from ckptbridge import mapping
    from ckptbridge.formats.gguf.model import _plan, family
    from ckptbridge.formats.gguf.reader import _uninterleave
    from ckptbridge.io import gguf
    from ckptbridge.lora.base import open_base

    b = open_base(base)
    spec_gguf, h = family(b.cfg, base)
    tensors = {t.name: t for t in _plan(b.cfg, spec_gguf, mapping.entries(b.cfg, b.spec, b.prefix),
                                        lambda n, s: gguf.TensorType.F32, h)}
    f = gguf.read_gguf(path)
    alpha = f.metadata["adapter.lora.alpha"]
    out = {}
    for name in f.tensors:
        if not name.endswith(".lora_a"):
            continue
        t = tensors[name[:-len(".lora_a")]]
        a = np.asarray(f.values(name), np.float64)
        bm = np.asarray(f.values(t.name + ".lora_b"), np.float64)
        if t.rope_heads is not None:
            bm = _uninterleave(bm, t.rope_heads)
        scale = alpha / bm.shape[-1] if alpha else 1.0
        out[t.keys[0]] = scale * (bm @ a)
    return out


def assert_same_deltas(want: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> None:
    assert set(got) == set(want)
    for key, w in want.items():
        err = np.linalg.norm(got[key] - w) / max(np.linalg.norm(w), 1e-30)
        assert err <= 1e-5, (key, err)


@pytest.mark.parametrize("pair", ADAPTER_PAIRS, ids="->".join)
@pytest.mark.parametrize("row", ADAPTER_ROWS)
def test_adapter_pair(adapters, sources, tmp_path, row, pair):
    s, d = pair
    a = adapters[row]
    spec, cfg, _ = _family(a.base)
    if not all(_supports(f, spec, cfg) for f in pair):
        first = next(f for f in pair if not _supports(f, spec, cfg))
        _refused(lambda: convert(a.peft, _target(tmp_path, first), to=first, base=a.base, progress=False))
        return
    src = sources.adapters[(row, s)]
    out = _target(tmp_path, d)
    convert(src, out, to=d, base=a.base, progress=False)
    want = _deltas(a.peft, a.base)
    if d == "gguf-lora":
        assert_same_deltas(want, _gguf_deltas(out, a.base))
        return
    back = out
    if d != "peft":
        back = str(tmp_path / "back")
        convert(out, back, to="peft", base=a.base, progress=False)
    assert_same_deltas(want, _deltas(back, a.base))


@pytest.mark.skipif(bool(os.environ.get("CKPTBRIDGE_FLOOR")), reason="one family at the floors")
def test_every_family_is_in_the_matrix():
    """Each family of the registry has a row in both matrices (a family added is tested here)."""
    from ckptbridge.specs import FAMILIES

    assert {CASES[r].family for r in MODEL_ROWS} == set(FAMILIES)
    assert {CASES[r].family for r in ADAPTER_ROWS} == set(FAMILIES)
