"""What ckptbridge knows of vLLM's LoRA support (vLLM 0.32), for adapters exported with
``--target vllm`` and for ``verify adapter --target vllm``.

* vLLM accepts ``--max-lora-rank`` only from a fixed list and defaults to 16
  (``vllm/config/lora.py``); an adapter above the limit fails to load.
* vLLM applies LoRA per HF module with its own slots; where transformers computes a module from
  another's output (V computed from K's projection), the export repeats the factors under
  the module's name: the family spec declares these as ``vllm_lora_aliases``.
* vLLM 0.32 honours ``rank_pattern`` / ``alpha_pattern`` (measured); exports still make rank and
  alpha uniform, which every release reads.
"""

from __future__ import annotations

DEFAULT_MAX_LORA_RANK = 16
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def next_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that fits ``rank``."""
    return next((r for r in LORA_RANKS if r >= rank), rank)
