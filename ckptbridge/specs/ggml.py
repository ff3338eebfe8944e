"""What a family is in GGUF, the format of ggml's runtimes: its architecture name, the GGUF name of
each HF tensor, the changes ggml's converter makes to values, and the metadata it writes.

A family's :class:`GGUFSpec` is data beside its table of rows (``FamilySpec.gguf``), metadata values
plain ``(type, value)`` pairs; the GGUF format (:mod:`ckptbridge.formats.gguf`) reads only these
fields. The rules follow ggml's own converter
(``convert_hf_to_gguf.py`` with gguf-py 0.19.0): names as gguf-py's ``TensorNameMap`` gives them,
metadata keys in its order, values it derives from the HF config the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

SPM_MODEL = "llama"  # ggml's tokenizer.ggml.model of SentencePiece vocabularies
# ggml's pre-tokenizer names by the regex of a byte-level BPE's tokenizer.json ``Split`` step (a plain
# ``ByteLevel`` pre-tokenizer is GPT-2's, "gpt-2")
_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS: dict[str, str] = {
    _WORDS + r"\p{N}{1,3}" + _REST: "llama-bpe",  # Llama 3: numbers in threes
    _WORDS + r"\p{N}" + _REST: "qwen2",  # Qwen 2, 2.5 and 3: digits one by one
}

# GGUF names of the HF key suffixes most families share (layer tensors after ``layers.{i}.``; a
# family's ``names`` overrides or adds)
COMMON_NAMES: dict[str, str] = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
# Gemma 2-4's four norms per layer
SANDWICH_NAMES: dict[str, str] = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


@dataclasses.dataclass(frozen=True)
class GGUFSpec:
    """A family in GGUF.

    Attributes:
      arch: ``general.architecture`` (ggml's name of the model graph).
      names: HF key suffix (as in the family's rows; layer tensors after ``layers.{i}.``) -> GGUF
        name (layer tensors get ``blk.{i}.`` in front). Experts stored one HF tensor per expert
        (a row's ``{e}`` template) are stacked into the one GGUF tensor named here.
      metadata: ``(text_config, block_count) -> [(key, Value)]``: the family's keys, ``{arch}``
        in a key standing for ``arch``, in the order ggml's converter writes them.
      norm_shift: added to every norm weight (HF suffix ending ``norm.weight``), in float32 (Gemma
        1-3 store ``w`` where ggml computes ``x * w``, HF ``x * (1 + w)``).
      rope_rows: HF suffix -> the config key of its head count: rows reordered from HF's halves
        rotation to ggml's interleaved pairs (Llama), as ggml's converter does.
      extra: ``text_config -> [(GGUF name, float32 values)]``: tensors the converter computes and
        writes first (ggml's ``rope_freqs``), or None.
      tokenizer: the ``tokenizer.ggml.model`` of the family's own byte-fallback BPE tokenizers
        (Gemma 4: ``"gemma4"``), or None.
      visible_tokens: special tokens of that tokenizer the converter marks user-defined (shown
        in text: Gemma 4's channel and tool markers).
      spm_ids: ``tokenizer.ggml.*`` token ids the converter sets with a SentencePiece tokenizer
        (Gemma 1: CodeGemma's end of turn).
      unsupported: ``text_config -> reason or None``: a configuration ggml does not run.
      defaults: ``ModelConfig -> {field: value}``: the values transformers' config class gives
        fields a config.json leaves out (ggml's converter reads the config through it).
    """

    arch: str
    names: Mapping[str, str]
    metadata: Callable[[dict, int], list]
    norm_shift: float = 0.0
    rope_rows: Mapping[str, str] = dataclasses.field(default_factory=dict)
    extra: Callable[[dict], list] | None = None
    tokenizer: str | None = None
    visible_tokens: frozenset[str] = frozenset()
    spm_ids: Mapping[str, int] = dataclasses.field(default_factory=dict)
    unsupported: Callable[[Mapping[str, Any]], str | None] | None = None
    defaults: Callable[[Any], dict] | None = None
    projector: Projector | None = None


@dataclasses.dataclass(frozen=True)
class Projector:
    """A family's towers in ggml's projector file (``mmproj``, architecture ``clip``), as ggml's
    converter writes it with ``--mmproj``: a GGUF file of its own beside the text model's.

    Attributes:
      names: tower -> rule name -> (GGUF name, GGUF layout): ``{i}`` in the name the tower layer;
        the layout, over the rule's axes, the stored tensor's (None: the HF layout; a scalar is
        stored with one axis of 1).
      metadata: ``(cfg, tower configs, processor config) -> [(key, value)]``: the ``clip.*`` keys
        in ggml's order (the processor config: preprocessor_config.json and processor_config.json
        merged, as the converter reads them).
      values: (tower, rule) -> the value change the converter makes (``plus_one``: a norm stored
        as 1 + w; ``softplus``).
      types: (tower, rule) -> the stored type the converter forces: ``f32``, ``f16``, or ``patch``
        (float16 in a float16 file, else float32); every other follows the file's type, but 1-D
        tensors, norms and names not ending ``.weight``, which are float32.
    """

    names: Mapping[str, Mapping[str, tuple[str, str | None]]]
    metadata: Callable[[Any, Mapping[str, Any], Mapping[str, Any]], list]
    values: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)
    types: Mapping[tuple[str, str], str] = dataclasses.field(default_factory=dict)


def clipped(names: Mapping[str, tuple[str, str | None]],
            bounds: tuple[str, ...] = ("input_min", "input_max", "output_min", "output_max")) -> dict:
    """``names`` with the four bounds of each clipped linear (rule ``{rule}_{bound}``, GGUF name
    ``{name without .weight}.{bound}``; a scalar, stored with one axis) beside each weight ending
    ``.weight`` (names of rules a tower does not have are never looked up)."""
    out = dict(names)
    for rule, (name, _) in names.items():
        if name.endswith(".weight"):
            out.update({f"{rule}_{b}": (f"{name[:-len('.weight')]}.{b}", None) for b in bounds})
    return out


def clip_vision_metadata(cfg: Any, vision: Any, image_size: int, processor: Mapping[str, Any]) -> list:
    """The keys ggml's converter writes for every vision tower (``MmprojModel``): the file type's
    place (:data:`FILE_TYPE`), the projection into the text model, the tower's sizes and the image
    normalization of its processor config."""
    v = vision.sizes
    return [(FILE_TYPE, u32(0)), ("clip.has_vision_encoder", ("bool", True)),
            ("clip.vision.projection_dim", u32(cfg.hidden_size)), ("clip.vision.image_size", u32(image_size)),
            ("clip.vision.patch_size", u32(v["y"])), ("clip.vision.embedding_length", u32(v["w"])),
            ("clip.vision.feed_forward_length", u32(v["f"])), ("clip.vision.block_count", u32(vision.num_layers)),
            ("clip.vision.attention.head_count", u32(v["n"])),
            ("clip.vision.image_mean", array(map(float, processor["image_mean"]), "float32")),
            ("clip.vision.image_std", array(map(float, processor["image_std"]), "float32"))]


def clip_audio_metadata(cfg: Any, audio: Any, feed_forward: int) -> list:
    """The keys ggml's converter writes for every audio tower (``MmprojModel``)."""
    return [("clip.has_audio_encoder", ("bool", True)), ("clip.audio.projection_dim", u32(cfg.hidden_size)),
            ("clip.audio.embedding_length", u32(audio.sizes["w"])),
            ("clip.audio.feed_forward_length", u32(feed_forward)), ("clip.audio.block_count", u32(audio.num_layers)),
            ("clip.audio.attention.head_count", u32(audio.sizes["n"]))]


def u32(v: int) -> tuple[str, int]:
    """A GGUF metadata value as data (the GGUF writer stores it): an unsigned 32-bit integer."""
    return ("uint32", int(v))


def f32(v: float) -> tuple[str, float]:
    return ("float32", float(v))


def string(v: str) -> tuple[str, str]:
    return ("string", str(v))


def array(values, item: str) -> tuple[str, tuple[str, list]]:
    """An array of ``item`` values (``"bool"``, ``"int32"``, ...)."""
    return ("array", (item, list(values)))


def text_config(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """The HF config as ggml's converter reads it: ``text_config``'s fields over the top level's."""
    text = hf_config.get("text_config")
    return {**hf_config, **text} if isinstance(text, Mapping) else dict(hf_config)


def first(h: Mapping[str, Any], *keys: str) -> Any:
    """The value of the first of ``keys`` present in ``h`` (None if none is), as the converter's
    ``find_hparam(..., optional=True)``."""
    for k in keys:
        if k in h:
            return h[k]
    return None


def rope_parameters(h: Mapping[str, Any]) -> dict[str, Any]:
    """HF's rope settings in the newer nested form (older configs: ``rope_scaling``, ``rope_theta``,
    ``rope_local_base_freq``)."""
    out = dict(h.get("rope_parameters") or h.get("rope_scaling") or {})
    if "full_attention" not in out and "sliding_attention" not in out:
        local = first(h, "local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                      "rope_local_base_freq")
        if local is not None:
            out["sliding_attention"] = {"rope_theta": local}
        theta = first(h, "global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta", "rotary_emb_base")
        if "rope_theta" not in out and theta is not None:
            out["rope_theta"] = theta
        if "rope_type" not in out and out.get("type") is not None:
            out["rope_type"] = out["type"]
    return out


def base_metadata(h: Mapping[str, Any], block_count: int) -> list[tuple[str, Any]]:
    """The keys every family gets (the converter's ``TextModel.set_gguf_parameters``), without the
    file type (the export adds it in this place: see :data:`FILE_TYPE`)."""

    out: list[tuple[str, Any]] = [("{arch}.block_count", u32(block_count))]
    for key, names in (("{arch}.context_length", ("max_position_embeddings", "n_ctx", "n_positions")),
                       ("{arch}.embedding_length", ("hidden_size", "n_embd")),
                       ("{arch}.feed_forward_length", ("intermediate_size", "n_inner")),
                       ("{arch}.attention.head_count", ("num_attention_heads", "n_head")),
                       ("{arch}.attention.head_count_kv", ("num_key_value_heads", "n_kv_heads"))):
        v = first(h, *names)
        if v is not None:
            out.append((key, u32(v)))
    rope = rope_parameters(h)
    full = rope.get("full_attention", rope)
    kind, factor = full.get("rope_type"), full.get("factor")
    if kind == "linear" and factor is not None:
        out += [("{arch}.rope.scaling.type", string("linear")), ("{arch}.rope.scaling.factor", f32(factor))]
    elif kind == "yarn" and factor is not None:
        out += [("{arch}.rope.scaling.type", string("yarn")), ("{arch}.rope.scaling.factor", f32(factor)),
                ("{arch}.rope.scaling.original_context_length", u32(full["original_max_position_embeddings"]))]
    if full.get("rope_theta") is not None:
        out.append(("{arch}.rope.freq_base", f32(full["rope_theta"])))
    local = rope.get("sliding_attention", {}).get("rope_theta")
    if local is not None:
        out.append(("{arch}.rope.freq_base_swa", f32(local)))
    eps = first(h, "rms_norm_eps", "norm_eps")
    if eps is not None:
        out.append(("{arch}.attention.layer_norm_rms_epsilon", f32(eps)))
    experts = first(h, "num_local_experts", "num_experts")
    if experts is not None:
        out.append(("{arch}.expert_count", u32(experts)))
    used = first(h, "num_experts_per_tok", "num_experts_per_token", "top_k_experts")
    if used is not None:
        out.append(("{arch}.expert_used_count", u32(used)))
    if h.get("head_dim") is not None:
        out += [("{arch}.attention.key_length", u32(h["head_dim"])),
                ("{arch}.attention.value_length", u32(h["head_dim"]))]
    out.append((FILE_TYPE, None))
    return out


FILE_TYPE = "general.file_type"  # placed where the converter writes it; its value depends on the output type


def put(items: list[tuple[str, Any]], key: str, value: Any) -> None:
    """Set ``key`` as gguf-py's writer does when a key is added again: a key already there keeps its
    place and takes the new value; a new one goes at the end."""
    for n, (k, _) in enumerate(items):
        if k == key:
            items[n] = (key, value)
            return
    items.append((key, value))


def interleaved_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q or k projection (or its bias) from HF's rotate-half order to the interleaved
    pairs ggml's graph rotates for Llama: ggml's converter's ``permute``."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def llama3_rope_freqs(h: Mapping[str, Any]) -> list[tuple[str, np.ndarray]]:
    """Llama 3.1's frequency factors (rope type ``llama3``), as ggml's converter computes them."""
    rope = rope_parameters(h)
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return []
    base = float(rope.get("rope_theta", 10000.0))
    dim = h.get("head_dim") or h["hidden_size"] // h["num_attention_heads"]
    freqs = 1.0 / (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    factor, low, high = rope.get("factor", 8.0), rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = h.get("original_max_position_embeddings", 8192)  # the top level's, as the converter reads it
    low_wavelen, high_wavelen = old / low, old / high
    out = []
    for freq in freqs.astype(np.float32):
        wavelen = np.float32(2 * math.pi) / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
            out.append(1 / ((1 - smooth) / np.float32(factor) + smooth))
    return [("rope_freqs.weight", np.asarray(out, dtype=np.float32))]
