"""Tiny random checkpoints of any family and a small tokenizer, built with transformers.

Used by the tests, the main job and the benchmarks: nothing is downloaded. Every weight is
random (norms and layer scalars too, so a swapped or skipped tensor changes the logits), and
each family's tiny config (``FamilySpec.tiny_config``) has dims that are all distinct, so that
a wrong transpose cannot hide behind equal sizes. Requires torch and transformers.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from ckptbridge.specs import DEFAULT_FAMILY, FamilySpec, get_family

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def randomize_(model, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer with random values (norms around 1)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or name.endswith("embed_scale") or "inv_freq" in name:
                continue
            if t.dim() == 0:  # a clipped linear's bounds: wide, so that they clip now and then
                bound = 3.0 + 2.0 * torch.rand((), generator=g)
                t.copy_(-bound if name.endswith("_min") else bound)
            elif name.endswith("layer_scalar"):
                t.copy_(0.5 * torch.rand(t.shape, generator=g) + 0.75)
            elif "norm" in name:
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * (t.shape[-1] ** -0.5))


def keyed_values(key: str, shape, dtype="bfloat16"):
    """Values of a tensor named ``key`` that anyone can make again from the name alone, with
    integer arithmetic (no random generator whose stream could change between numpy versions):
    distinct, signed, of order 1, a different sequence for every name. ``dtype`` is any numpy
    dtype name, bfloat16 included."""
    import zlib

    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
    import numpy as np

    n = int(np.prod(shape, dtype=np.int64))
    i = np.arange(n, dtype=np.int64)
    x = ((i * 2654435761 + zlib.crc32(key.encode())) % 65521 - 32760).astype(np.float32) / 8192
    return x.reshape(tuple(shape)).astype(np.dtype(dtype))


def build_tokenizer(out_dir: str, vocab_size: int, extra: dict[str, str] | None = None) -> None:
    """Train a byte-level BPE tokenizer of ``vocab_size`` tokens with a chat template; save it.
    ``extra``: named special tokens (a multimodal model's: attribute -> token), ids after the text ones."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "module TopModule(input clk, input reset, output reg [7:0] q);",
        "always @(posedge clk) begin if (reset) q <= 8'd0; else q <= q + 1; end endmodule",
        "assign out = a & b | c ^ d; wire [3:0] sum; reg [15:0] shift;",
        "Implement a module named TopModule with the following interface.",
        "The quick brown fox jumps over the lazy dog. 0123456789",
    ] * 20
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    extra = dict(extra or {})
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
        **({"extra_special_tokens": extra} if extra else {}),
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def model_type_for(spec: FamilySpec, prefix: str | None = None, model_type: str | None = None) -> str:
    """The model type to build: given, or the one whose checkpoints use ``prefix``, or the family's first."""
    if model_type is not None:
        return model_type
    if prefix is None:
        return spec.model_types[0]
    for mt in spec.model_types:
        if spec.default_prefixes[mt] == prefix:
            return mt
    raise ValueError(f"family {spec.name}: no model type is saved with prefix {prefix!r}")


def hf_config(family: str = DEFAULT_FAMILY, *, prefix: str | None = None, model_type: str | None = None,
              **overrides: Any) -> dict:
    """The HF config (a dict) of a tiny random model of ``family``; ``overrides`` are text-config fields."""
    spec = get_family(family)
    return spec.tiny_config(model_type_for(spec, prefix, model_type), **overrides)


