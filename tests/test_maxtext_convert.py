"""`convert safetensors-to-maxtext` and `maxtext-to-safetensors` against MaxText's own conversions.

tests/data/maxtext/expected.json holds, per MaxText key of every family row, the sha256 of what
MaxText's to_maxtext hooks and stacking make from bf16 HF tensors whose values follow from their
names (`ckptbridge.testing.keyed_values`), and of what its to_huggingface (weight_dtype bfloat16)
makes from that back (scripts/maxtext_expected.py runs MaxText's code), the vision towers' too in the
rows of Gemma 3 and Gemma 4 31B/26B. Here the same HF tensors go through our verbs: every MaxText
tensor and every HF tensor back must have those bytes. Then
real models: logits with transformers after a round trip, errors, NNX trees. (Round trips of the
tensors, and MaxText to and from Tunix, are the format matrix's: tests/test_matrix.py.)"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import pytest
from conftest import MAXTEXT_ROWS, maxtext_plan

from ckptbridge.cli import main
from ckptbridge.errors import MismatchError
from ckptbridge.io import orbax as orbax_io
from ckptbridge.io.hf import HFModelDir, write_model_directory
from ckptbridge.io.safetensors import PlannedTensor
from ckptbridge import convert_maxtext_to_safetensors, convert_safetensors_to_maxtext
from ckptbridge.formats.maxtext.model import ITEM, ROOT
from ckptbridge.testing import keyed_values, write_random_checkpoint


def _flat(value) -> list[str]:
    return [value] if isinstance(value, str) else [k for v in value for k in _flat(v)]


def _hf_model(row: dict, out: str) -> dict[str, np.ndarray]:
    """The row's HF model with keyed_values tensors (bf16), as a model directory at ``out``."""
    shapes = {}
    for v in row["keys"].values():
        for k in _flat(v["hf"]):
            shapes[k] = tuple(v["hf_shape"])
    tensors = {k: keyed_values(k, s) for k, s in shapes.items()}
    planned = [PlannedTensor(k, t.dtype, t.shape, lambda t=t: t) for k, t in tensors.items()]
    write_model_directory(out, planned, row["hf_config"], 1 << 30)
    return tensors


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


