"""Bad inputs across every CLI verb, table-driven: one stderr line naming what and where, the exit
code of its class, no destination (nor temporary directory) left, and source bytes unchanged."""

import json
import os
import pickle
import shutil
import struct

import pytest

from conftest import run_cli, tree_hash

pytestmark = [pytest.mark.slow, pytest.mark.pinned_only]


@pytest.fixture(scope="module")
def world(tmp_path_factory, checkpoints):
    from ckptbridge import convert_peft_to_orbax
    from ckptbridge import convert_safetensors_to_orbax
    from ckptbridge.testing import build_checkpoint, write_random_adapter

    root = tmp_path_factory.mktemp("pristine")
    base = checkpoints["keqv_text_bf16_single"]
    w = {"root": root, "base": base, "sharded": checkpoints["kv_text_f32_sharded"]}
    w["adapter"] = write_random_adapter(base, str(root / "adapter"))
    w["orbax"] = str(root / "orbax")
    convert_safetensors_to_orbax(base, w["orbax"], progress=False)
    w["lora"] = str(root / "lora")
    convert_peft_to_orbax(w["adapter"], w["lora"], base=base, progress=False)
    # another Gemma 4 of other widths and depth: adapters/checkpoints of it do not fit `base`
    w["other"] = build_checkpoint(str(root / "other"), prefix="model.", hidden_size=48, num_hidden_layers=12,
                                  tokenizer=False)
    return w


# ------------------------------------------------------------------ helpers that break copies


def copy(src, tmp, name="src"):
    dst = tmp / name
    shutil.copytree(src, dst, symlinks=True)
    return str(dst)


def st_split(path):
    with open(path, "rb") as f:
        raw = f.read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def st_join(path, header, data, header_bytes=None):
    hb = header_bytes if header_bytes is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + data)


def edit_header(w, tmp, edit):
    src = copy(w["base"], tmp)
    path = os.path.join(src, "model.safetensors")
    header, data = st_split(path)
    names = sorted(k for k in header if k != "__metadata__")
    edit(header, names, len(data))
    st_join(path, header, data)
    return src


def s2o(src, tmp):
    return ["convert", "safetensors-to-orbax", src, str(tmp / "dst")]