def build_checkpoint(
    out_dir: str,
    *,
    family: str = DEFAULT_FAMILY,
    prefix: str | None = None,
    model_type: str | None = None,
    dtype: str = "float32",
    shards: int = 1,
    tokenizer: bool = True,
    seed: int = 0,
    **overrides: Any,
) -> str:
    """Save a tiny random model of ``family`` with transformers' ``save_pretrained``.

    The model type is ``model_type``, or the one transformers saves with key ``prefix``
    (``FamilySpec.default_prefixes``), or the family's first. ``shards=2`` splits the weights into two
    files plus an index. ``overrides`` are text-config fields.
    """
    import torch
    import transformers

    spec = get_family(family)
    mt = model_type_for(spec, prefix, model_type)
    cfg = dict(spec.tiny_config(mt, **overrides))
    cfg.pop("architectures", None)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = getattr(transformers, spec.hf_classes[mt])(config)
    randomize_(model, seed)
    model = model.to(getattr(torch, dtype))
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    max_shard = total if shards <= 1 else max(1, total // shards + 1)
    model.save_pretrained(out_dir, max_shard_size=max_shard)
    if tokenizer:
        vocab = getattr(config, "text_config", config).vocab_size
        kind = spec.model_type(mt)
        multimodal = bool(spec.parse_config(cfg | {"model_type": mt}, "tiny").towers)
        build_tokenizer(out_dir, vocab, dict(kind.tiny_tokens) if multimodal else None)
        if multimodal and kind.tiny_processor is not None:
            kind.tiny_processor(out_dir, {"model_type": mt, **cfg})
    return out_dir


def write_random_checkpoint(out_dir: str, *, family: str = DEFAULT_FAMILY, dtype: str = "bfloat16",
                            prefix: str | None = "model.", max_shard_size: int = 5 * 10**9, seed: int = 0,
                            pool: int | None = None, **overrides: Any) -> str:
    """Write an HF checkpoint of any size straight from the spec table (and a multimodal config's
    towers from theirs), without torch.

    Tensors are generated and written one at a time (memory stays at one tensor), so this can
    produce checkpoints of real width for benchmarks. ``overrides`` are text-config fields. With
    ``pool`` = N, every tensor repeats N random values from its own offset instead (written at
    the speed of a copy: for benchmarks whose figures do not depend on the values).
    """
    import numpy as np

    from ckptbridge import mapping
    from ckptbridge.io.safetensors import DTYPES, PlannedTensor, write_sharded

    spec = get_family(family)
    config = {**hf_config(family, prefix=prefix, **overrides), "dtype": dtype}
    cfg = spec.parse_config(config, "config.json")
    np_dtype = {"bfloat16": DTYPES["BF16"], "float32": DTYPES["F32"], "float16": DTYPES["F16"]}[dtype]
    planned = []
    values = None
    if pool:
        values = (np.random.default_rng(seed).standard_normal(2 * pool, dtype=np.float32) * 0.02).astype(np_dtype)
    ents = mapping.entries(cfg, spec, cfg.default_key_prefix) + mapping.tower_entries(cfg, spec, cfg.default_key_prefix)
    for i, e in enumerate(ents):  # (a multimodal config's towers too)
        for j, key in enumerate(e.hf_keys):
            def produce(shape=e.hf_shape, s=seed * 100_003 + i * 7 + j):
                if values is not None:
                    start = s % pool
                    return np.resize(values[start:start + pool], shape)
                rng = np.random.default_rng(s)
                return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np_dtype)

            planned.append(PlannedTensor(key, np_dtype, e.hf_shape, produce))
    os.makedirs(out_dir, exist_ok=True)
    write_sharded(out_dir, planned, max_shard_size)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def lora_targets(family: str = DEFAULT_FAMILY) -> str:
    """A qwix ``module_path`` regex for every LoRA-able module of ``family``."""
    return f".*({'|'.join(get_family(family).lora_targets)})"


def build_tunix_lora(base_dir: str, rules: list[dict] | None = None, *, seed: int = 0, scale: float = 0.3,
                     allow_config_mismatch: bool = False):
    """The Tunix model of ``base_dir`` with qwix LoRA on ``rules`` (default: every LoRA target of its
    family, rank 4, alpha 12) and random non-zero A and B. Returns ``(model, rules)``; needs jax, qwix."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ckptbridge.lora.base import open_base
    from ckptbridge.tunix_model import apply_lora_rules, load_tunix_model

    rules = rules or [{"module_path": lora_targets(open_base(base_dir).spec.name), "rank": 4, "alpha": 12.0}]
    model, _ = load_tunix_model(base_dir, param_dtype=np.float32, skip_multimodal=True,
                                allow_config_mismatch=allow_config_mismatch)
    model = apply_lora_rules(model, rules, seed=seed)
    state = nnx.state(model, nnx.LoRAParam)
    rng = np.random.default_rng(seed)
    pure = jax.tree_util.tree_map(
        lambda x: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32) * scale / np.sqrt(x.shape[0])),
        state.to_pure_dict(),
    )
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model, rules


def save_tunix_lora(model, root: str, step: int = 1, custom_metadata: dict | None = None) -> str:
    """Save the LoRA parameters with Tunix's own CheckpointManager (as its trainer does)."""
    from tunix.sft.checkpoint_manager import CheckpointManager

    manager = CheckpointManager(root)
    manager.save(step, model, save_only_lora_params=True, force=True, custom_metadata=custom_metadata)
    manager.close()
    return root