@pytest.mark.parametrize("chunk_size", ["32MiB", "1KiB"])  # 1 KiB: tensors in row blocks both ways
@pytest.mark.parametrize("name", MAXTEXT_ROWS)
def test_tensors_are_what_maxtexts_conversions_make(maxtext_rows, name, chunk_size, tmp_path):
    row = maxtext_rows[name]
    hf = _hf_model(row, str(tmp_path / "hf"))
    convert_safetensors_to_maxtext(str(tmp_path / "hf"), str(tmp_path / "mt"), scan_layers=row["scan_layers"],
                                   chunk_size=chunk_size, progress=False,
                                   vocab_size=row["maxtext_config"]["vocab_size"],
                                   skip_multimodal=not row["maxtext_config"]["use_multimodal"])  # the VLMs' towers
    with orbax_io.OrbaxCheckpoint(str(tmp_path / "mt" / "0" / ITEM)) as ckpt:
        paths = {"-".join(p[1:]): p for p in ckpt.leaves if p[:2] == ROOT}
        assert sorted(paths) == sorted(row["keys"])
        got = ckpt.read(paths.values())
        assert ckpt.custom_metadata["scan_layers"] is row["scan_layers"]
        # stored in pieces: a layer per chunk when scanned, row blocks within 1 KiB when asked
        stacks = {ROOT + leaf.path: math.prod(leaf.stack) for leaf in maxtext_plan(row)}
        small = [p for p in paths.values() if math.prod(ckpt.chunks(p)) < math.prod(ckpt.leaves[p][0]) // stacks[p]]
        assert bool(small) == (chunk_size == "1KiB"), small
    for key, want in row["keys"].items():
        x = got[paths[key]]
        dtype = want.get("dtype", {}).get("to_maxtext", {}).get("bfloat16", "bfloat16")  # norms + 1: float32
        assert (list(x.shape), x.dtype.name) == (want["maxtext_shape"], dtype), key
        assert _sha(np.ascontiguousarray(x).tobytes()) == want["sha256_to_maxtext"], key

    convert_maxtext_to_safetensors(str(tmp_path / "mt"), str(tmp_path / "back"), chunk_size=chunk_size,
                                   progress=False)
    with HFModelDir(str(tmp_path / "back")) as model:
        assert sorted(model.keys()) == sorted(hf)
        for key, want in row["keys"].items():
            back = b"".join(np.ascontiguousarray(model.array(k)).tobytes() for k in _flat(want["hf"]))
            # where MaxText stores float32 (Gemma's norms + 1): its to_huggingface at float32, cast to
            # bf16 (at bfloat16 it would round 1 + w to bf16 before taking 1 off)
            assert _sha(back) == want.get("sha256_to_hf_f32", want["sha256_to_hf"]), key


E2B = dict(family="gemma4", prefix="model.language_model.", attention_k_eq_v=False, hidden_size_per_layer_input=8,
           vocab_size_per_layer_input=300, num_kv_shared_layers=2, use_double_wide_mlp=True,
           layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention", "full_attention"])
# name -> (the tiny model, flags of safetensors-to-maxtext, largest logits NMSE after the round trip)
ROUND_TRIPS = {
    "qwen3": (dict(family="qwen3"), ["--scan-layers"], 0.0),
    "llama3": (dict(family="llama3"), ["--scan-layers", "--no-compression"], 1e-4),
    # Gemma's embedding (15% of it one bf16 step off, NMSE 3.7e-6 on the tensor) feeds every
    # layer of a tiny random model, which amplifies it
    "gemma4": (dict(family="gemma4"), ["--scan-layers"], 2e-3),
    "gemma4_e2b": (E2B, [], 2e-3),  # kv-shared layers and per-layer embeddings; no scanned form
    # norms 1 + w in float32 come back exactly; the embedding (and Gemma 2's query) are rounded
    "gemma3": (dict(family="gemma3", model_type="gemma3_text"), ["--scan-layers"], 2e-3),
    "gemma2": (dict(family="gemma2"), ["--scan-layers", "--vocab-size", "384"], 2e-3),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_logits_after_a_round_trip(name, tmp_path):
    """A random model through MaxText and back: transformers' logits in float32 agree with the
    original's (bitwise for Qwen 3, whose tensors come back bitwise; Llama's query and Gemma's
    embedding are rounded once each way, every other tensor comes back bitwise)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    build, flags, bound = ROUND_TRIPS[name]
    src = str(tmp_path / "hf")
    write_random_checkpoint(src, **build)
    assert main(["convert", "safetensors-to-maxtext", src, str(tmp_path / "mt"), *flags, "--quiet"]) == 0
    assert main(["convert", "maxtext-to-safetensors", str(tmp_path / "mt"), str(tmp_path / "back"), "--quiet"]) == 0
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    logits = []
    for d in (src, str(tmp_path / "back")):
        m = transformers.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32)
        with torch.no_grad():
            logits.append(m(ids).logits.float().numpy())
    a, b = logits
    nmse = float(((a - b) ** 2).mean() / (a ** 2).mean())
    print(f"{name}: logits NMSE after HF -> MaxText -> HF {nmse:.3g}")
    assert nmse == 0.0 if bound == 0.0 else 0 < nmse < bound, nmse


def test_errors_are_one_line_and_write_nothing(maxtext_rows, tmp_path, capsys):
    row = maxtext_rows["qwen3-dense/scanned"]
    _hf_model(row, str(tmp_path / "hf"))
    mt = str(tmp_path / "mt")
    assert main(["convert", "safetensors-to-maxtext", str(tmp_path / "hf"), mt, "--scan-layers", "--quiet"]) == 0

    def fails(argv, pattern):
        capsys.readouterr()
        dst = argv[3]
        code = main(argv + ["--quiet"])
        err = capsys.readouterr().err.strip()
        assert code != 0 and len(err.splitlines()) == 1, err
        assert pattern in err, err
        assert not os.path.exists(dst)

    # a config of another size: the tree does not match
    other = {**row["hf_config"], "num_hidden_layers": row["hf_config"]["num_hidden_layers"] + 1}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(other))
    fails(["convert", "maxtext-to-safetensors", mt, str(tmp_path / "o1"), "--config", str(tmp_path / "cfg")],
          "has shape (40, 3, 4, 12), the config implies (40, 4, 4, 12)")
    # a family without a MaxText layout
    write_random_checkpoint(str(tmp_path / "g"), family="gemma")  # Gemma 1: MaxText maps no HF Gemma 1
    fails(["convert", "safetensors-to-maxtext", str(tmp_path / "g"), str(tmp_path / "o2")], "no MaxText layout")
    # a model MaxText cannot scan
    write_random_checkpoint(str(tmp_path / "e2b"), **E2B)
    fails(["convert", "safetensors-to-maxtext", str(tmp_path / "e2b"), str(tmp_path / "o5"), "--scan-layers"],
          "MaxText has no scanned form of this model")
    # layers that do not fill MaxText's blocks
    write_random_checkpoint(str(tmp_path / "g7"), family="gemma4", num_hidden_layers=7,
                            layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"])
    fails(["convert", "safetensors-to-maxtext", str(tmp_path / "g7"), str(tmp_path / "o6"), "--scan-layers"],
          "MaxText scans whole blocks of 6 layers and this model has 7")
    # a truncated step: a stored chunk gone
    chunks = sorted(p for p in (tmp_path / "mt").rglob("d/*") if p.is_file())
    assert chunks
    for p in chunks:
        p.unlink()
    fails(["convert", "maxtext-to-safetensors", mt, str(tmp_path / "o3")], "the checkpoint is damaged")
    # not a MaxText checkpoint at all
    fails(["convert", "maxtext-to-safetensors", str(tmp_path / "hf"), str(tmp_path / "o4")], "not an Orbax checkpoint")


def test_a_tree_of_another_scan_layout_than_recorded_is_refused(maxtext_rows, tmp_path):
    row = maxtext_rows["qwen2.5/unscanned"]
    _hf_model(row, str(tmp_path / "hf"))
    convert_safetensors_to_maxtext(str(tmp_path / "hf"), str(tmp_path / "mt"), progress=False)
    meta = tmp_path / "mt" / "0" / "_CHECKPOINT_METADATA"
    doc = json.loads(meta.read_text())
    doc["custom_metadata"]["scan_layers"] = True
    meta.write_text(json.dumps(doc))
    with pytest.raises(MismatchError, match="scan_layers=True, but its tree is unscanned"):
        convert_maxtext_to_safetensors(str(tmp_path / "mt"), str(tmp_path / "back"), progress=False)
    assert not (tmp_path / "back").exists()


def test_an_nnx_sft_tree_converts_and_inspect_says_what_each_is(maxtext_rows, tmp_path, capsys):
    """MaxText's NNX SFT trainers save the tree at <step>/model_params without params/params and
    with a value level under each leaf: it converts to the same HF tensors, and inspect tells it
    from the Linen form and from a Tunix checkpoint."""
    row = maxtext_rows["qwen3-moe/scanned"]
    hf = _hf_model(row, str(tmp_path / "hf"))
    convert_safetensors_to_maxtext(str(tmp_path / "hf"), str(tmp_path / "mt"), scan_layers=True, progress=False)
    with orbax_io.OrbaxCheckpoint(str(tmp_path / "mt" / "0" / ITEM)) as ckpt:
        linen = ckpt.read([p for p in ckpt.leaves if p[:2] == ROOT])
    nnx = orbax_io.nest({p[2:] + ("value",): x for p, x in linen.items()})
    orbax_io.save_manager_step(str(tmp_path / "sft" / "checkpoints"), 7, nnx, item="model_params")
    convert_maxtext_to_safetensors(str(tmp_path / "sft" / "checkpoints"), str(tmp_path / "back"),
                                   config=str(tmp_path / "hf"), progress=False)
    with HFModelDir(str(tmp_path / "back")) as model:
        for key, x in hf.items():
            assert np.array_equal(model.array(key).view(np.uint16), x.view(np.uint16)), key

    def inspect(path):
        capsys.readouterr()
        assert main(["inspect", path, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    info = inspect(str(tmp_path / "mt"))
    assert (info["kind"], info["family"], info["maxtext"]) == (
        "maxtext-weights", "qwen3", {"tree": "linen (params/params)", "scan_layers": True, "lora": False})
    info = inspect(str(tmp_path / "sft" / "checkpoints"))
    assert (info["kind"], info["maxtext"]["tree"], info["path"].endswith("7/model_params")) == (
        "maxtext-weights", "nnx (model_params)", True)
    # a Tunix verb given a MaxText checkpoint says which verb to use
    capsys.readouterr()
    assert main(["convert", "orbax-to-safetensors", str(tmp_path / "mt" / "0" / ITEM), str(tmp_path / "o"),
                 "--quiet"]) != 0
    assert "is a MaxText checkpoint, not Tunix; use `ckptbridge convert maxtext-to-safetensors`" in \
        capsys.readouterr().err
