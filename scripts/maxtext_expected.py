"""MaxText <-> Hugging Face checkpoint layout expectations, computed with MaxText's own mapping code.

Loads MaxText's `param_mapping.py` (PARAM_MAPPING / HOOK_FNS), `hf_shape.py` (HF_SHAPE) and
`tensor_handling.py` (apply_hook_fns) from a MaxText source tree and calls them for tiny configs of the
families ckptbridge will convert (Qwen3 dense and MoE, Qwen2.5, Llama 3.1, Gemma 2/3/4, Gemma 4 small),
each with scan_layers True and False where MaxText supports it. For every MaxText key it writes:

- `hf`: the HF key(s) exactly as the mapping gives them (str; list over layers or experts; nested list);
- `hooks_to_maxtext` / `hooks_to_hf`: names of the hook functions MaxText applies, in order
  (`saving_to_hf=False` / `True`); `hf_composite` when to_huggingface fuses several MaxText keys into one
  HF tensor through a tuple hook key (Gemma 4 MoE `wi_0` + `wi_1` -> `experts.gate_up_proj`);
- `maxtext_shape`: the stacked MaxText tensor, built from zero HF tensors of `hf_shape` by MaxText's hooks
  and a copy of to_maxtext.py's stacking (`_get_hf_loading_function`, `_build_single_axis_stacked_tensor`,
  `_build_multi_axis_stacked_tensor`), and checked by slicing it back and applying the to_huggingface hooks
  as `utils.process_maxtext_param` does (the result must have `hf_shape` from MaxText's HF_SHAPE);
- `hf_shape`: the shape of one HF tensor of the key (all tensors stacked into one key have the same shape);
- `mt_from` (absent: `declared`): where the per-layer (per-slice) MaxText shape comes from. to_maxtext takes it
  from MaxText's abstract model, which needs MaxText's model code (Python >= 3.12, flax, its configs) and is not built
  here. `hooks`: MaxText's to_maxtext hooks produce it without being told a target shape (expert
  transposes, fused gate/up splits); `identity`: no hook, so to_maxtext copies the HF tensor and the
  MaxText tensor has the HF shape; `declared`: the hooks reshape into a target shape, taken from this
  script's `declared_slice_shape` (Linen `DenseGeneral` kernel = in_shape + out_shape: query (E, H, D),
  key/value (E, K, D), out (H, D, E), other 2-D kernels (in, out), q/k/v biases (heads, D), embedding
  (MaxText vocab, E), norms and scalars as in HF); only the element count is then checked by MaxText code.
- `dtype` (only where a hook changes it): output dtype per input dtype (bfloat16 via ml_dtypes, float32), per
  direction: to_maxtext on NumPy arrays (its eager path, whose getter casts HF tensors to `--save_dtype`, bfloat16
  by default, before the hooks, and saves the hooks' output as it is), to_huggingface on JAX arrays (it restores
  the checkpoint as `weight_dtype` and casts its output to `weight_dtype` afterwards).
- `sha256_to_maxtext`: sha256 of the stacked MaxText tensor that to_maxtext's hooks and stacking make from bf16 HF
  tensors whose values follow from their names (`ckptbridge.testing.keyed_values`), as the eager path loads them;
  `sha256_to_hf`: of the HF tensors (bytes in `hf` order) that to_huggingface with `weight_dtype=bfloat16` makes
  from that MaxText tensor (restored as bf16, hooks, cast to bf16, reshaped to the HF shape);
- `sha256_to_hf_f32` (only where to_maxtext widened the dtype: Gemma 2/3 norms): of the HF tensors that
  to_huggingface with `weight_dtype=float32` makes (restored as stored, so the norm is not rounded to bf16
  before 1 is taken off), cast to bf16;
- `hf_reshaped` (only where true): to_huggingface's hooks give another shape of the same size and
  `_process` reshapes the result to the HF shape.

The JSON: `maxtext_commit`, `versions` (of the libraries the hooks ran with), `unsupported` (row -> the error
MaxText's mapping raises: Gemma 4 small has no scanned form) and `rows`, each `<family>/<scanned|unscanned>` ->
`scan_layers`, `maxtext_model` (the PARAM_MAPPING entry), `maxtext_config`, `hf_config`, `keys` (above).

Which mapping keys exist in the MaxText model is decided, as `validate_and_filter_param_map_keys` does
against the abstract model, from the row's `maxtext_config`: vision keys only in the multimodal rows
(`use_multimodal` true: Gemma 3's SigLIP tower, Gemma 4 31B's and 26B's vision tower, whose per-layer
MaxText shapes are declared from MaxText's vision encoders: attention kernels [in, heads, hidden /
heads] and biases [heads, hidden / heads], the output [heads, hidden / heads, out], 2-D kernels
[in, out]), `logits_dense` only without `logits_via_embedding`, q/k/v biases only with `attention_bias`,
q/k norms only with `use_qk_norm`. The MaxText config object the mapping functions read is a namespace
with the attributes they use (`param_scan_axis` 1, `share_kv_projections`, `v_norm_with_scale`,
`use_multimodal`, `weight_dtype`), valued as in MaxText's base.yml and the family's model yml. HF configs
are built with the transformers config classes and passed as `.to_dict()`, as to_maxtext.py does with
`hf_model_configs.HF_MODEL_CONFIGS[model].to_dict()`.

No stubs are needed: param_mapping.py imports only warnings, numpy and jax; hf_shape.py nothing;
tensor_handling.py functools, typing and jax.

Generated against AI-Hypercomputer/maxtext @ e591f30cbbf217ed67ef71263ec0538239f9c3b8 with:

    git --git-dir=<maxtext.git> show HEAD:src/maxtext/checkpoint_conversion/utils/param_mapping.py \
        > /tmp/maxtext_src/param_mapping.py      # likewise hf_shape.py and tensor_handling.py
    JAX_PLATFORMS=cpu .venv/bin/python scripts/maxtext_expected.py --maxtext /tmp/maxtext_src \
        --commit e591f30cbbf217ed67ef71263ec0538239f9c3b8 --out tests/data/maxtext/expected.json

`--maxtext` also accepts a MaxText checkout (its root or its `src` directory); `--commit` is then read
with git when not given.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ckptbridge.testing import keyed_values  # noqa: E402

MODULES = ("param_mapping", "hf_shape", "tensor_handling")
UTILS_SUBDIRS = ("", "maxtext/checkpoint_conversion/utils", "src/maxtext/checkpoint_conversion/utils")
PARAM_SCAN_AXIS = 1  # base.yml
WEIGHT_DTYPE = "float32"  # base.yml
DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}

Shape = tuple[int, ...]
HfValue = Any  # str | list[str] | list[list[str]], as the mapping gives it


# --------------------------------------------------------------------------------------------------
# Loading MaxText's modules


def find_utils_dir(root: Path) -> Path:
    for sub in UTILS_SUBDIRS:
        d = root / sub if sub else root
        if all((d / f"{m}.py").is_file() for m in MODULES):
            return d
    raise SystemExit(f"{root}: no {', '.join(m + '.py' for m in MODULES)} (nor under {UTILS_SUBDIRS[1:]})")


def load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"maxtext_ref_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def git_commit(root: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


# --------------------------------------------------------------------------------------------------
# Rows: tiny HF configs and the MaxText settings that go with them

# hidden, heads, kv heads, head_dim, mlp, vocab, experts, moe mlp
E, H, K, D, F, V, X, FM = 40, 4, 2, 12, 56, 300, 5, 18
GLOBAL_D, GLOBAL_K = 20, 1  # Gemma 4 global layers
X_GEMMA4 = 3  # not 5: a Gemma 4 block has 5 local layers, a dimension of the scanned MoE tensors
LOCAL, GLOBAL = "sliding_attention", "full_attention"


@dataclass
class Row:
    family: str
    model: str  # MaxText model name: the PARAM_MAPPING / HOOK_FNS / HF_SHAPE entry used
    hf_config: Callable[[], dict[str, Any]]
    scans: tuple[bool, ...] = (True, False)
    logits_via_embedding: bool = True
    attention_bias: bool = False
    use_qk_norm: bool = True
    share_kv_projections: bool = False
    v_norm_with_scale: bool = False
    maxtext_vocab: int | None = None  # MaxText vocab_size when it differs from HF's (Gemma 2 pads)
    multimodal: bool = False  # use_multimodal: the vision tower's keys too
    notes: list[str] = field(default_factory=list)


def _tf() -> Any:
    import transformers

    return transformers


def qwen3_dense() -> dict[str, Any]:  # like hf_model_configs.qwen3_8b_config
    return _tf().Qwen3Config(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=3,
                             num_attention_heads=H, num_key_value_heads=K, head_dim=D, hidden_act="silu",
                             rms_norm_eps=1e-6, tie_word_embeddings=False).to_dict()


def qwen3_moe() -> dict[str, Any]:  # like hf_model_configs.qwen3_30b_a3b_thinking_2507_config
    return _tf().Qwen3MoeConfig(vocab_size=V, hidden_size=E, intermediate_size=F, moe_intermediate_size=FM,
                                num_hidden_layers=3, num_attention_heads=H, num_key_value_heads=K, head_dim=D,
                                num_experts=X, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=True,
                                hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False).to_dict()


def qwen25() -> dict[str, Any]:  # like hf_model_configs.qwen25_1_5b_config: no head_dim (HF uses E // H)
    return _tf().Qwen2Config(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=3,
                             num_attention_heads=H, num_key_value_heads=K, hidden_act="silu", rms_norm_eps=1e-6,
                             tie_word_embeddings=True, attention_bias=True).to_dict()


def llama31() -> dict[str, Any]:  # like hf_model_configs.llama31_8b_config
    return _tf().LlamaConfig(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=3,
                             num_attention_heads=H, num_key_value_heads=K, head_dim=D, rms_norm_eps=1e-5,
                             attention_bias=False, mlp_bias=False, hidden_act="silu",
                             tie_word_embeddings=False).to_dict()


def gemma2() -> dict[str, Any]:  # like hf_model_configs.gemma2_9b_config; 4 HF layers = 2 MaxText layers
    return _tf().Gemma2Config(vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=4,
                              num_attention_heads=H, num_key_value_heads=K, head_dim=D, query_pre_attn_scalar=D,
                              final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=16).to_dict()


def gemma3() -> dict[str, Any]:  # like hf_model_configs.gemma3_4b_config; 8 layers = one 6-layer block + 2
    text = {"head_dim": D, "hidden_size": E, "intermediate_size": F, "num_attention_heads": H,
            "num_key_value_heads": K, "num_hidden_layers": 8, "query_pre_attn_scalar": D, "rms_norm_eps": 1e-6,
            "sliding_window": 16, "vocab_size": V, "model_type": "gemma3_text", "hidden_activation": "gelu"}
    vision = {"hidden_size": 16, "image_size": 8, "intermediate_size": 24, "num_attention_heads": 2,
              "num_channels": 3, "num_hidden_layers": 1, "patch_size": 4, "model_type": "siglip_vision_model",
              "vision_use_head": False}
    return _tf().Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                              architectures=["Gemma3ForConditionalGeneration"]).to_dict()


def _gemma4_vision() -> dict[str, Any]:
    return {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 8, "patch_size": 4,
            "position_embedding_size": 10, "standardize": True, "model_type": "gemma4_vision"}


def _gemma4(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    base = {"hidden_size": E, "intermediate_size": F, "num_attention_heads": H, "num_key_value_heads": K,
            "head_dim": D, "global_head_dim": GLOBAL_D, "vocab_size": V, "vocab_size_per_layer_input": V,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
            "model_type": "gemma4_text", "sliding_window": 16, "final_logit_softcapping": 30.0}
    return _tf().Gemma4Config(text_config={**base, **text}, vision_config=vision, audio_config=None,
                              tie_word_embeddings=True, architectures=["Gemma4ForConditionalGeneration"]).to_dict()


def gemma4_dense() -> dict[str, Any]:  # like gemma4_31b_dict: k_eq_v globals, 12 layers = 2 blocks
    return _gemma4({"attention_k_eq_v": True, "enable_moe_block": False, "num_experts": None, "top_k_experts": None,
                    "num_global_key_value_heads": GLOBAL_K, "num_hidden_layers": 12,
                    "layer_types": ([LOCAL] * 5 + [GLOBAL]) * 2, "hidden_size_per_layer_input": 0,
                    "num_kv_shared_layers": 0, "use_double_wide_mlp": False}, _gemma4_vision())


def gemma4_moe() -> dict[str, Any]:  # like gemma4_26b_dict: 6 layers = one block
    # No remainder layers: transformers makes a Gemma 4 config's last layer full_attention, so a layer count that is
    # not a multiple of 6 gives HF a global layer where MaxText's 6-layer pattern has a local one.
    return _gemma4({"attention_k_eq_v": True, "enable_moe_block": True, "num_experts": X_GEMMA4, "top_k_experts": 2,
                    "moe_intermediate_size": FM, "num_global_key_value_heads": GLOBAL_K, "num_hidden_layers": 6,
                    "layer_types": [LOCAL] * 5 + [GLOBAL], "hidden_size_per_layer_input": 0,
                    "num_kv_shared_layers": 0, "use_double_wide_mlp": False}, _gemma4_vision())


def gemma4_small() -> dict[str, Any]:  # like gemma4_e2b_dict: period 5, last 4 layers KV-shared, PLE, wide MLP
    # 10 layers: the last is full_attention (as transformers requires) and the KV-shared layers of both kinds have
    # a non-shared layer of their kind to take K/V from.
    vision = {**_gemma4_vision(), "standardize": False}
    return _gemma4({"attention_k_eq_v": False, "enable_moe_block": False, "num_experts": None,
                    "top_k_experts": None, "expert_intermediate_size": None, "num_global_key_value_heads": None,
                    "num_key_value_heads": 1, "num_hidden_layers": 10, "layer_types": ([LOCAL] * 4 + [GLOBAL]) * 2,
                    "hidden_size_per_layer_input": 6, "num_kv_shared_layers": 4, "use_double_wide_mlp": True},
                   vision)


ROWS = [
    Row("qwen3-dense", "qwen3-8b", qwen3_dense, logits_via_embedding=False),
    Row("qwen3-moe", "qwen3-30b-a3b", qwen3_moe, logits_via_embedding=False),
    Row("qwen2.5", "qwen2.5-1.5b", qwen25, attention_bias=True, use_qk_norm=False),
    Row("llama3.1", "llama3.1-8b", llama31, logits_via_embedding=False, use_qk_norm=False),
    Row("gemma2", "gemma2-2b", gemma2, use_qk_norm=False, maxtext_vocab=384,
        notes=["MaxText vocab 384 = HF 300 padded to a multiple of 128, as gemma2-*.yml pads 256000 to 256128"]),
    Row("gemma3", "gemma3-4b", gemma3, multimodal=True),
    Row("gemma4-dense", "gemma4-31b", gemma4_dense, share_kv_projections=True, multimodal=True),
    Row("gemma4-moe", "gemma4-26b", gemma4_moe, share_kv_projections=True, multimodal=True),
    Row("gemma4-small", "gemma4-e2b", gemma4_small),
]


def maxtext_config(row: Row, scan_layers: bool) -> types.SimpleNamespace:
    """The attributes of MaxText's pyconfig that param_mapping.py and the conversion code read."""
    return types.SimpleNamespace(scan_layers=scan_layers, param_scan_axis=PARAM_SCAN_AXIS,
                                 share_kv_projections=row.share_kv_projections,
                                 v_norm_with_scale=row.v_norm_with_scale, use_multimodal=row.multimodal,
                                 weight_dtype=WEIGHT_DTYPE)