def build_peft_adapter(base_dir: str, out_dir: str, *, r: int = 4, lora_alpha: float = 10,
                       target_modules: str | list[str] | None = None, seed: int = 0, scale: float = 0.3,
                       **config: Any) -> str:
    """A LoRA adapter made by PEFT itself on the HF base, with random (non-zero) A and B.
    Separate k_proj / v_proj modules get different A, as PEFT training would give them."""
    import torch
    from peft import LoraConfig, get_peft_model

    from ckptbridge.lora.base import open_base
    from ckptbridge.verify import hf_model_class

    b = open_base(base_dir)
    names = sorted({name.rsplit(".", 1)[-1] for m in b.modules for name in m.hf_modules})
    cls = hf_model_class(base_dir)
    base = cls.from_pretrained(base_dir, dtype=torch.float32)
    target = target_modules or rf"{re.escape(b.module_prefix)}layers\.\d+\..*\.({'|'.join(names)})"
    cfg = LoraConfig(r=r, lora_alpha=lora_alpha,  # type: ignore[arg-type]  # PEFT takes a float alpha
                     target_modules=target, task_type="CAUSAL_LM", **config)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale / (p.shape[-1] ** 0.5))
    model.save_pretrained(out_dir)
    return out_dir


def write_random_adapter(base_dir: str, out_dir: str, *, r: int = 8, lora_alpha: float = 16, seed: int = 0,
                         dtype: str = "bfloat16") -> str:
    """A PEFT LoRA adapter on every LoRA-able module of ``base_dir``, written from the spec table
    without torch (for benchmarks at real width)."""
    import numpy as np

    from ckptbridge.formats import peft
    from ckptbridge.io.safetensors import DTYPES, PlannedTensor, write_file
    from ckptbridge.lora.base import open_base

    base = open_base(base_dir)
    np_dtype = {"bfloat16": DTYPES["BF16"], "float32": DTYPES["F32"]}[dtype]
    tensors, names = [], []
    for i, mod in enumerate(base.modules):
        shapes = mod.shapes(r)
        for j, name in enumerate(mod.hf_modules):
            names.append(name)
            for ab, shape in (("A", shapes["a_peft"]), ("B", shapes["b_peft"])):
                def produce(shape=shape, s=seed * 1_000_003 + i * 17 + j * 2 + (ab == "B")):
                    return (np.random.default_rng(s).standard_normal(shape, dtype=np.float32) * 0.01).astype(np_dtype)

                tensors.append(PlannedTensor(f"{peft.PEFT_PREFIX}{name}.lora_{ab}.weight", np_dtype, shape, produce))
    os.makedirs(out_dir, exist_ok=True)
    write_file(os.path.join(out_dir, peft.ADAPTER_WEIGHTS), tensors)
    peft.export_config(base, names, r, lora_alpha, {}, {}).write(out_dir)
    return out_dir


def fill_hub_cache(cache_dir: str, repo_id: str, src_dir: str, *, revision: str = "main",
                   commit: str | None = None) -> str:
    """Put the files of ``src_dir`` into a Hugging Face cache at ``cache_dir`` as repository
    ``repo_id`` at ``revision``, in the Hub's own layout (``blobs/<sha256>``, ``snapshots/<commit>/``
    links to them, ``refs/<revision>``), as ``hf download`` leaves it. Returns the snapshot folder."""
    import hashlib
    import shutil

    repo = os.path.join(cache_dir, "models--" + repo_id.replace("/", "--"))
    commit = commit or hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    snapshot = os.path.join(repo, "snapshots", commit)
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if not os.path.isfile(path):
            continue
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        blob = os.path.join(repo, "blobs", h.hexdigest())
        if not os.path.exists(blob):
            shutil.copyfile(path, blob)
        os.makedirs(snapshot, exist_ok=True)
        os.symlink(os.path.relpath(blob, snapshot), os.path.join(snapshot, name))
    with open(os.path.join(repo, "refs", revision), "w") as f:
        f.write(commit)
    return snapshot