def sharded_copy(w, tmp):
    src = copy(w["sharded"], tmp)
    index_path = os.path.join(src, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    return src, index_path, index


def set_shard_name(w, tmp, name):
    src, index_path, index = sharded_copy(w, tmp)
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = name
    with open(index_path, "w") as f:
        json.dump(index, f)
    return s2o(src, tmp), [src]


def adapter_with(w, tmp, **changes):
    src = copy(w["adapter"], tmp, "adapter")
    path = os.path.join(src, "adapter_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return src


def p2o(adapter, w, tmp, base=None):
    return ["convert", "peft-to-orbax", adapter, str(tmp / "dst"), "--base", base or w["base"]]


def rewrite_adapter(w, tmp, edit):
    from safetensors.numpy import load_file, save_file

    src = copy(w["adapter"], tmp, "adapter")
    path = os.path.join(src, "adapter_model.safetensors")
    tensors = load_file(path)
    save_file(edit(tensors), path)
    return src


class Boom:
    """A pickle that creates a file if anything ever unpickles it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ------------------------------------------------------------------ the cases
# each: (world, tmp) -> (argv, [sources to hash]); expected exit code; text the error line names


def c_truncated(w, tmp):
    src = copy(w["base"], tmp)
    path = os.path.join(src, "model.safetensors")
    os.truncate(path, os.path.getsize(path) // 2)
    return s2o(src, tmp), [src]


def c_header_past_end(w, tmp):
    src = copy(w["base"], tmp)
    path = os.path.join(src, "model.safetensors")
    with open(path, "r+b") as f:
        f.write(struct.pack("<Q", os.path.getsize(path) + 10))
    return s2o(src, tmp), [src]


def c_header_not_json(w, tmp):
    src = copy(w["base"], tmp)
    path = os.path.join(src, "model.safetensors")
    header, data = st_split(path)
    st_join(path, None, data, b"{this is not json" + b" " * 20)
    return s2o(src, tmp), [src]


def c_header_not_object(w, tmp):
    src = copy(w["base"], tmp)
    path = os.path.join(src, "model.safetensors")
    _, data = st_split(path)
    st_join(path, [1, 2, 3], data)
    return s2o(src, tmp), [src]


def c_unknown_dtype(w, tmp):
    return s2o(edit_header(w, tmp, lambda h, n, size: h[n[0]].update(dtype="Q7")), tmp), None


def c_shape_vs_bytes(w, tmp):
    return s2o(edit_header(w, tmp, lambda h, n, size: h[n[0]].update(shape=[s * 2 for s in h[n[0]]["shape"]])),
               tmp), None


def c_overlap(w, tmp):
    def edit(h, n, size):
        a, b = h[n[0]], h[n[1]]
        if a["dtype"] == b["dtype"] and a["shape"] == b["shape"]:
            b["data_offsets"] = list(a["data_offsets"])
        else:  # same byte length as the first, starting inside it
            b["data_offsets"] = [a["data_offsets"][0], a["data_offsets"][0] + b["data_offsets"][1] - b["data_offsets"][0]]

    return s2o(edit_header(w, tmp, edit), tmp), None


def c_out_of_range(w, tmp):
    def edit(h, n, size):
        last = max(n, key=lambda k: h[k]["data_offsets"][1])
        b, e = h[last]["data_offsets"]
        h[last]["data_offsets"] = [size + 64, size + 64 + e - b]

    return s2o(edit_header(w, tmp, edit), tmp), None


def c_begin_after_end(w, tmp):
    return s2o(edit_header(w, tmp, lambda h, n, size: h[n[0]].update(
        data_offsets=h[n[0]]["data_offsets"][::-1] if h[n[0]]["data_offsets"][1] else [5, 0])), tmp), None


def c_index_missing_shard(w, tmp):
    src, _, index = sharded_copy(w, tmp)
    os.remove(os.path.join(src, sorted(set(index["weight_map"].values()))[-1]))
    return s2o(src, tmp), [src]


def c_index_dotdot(w, tmp):
    return set_shard_name(w, tmp, "../model-00001-of-00002.safetensors")


def c_index_absolute(w, tmp):
    return set_shard_name(w, tmp, "/etc/passwd")


def c_index_not_json(w, tmp):
    src, index_path, _ = sharded_copy(w, tmp)
    with open(index_path, "w") as f:
        f.write("{weight_map: ")
    return s2o(src, tmp), [src]


def c_shard_symlink_out(w, tmp):
    src, _, index = sharded_copy(w, tmp)
    name = sorted(set(index["weight_map"].values()))[0]
    outside = tmp / "elsewhere.safetensors"
    shutil.move(os.path.join(src, name), outside)
    os.symlink(outside, os.path.join(src, name))
    return s2o(src, tmp), [src]


def c_single_symlink_out(w, tmp):
    src = copy(w["base"], tmp)
    outside = tmp / "outside.safetensors"
    shutil.move(os.path.join(src, "model.safetensors"), outside)
    os.symlink(outside, os.path.join(src, "model.safetensors"))
    return s2o(src, tmp), [src]


def _pickled(w, tmp, name):
    src = tmp / "pickled"
    src.mkdir()
    shutil.copy(os.path.join(w["base"], "config.json"), src)
    (src / name).write_bytes(pickle.dumps(Boom(str(tmp / "unpickled"))))
    return s2o(str(src), tmp), [str(src)]


def c_pickle_bin(w, tmp):
    return _pickled(w, tmp, "pytorch_model.bin")


def c_pickle_pt(w, tmp):
    return _pickled(w, tmp, "model.pt")


def _rewritten(w, tmp, edit):
    from safetensors.numpy import load_file, save_file

    src = copy(w["base"], tmp)
    path = os.path.join(src, "model.safetensors")
    save_file(edit(load_file(path)), path)
    return s2o(src, tmp), [src]


def c_missing_tensor(w, tmp):
    return _rewritten(w, tmp, lambda t: {k: v for k, v in t.items() if "layers.1.mlp.up_proj" not in k})


def c_unexpected_tensor(w, tmp):
    import numpy as np

    return _rewritten(w, tmp, lambda t: {**t, "model.layers.0.mlp.extra_proj.weight": np.zeros((2, 2), np.float32)})


def c_wrong_shape(w, tmp):
    def edit(t):
        k = next(k for k in t if k.endswith("layers.0.mlp.down_proj.weight"))
        t[k] = t[k][:, :-1].copy()
        return t

    return _rewritten(w, tmp, edit)


def _config_edit(w, tmp, edit):
    src = copy(w["base"], tmp)
    path = os.path.join(src, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:
        f.write(edit(cfg))
    return s2o(src, tmp), [src]


def c_unknown_model_type(w, tmp):
    return _config_edit(w, tmp, lambda c: json.dumps({**c, "model_type": "mixtral"}))


def c_config_not_json(w, tmp):
    return _config_edit(w, tmp, lambda c: "{'model_type': gemma4")


def c_empty_dir(w, tmp):
    (tmp / "empty").mkdir()
    return s2o(str(tmp / "empty"), tmp), None


def c_missing_src(w, tmp):
    return s2o(str(tmp / "nope"), tmp), None


def c_dst_exists(w, tmp):
    (tmp / "dst").mkdir()
    (tmp / "dst" / "keep.txt").write_text("mine")
    return s2o(w["base"], tmp), [w["base"], str(tmp / "dst")]


def c_dst_inside_src(w, tmp):
    src = copy(w["base"], tmp)
    return ["convert", "safetensors-to-orbax", src, os.path.join(src, "orbax")], [src]


def c_dst_parent_is_file(w, tmp):
    (tmp / "afile").write_text("x")
    return ["convert", "safetensors-to-orbax", w["base"], str(tmp / "afile" / "dst")], [w["base"]]


def c_bad_shard_size(w, tmp):
    return ["convert", "orbax-to-safetensors", w["orbax"], str(tmp / "dst"), "--max-shard-size", "lots"], [w["orbax"]]


def c_orbax_missing_leaves(w, tmp):
    # a config with more layers than the tree
    return ["convert", "orbax-to-safetensors", w["orbax"], str(tmp / "dst"), "--config",
            os.path.join(w["sharded"], "config.json")], [w["orbax"]]


def c_orbax_extra_leaves(w, tmp):
    """The base's tree plus one leaf no Gemma 4 has."""
    import numpy as np

    from ckptbridge.io.orbax import OrbaxCheckpoint, nest, save_tree

    ckpt = OrbaxCheckpoint(w["orbax"])
    flat = ckpt.read(list(ckpt.leaves))
    flat[("layers", "0", "mlp", "extra_proj", "w")] = np.zeros((2, 2), np.float32)
    save_tree(str(tmp / "extra"), nest(flat))
    return ["convert", "orbax-to-safetensors", str(tmp / "extra"), str(tmp / "dst"), "--config",
            os.path.join(w["base"], "config.json")], [str(tmp / "extra")]


def c_orbax_corrupt_metadata(w, tmp):
    src = copy(w["orbax"], tmp)
    victims = [os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs if f == "_METADATA"]
    for v in victims:
        with open(v, "w") as f:
            f.write("\x00garbage{")
    return ["convert", "orbax-to-safetensors", src, str(tmp / "dst")], [src]


def c_not_orbax(w, tmp):
    (tmp / "junk").mkdir()
    (tmp / "junk" / "notes.txt").write_text("hello")
    return ["convert", "orbax-to-safetensors", str(tmp / "junk"), str(tmp / "dst")], [str(tmp / "junk")]


def c_o2p_missing_alpha(w, tmp):
    src = copy(w["lora"], tmp)
    for d, _, fs in os.walk(src):
        for f in fs:
            if f == "_CHECKPOINT_METADATA":
                path = os.path.join(d, f)
                with open(path) as fh:
                    meta = json.load(fh)
                meta.pop("custom_metadata", None)
                with open(path, "w") as fh:
                    json.dump(meta, fh)
    return ["convert", "orbax-to-peft", src, str(tmp / "dst"), "--base", w["base"]], [src]


def c_o2p_other_base(w, tmp):
    return ["convert", "orbax-to-peft", w["lora"], str(tmp / "dst"), "--base", w["other"]], [w["lora"], w["other"]]


def c_o2p_missing_base(w, tmp):
    return ["convert", "orbax-to-peft", w["lora"], str(tmp / "dst"), "--base", str(tmp / "nobase")], [w["lora"]]


def c_peft_unknown_type(w, tmp):
    src = adapter_with(w, tmp, peft_type="IA3")
    return p2o(src, w, tmp), [src]


def c_peft_dora(w, tmp):
    src = adapter_with(w, tmp, use_dora=True)
    return p2o(src, w, tmp), [src]


def c_peft_modules_to_save(w, tmp):
    src = adapter_with(w, tmp, modules_to_save=["lm_head"])
    return p2o(src, w, tmp), [src]


def c_peft_other_base(w, tmp):
    return p2o(w["adapter"], w, tmp, base=w["other"]), [w["adapter"], w["other"]]


def c_peft_config_not_json(w, tmp):
    src = copy(w["adapter"], tmp, "adapter")
    with open(os.path.join(src, "adapter_config.json"), "w") as f:
        f.write("{r: 8")
    return p2o(src, w, tmp), [src]


def c_peft_pickle_only(w, tmp):
    src = copy(w["adapter"], tmp, "adapter")
    os.remove(os.path.join(src, "adapter_model.safetensors"))
    with open(os.path.join(src, "adapter_model.bin"), "wb") as f:
        f.write(pickle.dumps(Boom(str(tmp / "unpickled"))))
    return p2o(src, w, tmp), [src]


def c_peft_symlink_out(w, tmp):
    src = copy(w["adapter"], tmp, "adapter")
    outside = tmp / "weights-elsewhere.safetensors"
    shutil.move(os.path.join(src, "adapter_model.safetensors"), outside)
    os.symlink(outside, os.path.join(src, "adapter_model.safetensors"))
    return p2o(src, w, tmp), [src]


def c_peft_a_without_b(w, tmp):
    src = rewrite_adapter(w, tmp, lambda t: {k: v for k, v in t.items()
                                             if not (k.endswith("lora_B.weight") and "layers.0.self_attn.q_proj" in k)})
    return p2o(src, w, tmp), [src]


def c_peft_rank_disagrees(w, tmp):
    src = adapter_with(w, tmp, r=4)
    return p2o(src, w, tmp), [src]


def c_peft_missing_alpha(w, tmp):
    src = adapter_with(w, tmp, lora_alpha=None)
    return p2o(src, w, tmp), [src]


def c_merge_other_base(w, tmp):
    return ["merge", w["other"], w["adapter"], str(tmp / "dst")], [w["adapter"], w["other"]]


def c_merge_dst_exists(w, tmp):
    (tmp / "dst").mkdir()
    return ["merge", w["base"], w["adapter"], str(tmp / "dst")], [w["base"], w["adapter"]]


def c_merge_missing_adapter(w, tmp):
    return ["merge", w["base"], str(tmp / "noadapter"), str(tmp / "dst")], [w["base"]]


def c_merge_truncated_adapter(w, tmp):
    src = copy(w["adapter"], tmp, "adapter")
    path = os.path.join(src, "adapter_model.safetensors")
    os.truncate(path, os.path.getsize(path) - 100)
    return ["merge", w["base"], src, str(tmp / "dst")], [w["base"], src]


def c_merge_truncated_base(w, tmp):
    src = copy(w["base"], tmp)
    path = os.path.join(src, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 7)
    return ["merge", src, w["adapter"], str(tmp / "dst")], [src, w["adapter"]]


def c_inspect_truncated(w, tmp):
    src = copy(w["base"], tmp)
    path = os.path.join(src, "model.safetensors")
    os.truncate(path, 5)
    return ["inspect", src], [src]


def c_inspect_missing(w, tmp):
    return ["inspect", str(tmp / "nothing")], None


def c_verify_tensors_missing(w, tmp):
    return ["verify", "tensors", w["base"], str(tmp / "nothing")], [w["base"]]


def c_verify_logits_not_model(w, tmp):
    (tmp / "plain").mkdir()
    return ["verify", "logits", str(tmp / "plain")], None


CASES = [
    # safetensors files
    ("truncated file", c_truncated, 4, "model.safetensors"),
    ("header length past end of file", c_header_past_end, 4, "model.safetensors"),
    ("header not JSON", c_header_not_json, 4, "model.safetensors"),
    ("header not an object", c_header_not_object, 4, "model.safetensors"),
    ("unknown dtype", c_unknown_dtype, 4, "Q7"),
    ("shape inconsistent with byte range", c_shape_vs_bytes, 4, "model.safetensors"),
    ("overlapping offsets", c_overlap, 4, "model.safetensors"),
    ("offsets past the data", c_out_of_range, 4, "model.safetensors"),
    ("begin after end", c_begin_after_end, 4, "model.safetensors"),
    # sharded directories
    ("index names a missing shard", c_index_missing_shard, 3, "model.safetensors.index.json"),
    ("index path with ../", c_index_dotdot, 4, "../model-00001-of-00002.safetensors"),
    ("index absolute path", c_index_absolute, 4, "/etc/passwd"),
    ("index not JSON", c_index_not_json, 4, "model.safetensors.index.json"),
    ("shard symlinked out of the directory", c_shard_symlink_out, 4, "outside"),
    ("single file symlinked out", c_single_symlink_out, 4, "outside"),
    # model directories
    ("pickle .bin", c_pickle_bin, 5, "pytorch_model.bin"),
    ("pickle .pt", c_pickle_pt, 5, "model.pt"),
    ("missing tensor", c_missing_tensor, 6, "layers.1.mlp.up_proj"),
    ("unexpected tensor", c_unexpected_tensor, 6, "extra_proj"),
    ("wrong shape", c_wrong_shape, 6, "down_proj"),
    ("unknown model_type", c_unknown_model_type, 5, "mixtral"),
    ("config.json not JSON", c_config_not_json, 4, "config.json"),
    ("empty directory", c_empty_dir, 3, "empty"),
    ("missing source", c_missing_src, 3, "nope"),
    # destinations
    ("destination exists", c_dst_exists, 7, "dst"),
    ("destination inside the source", c_dst_inside_src, 7, "inside"),
    ("destination parent is a file", c_dst_parent_is_file, 7, "afile"),
    # orbax-to-safetensors
    ("bad --max-shard-size", c_bad_shard_size, 8, "--max-shard-size"),
    ("Orbax tree missing leaves", c_orbax_missing_leaves, 6, "missing"),
    ("Orbax tree with extra leaves", c_orbax_extra_leaves, 6, "extra_proj"),
    ("Orbax metadata corrupt", c_orbax_corrupt_metadata, 4, "src"),
    ("not an Orbax checkpoint", c_not_orbax, 3, "junk"),
    # orbax-to-peft
    ("LoRA checkpoint without alpha", c_o2p_missing_alpha, 8, "--alpha"),
    ("LoRA checkpoint of another model", c_o2p_other_base, 6, "other"),
    ("missing --base", c_o2p_missing_base, 3, "nobase"),
    # peft-to-orbax
    ("unknown peft_type", c_peft_unknown_type, 5, "IA3"),
    ("DoRA adapter", c_peft_dora, 5, "DoRA"),
    ("modules_to_save", c_peft_modules_to_save, 5, "modules_to_save"),
    ("adapter of another model", c_peft_other_base, 6, "do not fit the base"),
    ("adapter_config.json not JSON", c_peft_config_not_json, 4, "adapter_config.json"),
    ("pickle adapter only", c_peft_pickle_only, 5, "adapter_model.bin"),
    ("adapter weights symlinked out", c_peft_symlink_out, 4, "outside"),
    ("lora_A without lora_B", c_peft_a_without_b, 6, "q_proj"),
    ("config rank disagrees with weights", c_peft_rank_disagrees, 6, "r=4"),
    ("adapter without lora_alpha", c_peft_missing_alpha, 4, "lora_alpha"),
    # merge
    ("merge: adapter of another model", c_merge_other_base, 6, "do not fit the base"),
    ("merge: destination exists", c_merge_dst_exists, 7, "dst"),
    ("merge: missing adapter", c_merge_missing_adapter, 3, "noadapter"),
    ("merge: truncated adapter", c_merge_truncated_adapter, 4, "adapter_model.safetensors"),
    ("merge: truncated base", c_merge_truncated_base, 4, "model.safetensors"),
    # inspect / verify
    ("inspect: truncated file", c_inspect_truncated, 4, "model.safetensors"),
    ("inspect: missing path", c_inspect_missing, 3, "nothing"),
    ("verify tensors: missing side", c_verify_tensors_missing, 3, "nothing"),
    ("verify logits: not a model directory", c_verify_logits_not_model, 3, "plain"),
]


def test_the_table_is_large():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name,make,code,needle", CASES, ids=[c[0] for c in CASES])
def test_bad_input(world, tmp_path, name, make, code, needle):
    argv, sources = make(world, tmp_path)
    sources = sources or []
    before = {s: tree_hash(s) for s in sources}
    dst_existed = os.path.exists(tmp_path / "dst")
    proc = run_cli(*argv)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("ckptbridge: error: "), proc.stderr[-2000:]
    assert needle in lines[0], (needle, lines[0])
    if not dst_existed:
        assert not os.path.exists(tmp_path / "dst")
    leftovers = [n for parent in {tmp_path, *map(os.path.dirname, sources)} for n in os.listdir(parent)
                 if ".ckptbridge-tmp-" in n]
    assert not leftovers
    assert not (tmp_path / "unpickled").exists()  # nothing was unpickled
    for s in sources:
        assert tree_hash(s) == before[s], f"{s} changed"


def test_merge_lora_api_refuses_and_leaves_nothing(world, tmp_path):
    from ckptbridge.errors import CorruptFileError, MismatchError
    from ckptbridge import merge_lora

    argv, _ = c_merge_truncated_adapter(world, tmp_path)
    with pytest.raises(CorruptFileError, match="adapter_model.safetensors"):
        merge_lora(world["base"], argv[2], str(tmp_path / "dst"), progress=False)
    with pytest.raises(MismatchError):
        merge_lora(world["other"], world["adapter"], str(tmp_path / "dst"), progress=False)
    assert not os.path.exists(tmp_path / "dst")
    assert not [n for n in os.listdir(tmp_path) if ".ckptbridge-tmp-" in n]
