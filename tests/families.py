"""The family contract suite's one table: every tiny checkpoint the contract runs on, one row each.

A row is a checkpoint that ``ckptbridge.testing.build_checkpoint`` builds (``build``: family, model
type or key prefix, dtype, number of files, text-config fields), what it must give (``prefix``: the
key prefix found on disk and written back), and which guarantees of the contract run on it
(``checks``). The contract tests (tests/test_contract.py, tests/test_contract_lora.py) are
parametrized over these rows; conftest's ``checkpoints`` fixture builds a row's checkpoint the first
time a test asks for it (once per session, with a seed derived from the row's name), and the other
test files use the same fixture by row name.

The checks:

- ``round_trip``: HF -> Orbax -> HF bit for bit (keys, dtypes, bytes, config, tokenizer files), the
  metadata recorded, every HF tensor mapped to one Tunix parameter, the input untouched;
- ``tunix_tree``: our Tunix parameters equal the ones Tunix's own safetensors loader builds (or the
  loader fails as ``loader_fails`` says);
- ``logits``: the Orbax tree, restored with plain Orbax into the family's Tunix model, gives
  transformers' logits; so does ``verify logits`` on the Orbax checkpoint;
- ``hf_logits``: ``verify logits`` straight from the HF directory;
- ``lora``: LoRA both ways (a PEFT adapter, a Tunix+qwix checkpoint), merged, and round trips of
  both kinds, checked by logits;
- ``inspect``: ``ckptbridge inspect --json``;
- ``bad_inputs``: a missing tensor, an unexpected one and one under another prefix of the family
  are named (a tower tensor missing or of another shape too); nothing is written;
- ``train``: ``python -m training`` on the checkpoint, on 2 simulated devices, then export (slow).

Adding a family: add its rows here (a main row with ``MAIN`` checks, its Tunix loader module if
Tunix has one, and a bfloat16 two-file variant, ``variant(...)``, with ``WEIGHTS``; a further main
row of the family may leave training out, ``NO_TRAIN``, as a training run takes about 20 s);
nothing else in the tests names it (docs/adding_a_family.md, section 5). What only one family has
goes into a test file of its own (tests/test_gemma4_extras.py, tests/test_family_extras.py).
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import numpy as np

ALL_CHECKS = frozenset({"round_trip", "tunix_tree", "logits", "hf_logits", "lora", "inspect", "bad_inputs", "train"})
# a family's main row
MAIN = frozenset({"round_trip", "tunix_tree", "logits", "lora", "inspect", "bad_inputs", "train"})
NO_TRAIN = MAIN - {"train"}  # a further main row of a family that trains on another row
WEIGHTS = frozenset({"round_trip"})  # a variant of a main row (dtype, files, prefix)
BF16_SHARDED = dict(dtype="bfloat16", shards=2)

# The tokens every logits comparison uses: vocab 300 in every tiny config; longer than 2 x the
# sliding window (4) of the families that have one.
TOKENS = np.random.default_rng(7).integers(3, 300, size=(2, 11))

# On jax 0.10.0 (the floor) each loader failure below comes one step earlier, on its tree of missing leaves.
_EARLIER = "|Expected None, got ShapeDtypeStruct"
# Gemma 4 LoRA with its kv modules at their own rank (alpha != rank everywhere); the PEFT adapter
# with a rank and alpha pattern on down_proj.
GEMMA4_KV_RULES = (("kv_einsum", 8, 32.0), (None, 4, 10.0))  # (module, rank, alpha); None: every target


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: a tiny checkpoint and what the contract expects of it.

    build: ``build_checkpoint`` kwargs (``family`` required; ``prefix`` or ``model_type`` picks
      the model type; ``dtype``, ``shards``; other keys are text-config fields).
    prefix: the text model's key prefix on disk (conversions find it and write it back).
    checks: the contract tests that run on this row (see the module docstring).
    tunix_loader: the module whose ``create_model_from_safe_tensors`` is Tunix's own loader for
      this family (``tunix_tree``).
    loader_fails: where Tunix's own loader cannot load this row: a regex of what it says.
    multimodal: the checkpoint has vision (and audio) towers, which travel with the text model.
    back_shard: ``max_shard_size`` of the round trip's way back (None: one file).
    lora_names: how many distinct HF module names LoRA covers (``train``).
    tunix_rules: qwix rules of the row's Tunix LoRA checkpoint as (module, rank, alpha), module
      None for every LoRA target of the family (default: every target, rank 4, alpha 12).
    peft: extra ``build_peft_adapter`` kwargs of the row's PEFT adapter (rank 4, alpha 10).
    """

    build: dict
    prefix: str
    checks: frozenset = MAIN
    tunix_loader: str | None = None
    loader_fails: str | None = None
    multimodal: bool = False
    back_shard: str | None = None
    lora_names: int = 7
    tunix_rules: tuple | None = None
    peft: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        assert "family" in self.build and self.checks <= ALL_CHECKS, self
        assert ("tunix_tree" not in self.checks) or self.tunix_loader, "tunix_tree needs the Tunix loader's module"

    @property
    def family(self) -> str:
        return self.build["family"]