# The conversions whose outputs must not depend on the environment (tests/test_environments.py,
# scripts/compat_check.py): name, CLI arguments ({out}: this step's output; {name}: an earlier
# step's; {base}, {bf16}, {lora}, {peft}: the inputs of :func:`build_compat_inputs`).
COMPAT_STEPS = (
    ("s2o", ("convert", "safetensors-to-orbax", "{bf16}", "{out}", "--chunk-size", "16KiB",
             "--tunix-version", "0.1.7")),
    ("o2s", ("convert", "orbax-to-safetensors", "{s2o}", "{out}", "--max-shard-size", "200KB")),
    ("o2p", ("convert", "orbax-to-peft", "{lora}", "{out}", "--base", "{base}")),
    ("o2p_vllm", ("convert", "orbax-to-peft", "{lora}", "{out}", "--base", "{base}", "--target", "vllm")),
    ("p2o", ("convert", "peft-to-orbax", "{peft}", "{out}", "--base", "{base}")),
    ("merge_orbax", ("merge", "{base}", "{lora}", "{out}")),
    ("merge_peft", ("merge", "{base}", "{peft}", "{out}")),
)


def build_compat_inputs(root: str) -> dict[str, str]:
    """The inputs of :data:`COMPAT_STEPS` under ``root``: a float32 and a bfloat16 tiny base, a
    Tunix/qwix LoRA checkpoint saved by Tunix, a PEFT adapter made by PEFT. Needs the verify extra."""
    base = build_checkpoint(os.path.join(root, "base"), attention_k_eq_v=True, prefix="model.language_model.",
                            dtype="float32", shards=2, seed=0)
    bf16 = build_checkpoint(os.path.join(root, "bf16"), attention_k_eq_v=False, prefix="model.language_model.",
                            dtype="bfloat16", shards=2, seed=3)
    model, rules = build_tunix_lora(base, seed=4)
    lora = save_tunix_lora(model, os.path.join(root, "tunix_lora"), step=2, custom_metadata={
        "ckptbridge": {"kind": "lora", "family": DEFAULT_FAMILY, "lora": {"rules": rules}}})
    peft = build_peft_adapter(base, os.path.join(root, "peft"), r=4, lora_alpha=8, seed=5)
    return {"base": base, "bf16": bf16, "lora": lora, "peft": peft}


def output_digest(path: str) -> dict:
    """What must not depend on the environment: every file's bytes for an HF model or PEFT
    adapter (a model card's framework versions aside: they name the installed PEFT, as PEFT's
    own cards do); every array's bytes, dtype and shape, and the metadata, for an Orbax
    checkpoint (whose files are Orbax's own and differ between its releases and writers)."""
    import hashlib

    from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint

    names = os.listdir(path)
    if "_METADATA" in names or any(n.isdigit() for n in names):
        with OrbaxCheckpoint(resolve_checkpoint(path)) as ck:
            arrays = ck.read(list(ck.leaves))
            return {"metadata": ck.custom_metadata,
                    "leaves": {"/".join(p): [str(a.dtype), list(a.shape), hashlib.sha256(a.tobytes()).hexdigest()]
                               for p, a in arrays.items()}}
    out = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                data = f.read()
            if name == "README.md":
                data = re.sub(rb"\n- PEFT [^\n]*", b"", data)
            out[os.path.relpath(os.path.join(dirpath, name), path)] = hashlib.sha256(data).hexdigest()
    return dict(sorted(out.items()))


def run_compat_steps(python: str, inputs: dict[str, str], root: str, *, env: dict | None = None) -> dict[str, dict]:
    """Run :data:`COMPAT_STEPS` through ``python -m ckptbridge`` into ``root``; their digests.
    Raises RuntimeError naming the step whose command failed."""
    import subprocess

    paths = dict(inputs)
    for name, argv in COMPAT_STEPS:
        paths["out"] = os.path.join(root, name)
        r = subprocess.run([python, "-m", "ckptbridge", *[a.format(**paths) for a in argv], "--quiet"],
                           capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
        if r.returncode != 0:
            raise RuntimeError(f"{name} ({python}): exit {r.returncode}: {r.stderr.strip()[-2000:]}")
        paths[name] = paths["out"]
    return {name: output_digest(paths[name]) for name, _ in COMPAT_STEPS}