def in_maxtext_model(mt_key: str, row: Row) -> bool:
    """Stand-in for the abstract-model check in utils.validate_and_filter_param_map_keys."""
    if mt_key.startswith("params-vision_encoder-"):
        return row.multimodal  # use_multimodal
    if mt_key == "params-decoder-logits_dense-kernel":
        return not row.logits_via_embedding
    if mt_key.endswith(("-query-bias", "-key-bias", "-value-bias")):
        return row.attention_bias
    if mt_key.endswith(("-query_norm-scale", "-key_norm-scale")):
        return row.use_qk_norm
    return True


# --------------------------------------------------------------------------------------------------
# Shapes


class _NoTarget:
    """A target_shape that fails when used: tells hooks that need the MaxText shape from those that don't."""

    def _fail(self, *_: Any, **__: Any) -> Any:
        raise LookupError("target shape used")

    __getitem__ = __iter__ = __len__ = __index__ = __array__ = _fail


def flat_keys(value: HfValue) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, tuple):
        return list(value)
    return [k for v in value for k in flat_keys(v)]


def hf_layer(hf_key: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", hf_key)
    return int(m.group(1)) if m else None


def declared_vision_shape(mt_key: str, hf_shape: Shape, vision_cfg: dict[str, Any]) -> Shape:
    """MaxText shape of a vision tower's key whose to_maxtext hooks reshape into the model's shape
    (gemma3.Encoder1DBlock, gemma4_vision.Gemma4EncoderBlock: heads of hidden / heads, as many kv
    heads as query heads)."""
    heads = vision_cfg["num_attention_heads"]
    if mt_key.endswith(("-query-kernel", "-key-kernel", "-value-kernel")):  # HF (N*H, W) -> (W, N, H)
        return (hf_shape[1], heads, hf_shape[0] // heads)
    if mt_key.endswith("-out-kernel"):  # HF (W, N*H) -> (N, H, W)
        return (heads, hf_shape[1] // heads, hf_shape[0])
    if mt_key.endswith(("-query-bias", "-key-bias", "-value-bias")):  # HF (N*H,) -> (N, H)
        return (heads, hf_shape[0] // heads)
    if mt_key.endswith("-kernel") and len(hf_shape) == 2:  # HF (out, in) -> (in, out)
        return (hf_shape[1], hf_shape[0])
    return hf_shape  # biases, norms, tables


def declared_slice_shape(mt_key: str, hf_key: str, hf_shape: Shape, hf_shapes: dict[str, list[int]],
                         text_cfg: dict[str, Any], mt_vocab: int, vision_cfg: dict[str, Any] | None = None) -> Shape:
    """Per-layer MaxText shape for keys whose to_maxtext hooks reshape into the model's shape."""
    if mt_key.startswith("params-vision_encoder-"):
        assert vision_cfg is not None
        return declared_vision_shape(mt_key, hf_shape, vision_cfg)
    heads = text_cfg["num_attention_heads"]
    layer = hf_layer(hf_key)
    head_dim = None
    if layer is not None:  # this layer's head_dim, from its q_proj (Gemma 4 global layers differ)
        q_key = re.sub(r"\.layers\.\d+\..*$", f".layers.{layer}.self_attn.q_proj.weight", hf_key)
        if q_key in hf_shapes:
            head_dim = hf_shapes[q_key][0] // heads
    if mt_key.endswith("token_embedder-embedding"):
        return (mt_vocab, hf_shape[1])
    if mt_key.endswith("-query-kernel"):  # HF (H*D, E) -> (E, H, D)
        return (hf_shape[1], heads, hf_shape[0] // heads)
    if mt_key.endswith(("-key-kernel", "-value-kernel")):  # HF (K*D, E) -> (E, K, D)
        assert head_dim is not None
        return (hf_shape[1], hf_shape[0] // head_dim, head_dim)
    if mt_key.endswith("-out-kernel"):  # HF (E, H*D) -> (H, D, E)
        return (heads, hf_shape[1] // heads, hf_shape[0])
    if mt_key.endswith("-query-bias"):  # HF (H*D,) -> (H, D)
        return (heads, hf_shape[0] // heads)
    if mt_key.endswith(("-key-bias", "-value-bias")):  # HF (K*D,) -> (K, D)
        assert head_dim is not None
        return (hf_shape[0] // head_dim, head_dim)
    if mt_key.endswith("-kernel") and len(hf_shape) == 2:  # HF (out, in) -> (in, out)
        return (hf_shape[1], hf_shape[0])
    return hf_shape  # norms, scalars


def stacked_shape(value: HfValue, slice_shape: Shape, cfg: types.SimpleNamespace, mt_key: str) -> Shape:
    """The full MaxText shape whose slices to_maxtext's stacking functions fill (the inverse of their
    `mt_slice_shape` computation)."""
    s = list(slice_shape)
    if isinstance(value, str):
        return tuple(s)
    if not isinstance(value[0], list):
        axis = cfg.param_scan_axis if cfg.scan_layers else 0
        s.insert(axis, len(value))
        return tuple(s)
    outer = cfg.param_scan_axis if "scanned_blocks-local_layers" in mt_key else 0
    s[outer:outer] = [len(value), len(value[0])]
    return tuple(s)


# --------------------------------------------------------------------------------------------------
# to_maxtext.py, copied: how HF tensors are hooked and stacked into one MaxText tensor


def _source(key: Any, tensor_getter: Callable) -> Any:
    """The HF tensor of ``key``, or a tuple of the tensors of a tuple of keys (a hook that fuses
    several, as to_maxtext's loaders read them)."""
    if isinstance(key, (list, tuple)):
        return tuple(tensor_getter(k) for k in key)
    return tensor_getter(key)


class ToMaxText:
    def __init__(self, apply_hook_fns: Callable[..., Any], cfg: types.SimpleNamespace) -> None:
        self.apply_hook_fns = apply_hook_fns
        self.config = cfg

    def build_multi_axis_stacked_tensor(self, hf_source_keys: list[list[str]], tensor_getter_fn: Callable,
                                        hook_fns: Any, target_shape: Shape, mt_key: str) -> np.ndarray:
        """to_maxtext._build_multi_axis_stacked_tensor"""
        if isinstance(mt_key, str) and "scanned_blocks-local_layers" in mt_key:
            outer_axis, inner_axis = self.config.param_scan_axis, self.config.param_scan_axis + 1
        else:
            outer_axis, inner_axis = 0, 1
        stacked_axes = {outer_axis, inner_axis}
        mt_slice_shape = tuple(d for i, d in enumerate(target_shape) if i not in stacked_axes)
        all_outer_tensors = []
        for inner_keys in hf_source_keys:
            inner_tensors = []
            for hf_key_single in inner_keys:
                inner_tensors.append(self.apply_hook_fns(_source(hf_key_single, tensor_getter_fn), mt_slice_shape,
                                                         hook_fns))
            all_outer_tensors.append(np.stack(inner_tensors, axis=0))
        stacked = np.stack(all_outer_tensors, axis=0)
        if (outer_axis, inner_axis) != (0, 1):
            stacked = np.moveaxis(stacked, (0, 1), (outer_axis, inner_axis))
        return stacked

    def build_single_axis_stacked_tensor(self, hf_source_keys: list[str], tensor_getter_fn: Callable,
                                         hook_fns: Any, target_shape: Shape) -> np.ndarray:
        """to_maxtext._build_single_axis_stacked_tensor"""
        axis_to_stack = self.config.param_scan_axis if self.config.scan_layers else 0
        mt_slice_shape_list = list(target_shape)
        del mt_slice_shape_list[axis_to_stack]
        mt_slice_shape = tuple(mt_slice_shape_list)
        tensors_to_stack = []
        for hf_key_single in hf_source_keys:
            tensors_to_stack.append(self.apply_hook_fns(_source(hf_key_single, tensor_getter_fn), mt_slice_shape,
                                                        hook_fns))
        return np.stack(tensors_to_stack, axis=axis_to_stack)

    def load(self, hf_source_keys_or_key: HfValue, tensor_getter: Callable, hook_fn: Any, target_shape: Shape,
             mt_key: str) -> np.ndarray:
        """to_maxtext._get_hf_loading_function, called at once (eager mode)"""
        if not isinstance(hf_source_keys_or_key, list):
            return self.apply_hook_fns(_source(hf_source_keys_or_key, tensor_getter), target_shape, hook_fn)
        if not isinstance(hf_source_keys_or_key[0], list):
            return self.build_single_axis_stacked_tensor(hf_source_keys_or_key, tensor_getter, hook_fn, target_shape)
        return self.build_multi_axis_stacked_tensor(hf_source_keys_or_key, tensor_getter, hook_fn, target_shape,
                                                    mt_key)


# --------------------------------------------------------------------------------------------------
# utils.process_maxtext_param (to_huggingface), copied without the final dtype cast


def to_hf_slices(maxtext_param_key: str | tuple[str, ...], maxtext_param_weight: Any, hf_target_paths: HfValue,
                 cfg: types.SimpleNamespace) -> list[tuple[str, Any]]:
    """(hf_path, MaxText slice) pairs, sliced as utils.process_maxtext_param does."""
    if not isinstance(hf_target_paths, list):
        return [(hf_target_paths, maxtext_param_weight)]

    def index(x: Any, i: int, axis: int) -> Any:
        if isinstance(x, list):
            return [jax.lax.index_in_dim(w, i, axis=axis, keepdims=False) for w in x]
        return jax.lax.index_in_dim(x, i, axis=axis, keepdims=False)

    if not isinstance(hf_target_paths[0], list):
        axis_to_slice = cfg.param_scan_axis if cfg.scan_layers else 0
        return [(p, index(maxtext_param_weight, i, axis_to_slice)) for i, p in enumerate(hf_target_paths)]
    key_str = maxtext_param_key[0] if isinstance(maxtext_param_key, tuple) else maxtext_param_key
    if isinstance(key_str, str) and "scanned_blocks-local_layers" in key_str:
        outer_axis_to_slice = inner_axis_to_slice = cfg.param_scan_axis
    else:
        outer_axis_to_slice = inner_axis_to_slice = 0
    out = []
    for outer_idx, inner_paths in enumerate(hf_target_paths):
        outer_slice = index(maxtext_param_weight, outer_idx, outer_axis_to_slice)
        for inner_idx, hf_path in enumerate(inner_paths):
            out.append((hf_path, index(outer_slice, inner_idx, inner_axis_to_slice)))
    return out


# --------------------------------------------------------------------------------------------------
# One row


def digest(x: Any) -> str:
    """sha256 of an array's bytes (C order, its dtype)."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()


def hook_names(hooks: Any) -> list[str]:
    if hooks is None:
        return []
    return [h.__name__ for h in (hooks if isinstance(hooks, list) else [hooks])]


def dtype_name(x: Any) -> str:
    return np.dtype(x.dtype).name


def uniform_hf_shape(value: HfValue, hf_shapes: dict[str, list[int]], mt_key: str) -> Shape:
    keys = flat_keys(value)
    missing = [k for k in keys if k not in hf_shapes]
    if missing:
        raise ValueError(f"{mt_key}: HF keys not in MaxText's HF_SHAPE: {missing[:3]}")
    shapes = {tuple(hf_shapes[k]) for k in keys}
    if len(shapes) != 1:
        raise ValueError(f"{mt_key}: HF tensors of different shapes stacked: {shapes}")
    return shapes.pop()


def build_row(mx: dict[str, types.ModuleType], row: Row, scan_layers: bool) -> dict[str, Any]:
    pm, hs, th = mx["param_mapping"], mx["hf_shape"], mx["tensor_handling"]
    hf_config = row.hf_config()
    cfg = maxtext_config(row, scan_layers)
    text_cfg = hf_config.get("text_config") or hf_config
    mt_vocab = row.maxtext_vocab or text_cfg["vocab_size"]

    param_map = pm.PARAM_MAPPING[row.model](hf_config, cfg, scan_layers)
    hooks_mt = pm.HOOK_FNS[row.model](hf_config, cfg, scan_layers, saving_to_hf=False)
    hooks_hf = pm.HOOK_FNS[row.model](hf_config, cfg, scan_layers, saving_to_hf=True)
    hf_shapes = hs.HF_SHAPE[row.model](hf_config)

    mt_keys = [k for k in param_map if isinstance(k, str) and in_maxtext_model(k, row)]
    to_mt = ToMaxText(th.apply_hook_fns, cfg)
    keys: dict[str, dict[str, Any]] = {}
    mt_arrays: dict[str, Shape] = {}
    mt_values: dict[str, np.ndarray] = {}
    for mt_key in mt_keys:
        value = param_map[mt_key]
        hooks = hooks_mt.get(mt_key)
        hf_shape = uniform_hf_shape(value, hf_shapes, mt_key)
        first_key = flat_keys(value)[0]
        if hooks is None:
            slice_shape, source = hf_shape, "identity"
        else:
            try:
                probe = th.apply_hook_fns(np.zeros(hf_shape, np.float32), _NoTarget(), hooks)
                slice_shape, source = tuple(probe.shape), "hooks"
            except (LookupError, TypeError, ValueError):
                slice_shape = declared_slice_shape(mt_key, first_key, hf_shape, hf_shapes, text_cfg, mt_vocab,
                                                   hf_config.get("vision_config"))
                source = "declared"
        target = stacked_shape(value, slice_shape, cfg, mt_key)
        out_dtypes = {}
        for name, dt in DTYPES.items():
            arr = to_mt.load(value, lambda k, dt=dt: np.zeros(hf_shapes[k], dt), hooks, target, mt_key)
            if tuple(arr.shape) != target:  # to_maxtext raises on this
                raise ValueError(f"{row.family}: {mt_key}: built {arr.shape}, expected {target}")
            out_dtypes[name] = dtype_name(arr)
        keys[mt_key] = {"hf": value, "hooks_to_maxtext": hook_names(hooks), "hooks_to_hf": [],
                        "maxtext_shape": list(target), "hf_shape": list(hf_shape)}
        # the values: bf16 HF tensors from their names (keyed_values), through to_maxtext's hooks
        values = to_mt.load(value, lambda k: keyed_values(k, hf_shapes[k]), hooks, target, mt_key)
        keys[mt_key]["sha256_to_maxtext"] = digest(values)
        mt_values[mt_key] = values
        if source != "declared":
            keys[mt_key]["mt_from"] = source
        if any(out != name for name, out in out_dtypes.items()):
            keys[mt_key].setdefault("dtype", {})["to_maxtext"] = out_dtypes
        mt_arrays[mt_key] = target

    # to_huggingface._get_model_mappings: tuple hook keys replace their members in the mapping
    hf_map: dict[Any, HfValue] = dict(param_map)
    for hook_key in list(hooks_hf):
        if isinstance(hook_key, tuple) and hf_map.get(hook_key[0]) is not None:
            hf_map[hook_key] = hf_map[hook_key[0]]
            for k in hook_key:
                hf_map.pop(k, None)
    # utils.validate_and_filter_param_map_keys against the keys of the MaxText checkpoint
    present = set(mt_arrays)
    hf_keys = [k for k in hf_map if (isinstance(k, str) and k in present)
               or (isinstance(k, tuple) and all(m in present for m in k))]
    covered = {m for k in hf_keys for m in (k if isinstance(k, tuple) else (k,))}
    if covered != present:
        raise ValueError(f"{row.family}: to_huggingface leaves MaxText keys unconverted: {present - covered}")
    for key in hf_keys:
        members = list(key) if isinstance(key, tuple) else [key]
        hooks = hooks_hf.get(key)
        out_dtypes, reshaped = {}, False
        for name, dt in DTYPES.items():
            weight = [jnp.zeros(mt_arrays[m], dt) for m in members]
            for hf_path, piece in to_hf_slices(key, weight if isinstance(key, tuple) else weight[0], hf_map[key], cfg):
                hf_shape = tuple(hf_shapes[hf_path])
                out = th.apply_hook_fns(piece, hf_shape, hooks) if hooks else piece
                if tuple(out.shape) != hf_shape:
                    if int(np.prod(out.shape)) != int(np.prod(hf_shape)):
                        raise ValueError(f"{row.family}: {key} -> {hf_path}: {out.shape} vs HF {hf_shape}")
                    reshaped = True  # utils._process reshapes to the HF shape
                out_dtypes[name] = dtype_name(out)
        # to_huggingface with weight_dtype bfloat16 on the tensor to_maxtext made: hooks, cast, reshape
        pieces = [jnp.asarray(mt_values[m], dtype=jnp.bfloat16) for m in members]  # restored as weight_dtype
        back = b""
        for hf_path, piece in to_hf_slices(key, pieces if isinstance(key, tuple) else pieces[0], hf_map[key], cfg):
            out = th.apply_hook_fns(piece, tuple(hf_shapes[hf_path]), hooks) if hooks else piece
            back += np.asarray(out.astype(jnp.bfloat16)).reshape(hf_shapes[hf_path]).tobytes()
        # where to_maxtext widened the dtype (Gemma 2/3 norms +1 give float32): to_huggingface with
        # weight_dtype float32 (restored as stored, no rounding before the hooks), cast to bf16 after
        widened = any(mt_values[m].dtype != np.dtype(ml_dtypes.bfloat16) for m in members)
        back32 = b""
        if widened:
            pieces32 = [jnp.asarray(mt_values[m], dtype=jnp.float32) for m in members]
            for hf_path, piece in to_hf_slices(key, pieces32 if isinstance(key, tuple) else pieces32[0], hf_map[key],
                                               cfg):
                out = th.apply_hook_fns(piece, tuple(hf_shapes[hf_path]), hooks) if hooks else piece
                back32 += np.asarray(out.astype(jnp.float32)).astype(ml_dtypes.bfloat16).reshape(
                    hf_shapes[hf_path]).tobytes()
        for m in members:
            entry = keys[m]
            entry["sha256_to_hf"] = hashlib.sha256(back).hexdigest()
            if widened:
                entry["sha256_to_hf_f32"] = hashlib.sha256(back32).hexdigest()
            entry["hooks_to_hf"] = hook_names(hooks)
            if isinstance(key, tuple):
                entry["hf_composite"] = members
            if reshaped:
                entry["hf_reshaped"] = True
            if any(out != name for name, out in out_dtypes.items()):
                entry.setdefault("dtype", {})["to_hf"] = out_dtypes

    mt_cfg = {k: v for k, v in vars(cfg).items()}
    mt_cfg.update(logits_via_embedding=row.logits_via_embedding, attention_bias=row.attention_bias,
                  use_qk_norm=row.use_qk_norm, vocab_size=mt_vocab)
    out_row: dict[str, Any] = {"scan_layers": scan_layers, "maxtext_model": row.model, "maxtext_config": mt_cfg,
                               "hf_config": hf_config, "keys": keys}
    if row.notes:
        out_row["notes"] = row.notes
    return out_row


# --------------------------------------------------------------------------------------------------
# Output


def dump(doc: dict[str, Any]) -> str:
    """JSON with one line per MaxText key (indent at most 1)."""
    c = lambda x: json.dumps(x, separators=(",", ":"), ensure_ascii=False)
    lines = ["{"]
    top = [(k, v) for k, v in doc.items() if k != "rows"]
    for k, v in top:
        lines.append(f" {c(k)}:{c(v)},")
    lines.append(' "rows":{')
    rows = list(doc["rows"].items())
    for ri, (name, row) in enumerate(rows):
        lines.append(f" {c(name)}:{{")
        for k, v in row.items():
            if k != "keys":
                lines.append(f" {c(k)}:{c(v)},")
        lines.append(' "keys":{')
        items = list(row["keys"].items())
        for ki, (mk, mv) in enumerate(items):
            lines.append(f" {c(mk)}:{c(mv)}" + ("," if ki < len(items) - 1 else ""))
        lines.append(" }}" + ("," if ri < len(rows) - 1 else ""))
    lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--maxtext", required=True, type=Path,
                    help="directory with param_mapping.py, hf_shape.py, tensor_handling.py, or a MaxText checkout")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--commit", help="MaxText commit the files come from (default: git rev-parse HEAD in --maxtext)")
    args = ap.parse_args(argv)

    utils_dir = find_utils_dir(args.maxtext)
    mx = {m: load_module(m, utils_dir / f"{m}.py") for m in MODULES}
    commit = args.commit or git_commit(args.maxtext)
    if not commit:
        raise SystemExit("--commit is needed: --maxtext is not a git checkout")

    rows: dict[str, Any] = {}
    unsupported: dict[str, str] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pad/truncate notices from the embedding hooks
        for row in ROWS:
            for scan in row.scans:
                name = f"{row.family}/{'scanned' if scan else 'unscanned'}"
                try:
                    rows[name] = build_row(mx, row, scan)
                except NotImplementedError as e:  # MaxText's mapping refuses this combination
                    unsupported[name] = f"{type(e).__name__}: {e}"
                print(f"{name}: {len(rows[name]['keys']) if name in rows else unsupported[name]}", file=sys.stderr)

    import transformers

    versions = {"transformers": transformers.__version__, "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__,
                "jax": jax.__version__}
    doc = {"maxtext_commit": commit, "generator": "scripts/maxtext_expected.py", "versions": versions,
           "unsupported": unsupported, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dump(doc))
    json.loads(args.out.read_text())  # well-formed
    print(f"{args.out}: {args.out.stat().st_size} bytes, {len(rows)} rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