def variant(case: Case, *, checks: frozenset = WEIGHTS, back_shard: str | None = "60KB", **build) -> Case:
    """A variant row of ``case``: the same model with other build kwargs (default: bfloat16 in two
    files, written back in 60 KB files), on the weights checks only."""
    return dataclasses.replace(case, build={**case.build, **(build or BF16_SHARDED)}, checks=checks,
                               back_shard=back_shard)


_GEMMA4 = "tunix.models.gemma4.params_safetensors"
_GEMMA = "tunix.models.gemma.params_safetensors"
_GEMMA3 = "tunix.models.gemma3.params_safetensors"
_QWEN3 = "tunix.models.qwen3.params"
_GEMMA4_E2B = Case(
    # Gemma 4 E2B-shaped: per-layer embeddings, the last 2 layers kv-shared (no k/v of their own) with
    # a double-wide MLP; the pattern Tunix shares like transformers (the last unshared layer global)
    dict(family="gemma4", prefix="model.language_model.", attention_k_eq_v=False, hidden_size_per_layer_input=8,
         vocab_size_per_layer_input=300, num_kv_shared_layers=2, use_double_wide_mlp=True,
         layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention", "full_attention"]),
    "model.language_model.", tunix_loader=_GEMMA4,
    loader_fails="_key_norm|kv_einsum" + _EARLIER,  # wants k/v of kv-shared layers, which HF files do not have
    lora_names=9)  # the 7 and the per-layer input gate and projection
# Gemma 4 31B-shaped (k_eq_v globals) with its vision tower as the 31B has it (standardized soft
# tokens, no clipped linears, head_dim = hidden / heads: the form MaxText's model holds too)
_GEMMA4_MM = Case(dict(family="gemma4", model_type="gemma4", attention_k_eq_v=True,
                       vision=dict(use_clipped_linears=False, head_dim=16)),
                  "model.language_model.", WEIGHTS | {"logits", "lora", "inspect", "bad_inputs"}, multimodal=True)
# Gemma 4 E2B-shaped with its vision and audio towers (clipped linears), as the E2B/E4B release
_GEMMA4_E2B_MM = dataclasses.replace(_GEMMA4_E2B, build={**_GEMMA4_E2B.build, "vision": True, "audio": True},
                                     checks=WEIGHTS | {"inspect", "bad_inputs"}, multimodal=True)
_GEMMA3_TEXT = Case(dict(family="gemma3", model_type="gemma3_text"), "model.", NO_TRAIN, tunix_loader=_GEMMA3)
# vision tower; Gemma3ForConditionalGeneration writes its text model as language_model.model.
_GEMMA3_MM = Case(dict(family="gemma3", model_type="gemma3"), "language_model.model.", tunix_loader=_GEMMA3,
                  multimodal=True)
_QWEN3_UNTIED = Case(dict(family="qwen3"), "model.", tunix_loader=_QWEN3)
_QWEN3_TIED = Case(dict(family="qwen3", tie_word_embeddings=True), "model.", NO_TRAIN, tunix_loader=_QWEN3)
# experts stacked from per-expert keys, a router; qwix puts no LoRA on the experts
_QWEN3_MOE = Case(dict(family="qwen3", model_type="qwen3_moe"), "model.", tunix_loader=_QWEN3, lora_names=4)
_QWEN2 = Case(dict(family="qwen2"), "model.", tunix_loader="tunix.models.qwen2.params")  # q/k/v biases
_LLAMA3_TIED = Case(dict(family="llama3", tie_word_embeddings=True), "model.",
                    tunix_loader="tunix.models.llama3.params")
# Tunix's Gemma 1 loader maps post_attention_layernorm to a norm its model lacks
_GEMMA_MQA = Case(dict(family="gemma"), "model.", NO_TRAIN, tunix_loader=_GEMMA,  # Gemma 1 2B-like: one kv head
                  loader_fails="pre_ffw_norm|post_attn_norm" + _EARLIER)
_GEMMA_FUSED = Case(dict(family="gemma", num_key_value_heads=4), "model.", tunix_loader=_GEMMA,  # 7B-like: qkv_einsum
                    loader_fails="pre_ffw_norm|post_attn_norm" + _EARLIER)
_GEMMA2 = Case(dict(family="gemma2"), "model.", tunix_loader=_GEMMA)  # sliding/global, softcaps

CASES: dict[str, Case] = {
    # Gemma 4 (31B-shaped: k_eq_v global layers, or plain kv); both prefixes, float32 and bfloat16,
    # one file and two. The names are the ones the other test files use.
    "keqv_lm_f32_sharded": Case(
        dict(family="gemma4", attention_k_eq_v=True, prefix="model.language_model.", dtype="float32", shards=2),
        "model.language_model.", checks=NO_TRAIN | {"hf_logits"}, tunix_loader=_GEMMA4,
        tunix_rules=GEMMA4_KV_RULES, peft=dict(rank_pattern={"down_proj": 6}, alpha_pattern={"down_proj": 3})),
    "keqv_text_bf16_single": Case(
        dict(family="gemma4", attention_k_eq_v=True, prefix="model.", dtype="bfloat16", shards=1),
        "model.", checks=WEIGHTS | {"logits"}),
    "kv_text_f32_sharded": Case(
        dict(family="gemma4", attention_k_eq_v=False, prefix="model.", dtype="float32", shards=2),
        "model.", checks=WEIGHTS | {"logits", "hf_logits"}),
    "kv_lm_bf16_sharded": Case(
        dict(family="gemma4", attention_k_eq_v=False, prefix="model.language_model.", dtype="bfloat16", shards=2),
        "model.language_model.", checks=WEIGHTS | {"logits"}),
    "gemma4_e2b": _GEMMA4_E2B,
    "gemma4_e2b_bf16_sharded": variant(_GEMMA4_E2B),
    "gemma4_mm": _GEMMA4_MM,
    "gemma4_e2b_mm": _GEMMA4_E2B_MM,
    "gemma4_e2b_mm_bf16_sharded": variant(_GEMMA4_E2B_MM),
    "gemma3_text": _GEMMA3_TEXT,
    "gemma3_text_bf16_sharded": variant(_GEMMA3_TEXT),
    "gemma3_mm": _GEMMA3_MM,
    "gemma3_mm_bf16_sharded": variant(_GEMMA3_MM),
    "qwen3_untied": _QWEN3_UNTIED,
    "qwen3_untied_bf16_sharded": variant(_QWEN3_UNTIED),
    "qwen3_tied": _QWEN3_TIED,
    "qwen3_tied_bf16_sharded": variant(_QWEN3_TIED),
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_moe_bf16_sharded": variant(_QWEN3_MOE),
    "qwen2_untied": _QWEN2,
    "qwen2_untied_bf16_sharded": variant(_QWEN2),
    "llama3_tied": _LLAMA3_TIED,
    "llama3_tied_bf16_sharded": variant(_LLAMA3_TIED),
    "gemma_mqa": _GEMMA_MQA,
    "gemma_mqa_bf16_sharded": variant(_GEMMA_MQA),
    "gemma_fused": _GEMMA_FUSED,
    "gemma_fused_bf16_sharded": variant(_GEMMA_FUSED),
    "gemma2": _GEMMA2,
    "gemma2_bf16_sharded": variant(_GEMMA2),
}


# At the floors (test.sh --floor) the checks that go through Tunix, transformers and PEFT run on one
# row (the floors differ from the pins by patch releases of jax, flax, orbax, transformers and peft,
# and by none of Tunix and qwix), and the round trip, which reads and writes every family's files,
# on every row; the pinned suite runs every check on every row.
ONCE_AT_THE_FLOORS = frozenset({"train", "tunix_tree", "logits", "hf_logits", "lora", "inspect", "bad_inputs"})


def rows(check: str) -> list[str]:
    """The names of the rows ``check`` runs on, in table order (a test's parametrization)."""
    assert check in ALL_CHECKS, check
    names = [name for name, case in CASES.items() if check in case.checks]
    return names[:1] if check in ONCE_AT_THE_FLOORS and os.environ.get("CKPTBRIDGE_FLOOR") else names


def seed(name: str) -> int:
    """The row's build seed: fixed by its name, whatever else a session builds first."""
    return zlib.crc32(name.encode()) % 10_000


def tunix_rules(name: str) -> list[dict] | None:
    """The row's qwix rules (``build_tunix_lora``'s form), or None for its default."""
    case = CASES[name]
    if case.tunix_rules is None:
        return None
    from ckptbridge.testing import lora_targets

    return [{"module_path": f".*{module}" if module else lora_targets(case.family), "rank": rank, "alpha": alpha}
            for module, rank, alpha in case.tunix_rules]
