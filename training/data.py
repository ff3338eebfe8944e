"""SFT data: CodeV-R1 rows -> chat-formatted token ids with an assistant-only loss mask -> Grain
pipeline (deterministic shuffle, optional best-fit packing, resumable iterator).

A row is a JSON object with ``prompt`` and ``response`` (other keys, e.g. ``system``, are
ignored). The response's reasoning is stripped: the ``<answer>`` body is taken (else the
``<think>`` blocks are dropped) and only the first ```verilog fence is kept. Prompt and answer go
through the tokenizer's own chat template, the one the serving and evaluation side uses, and the
loss covers only the assistant turn: its content and its end-of-turn marker.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterator

import numpy as np

from ckptbridge.errors import ConfigError, CorruptFileError, InputNotFoundError

_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S)
_THINK = re.compile(r"<think>.*?(?:</think>|$)", re.S)
_FENCE = re.compile(r"```verilog\s*\n(.*?)```", re.S)


def strip_reasoning(response: str) -> str:
    """The answer a model should learn to give: the first ```verilog fence of the answer."""
    m = _ANSWER.search(response)
    body = m.group(1) if m else _THINK.sub("", response)
    fence = _FENCE.search(body)
    if fence:
        return f"```verilog\n{fence.group(1).rstrip()}\n```"
    return body.strip()


def read_rows(path: str) -> list[dict]:
    """Rows of a jsonl file, each with string ``prompt`` and ``response``."""
    if not os.path.isfile(path):
        raise InputNotFoundError(f"--data {path}: no such file")
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise CorruptFileError(f"{path}:{n}: not UTF-8 text; the data must be UTF-8 jsonl") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorruptFileError(f"{path}:{n}: not JSON ({e.msg}); one JSON object per line") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not isinstance(row.get("response"), str):
                raise CorruptFileError(f"{path}:{n}: each row needs string fields 'prompt' and 'response'")
            rows.append({"prompt": row["prompt"], "response": row["response"]})
    if not rows:
        raise CorruptFileError(f"{path}: no rows")
    return rows


def encode(tokenizer, prompt: str, answer: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the chat-formatted exchange and its loss mask (1 on the assistant's content
    and end-of-turn marker, 0 on the prompt, the template around it and anything after)."""
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    head = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    if not full.startswith(head):
        raise ConfigError("the tokenizer's chat template renders the prompt differently with and without the answer")
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], np.int32)
    starts = np.asarray([s for s, _ in enc["offset_mapping"]])
    mask = (starts >= len(head)).astype(np.int32)
    special = set(tokenizer.all_special_ids)
    in_turn = np.flatnonzero(mask)
    ends = [i for i in in_turn if int(ids[i]) in special]
    if ends:  # stop at the end-of-turn marker: what the template adds after it is not learned
        mask[ends[-1] + 1:] = 0
    return ids, mask


@dataclasses.dataclass
class Encoded:
    examples: list[dict]  # {"tokens": int32[n], "loss_mask": int32[n]}
    rows: int
    dropped_too_long: int
    dropped_empty: int

    @property
    def tokens(self) -> int:
        return sum(len(e["tokens"]) for e in self.examples)


def encode_rows(tokenizer, rows: list[dict], max_length: int) -> Encoded:
    """Encode every row; rows longer than ``max_length`` tokens, or with no answer, are dropped
    and counted."""
    examples, too_long, empty = [], 0, 0
    for row in rows:
        answer = strip_reasoning(row["response"])
        if not answer or not row["prompt"].strip():
            empty += 1
            continue
        ids, mask = encode(tokenizer, row["prompt"], answer)
        if len(ids) > max_length:
            too_long += 1
            continue
        examples.append({"tokens": ids, "loss_mask": mask})
    return Encoded(examples, len(rows), too_long, empty)


def pipeline(examples: list[dict], *, seq_len: int, batch: int, packing: bool, seed: int, epochs: int = 1,
             num_packing_bins: int = 64):
    """A Grain IterDataset of training micro-batches: ``tokens``, ``loss_mask``, ``segment_ids``
    and ``positions``, each ``(batch, seq_len)``. Shuffled by ``seed`` (a new order each epoch);
    with ``packing`` several examples share a row (best-fit over ``num_packing_bins`` open rows),
    without it each row is one example padded to ``seq_len``."""
    import grain

    ds = grain.MapDataset.source(examples)
    ds = ds.shuffle(seed=seed).repeat(epochs) if epochs > 1 else ds.shuffle(seed=seed)
    it = ds.to_iter_dataset()
    if packing:
        it = grain.experimental.BestFitPackIterDataset(
            it, length_struct={"tokens": seq_len, "loss_mask": seq_len}, num_packing_bins=num_packing_bins,
            seed=seed, shuffle_bins=True,
        )
        it = it.map(_from_packed)
    else:
        it = it.map(lambda e: _pad(e, seq_len))
    return it.batch(batch, drop_remainder=False)


def _from_packed(e: dict) -> dict:
    return {
        "tokens": e["tokens"],
        "loss_mask": e["loss_mask"],
        "segment_ids": e["tokens_segment_ids"],
        "positions": e["tokens_positions"],
    }


def _pad(e: dict, seq_len: int) -> dict:
    n = len(e["tokens"])
    out = {k: np.zeros(seq_len, np.int32) for k in ("tokens", "loss_mask", "segment_ids", "positions")}
    out["tokens"][:n] = e["tokens"]
    out["loss_mask"][:n] = e["loss_mask"]
    out["segment_ids"][:n] = 1
    out["positions"][:n] = np.arange(n)
    return out


def count_batches(examples: list[dict], **kwargs: Any) -> tuple[int, int]:
    """(micro-batches, real tokens) the pipeline yields: iterates it once without a model."""
    n, real = 0, 0
    for b in pipeline(examples, **kwargs):
        n += 1
        real += int((b["segment_ids"] > 0).sum())
    return n, real


def attention_mask(segment_ids, xp=np):
    """(B, T, T) causal mask that keeps packed examples apart: token i sees token j iff both are
    in the same (non-padding) segment and j <= i. ``xp`` is numpy or jax.numpy."""
    seg = segment_ids
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    t = seg.shape[1]
    return same & xp.tril(xp.ones((t, t), bool))[None]


def iterate(ds, state: dict | None = None) -> Iterator[dict]:
    """An iterator of the pipeline, restored to ``state`` (from ``get_state()``) when given."""
    it = iter(ds)
    if state:
        it.set_state(state)
    return it

