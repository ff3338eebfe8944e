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
import functools
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


def encoded_data(base: str, data_path: str, max_length: int, cache: str | None = None) -> Encoded:
    """:func:`encode_rows` of ``data_path`` with the tokenizer of the model directory ``base``.
    With ``cache`` (a file path), the result is kept there and read back on the next call with the
    same inputs (a resumed run: no transformers import, no tokenizing): the key is the bytes of
    the data and of the base's tokenizer files (every non-weight file and config.json),
    ``max_length``, the transformers version and this module's source."""
    if not os.path.isfile(data_path):
        raise InputNotFoundError(f"--data {data_path}: no such file")
    key = _encoding_key(base, data_path, max_length) if cache else None
    if key is not None and os.path.isfile(cache):
        found = _read_encoded(cache, key)
        if found is not None:
            return found
    from transformers import AutoTokenizer

    encoded = encode_rows(AutoTokenizer.from_pretrained(base), read_rows(data_path), max_length)
    if key is not None:
        _write_encoded(cache, key, encoded)
    return encoded


def _encoding_key(base: str, data_path: str, max_length: int) -> str:
    import hashlib
    from importlib import metadata

    from ckptbridge.io.hf import non_weight_files

    h = hashlib.sha256()
    try:
        version = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        version = "none"
    h.update(f"{max_length} {version}\n".encode())
    files = [("data", data_path), ("code", os.path.abspath(__file__))]
    files += [(name, os.path.join(base, name)) for name in ["config.json", *non_weight_files(base)]
              if os.path.isfile(os.path.join(base, name))]
    for name, path in files:
        h.update(f"{name}\0".encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _write_encoded(path: str, key: str, encoded: Encoded) -> None:
    lengths = np.asarray([len(e["tokens"]) for e in encoded.examples], np.int64)
    cat = (lambda k: np.concatenate([e[k] for e in encoded.examples]).astype(np.int32)) if encoded.examples \
        else (lambda k: np.zeros(0, np.int32))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, key=np.asarray(key), lengths=lengths, tokens=cat("tokens"), loss_mask=cat("loss_mask"),
                 counts=np.asarray([encoded.rows, encoded.dropped_too_long, encoded.dropped_empty], np.int64))
    os.replace(tmp, path)


def _read_encoded(path: str, key: str) -> Encoded | None:
    """The encoded data kept in ``path`` if it was made from the inputs of ``key`` (else None;
    an unreadable file is made again)."""
    try:
        with np.load(path) as z:
            if str(z["key"]) != key:
                return None
            lengths, tokens, mask, counts = z["lengths"], z["tokens"], z["loss_mask"], z["counts"]
    except (OSError, ValueError, KeyError):
        return None
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    if len(counts) != 3 or bounds[-1] != len(tokens) or len(tokens) != len(mask):
        return None
    examples = [{"tokens": tokens[a:b], "loss_mask": mask[a:b]} for a, b in zip(bounds[:-1], bounds[1:])]
    return Encoded(examples, int(counts[0]), int(counts[1]), int(counts[2]))


def pipeline(examples: list[dict], *, seq_len: int, batch: int, packing: bool, seed: int, epochs: int = 1,
             num_packing_bins: int = 64, rows: tuple[int, int] | None = None):
    """A Grain IterDataset of training micro-batches: ``tokens``, ``loss_mask``, ``segment_ids``
    and ``positions``, each ``(batch, seq_len)``. Shuffled by ``seed`` (a new order each epoch);
    with ``packing`` several examples share a row (best-fit over ``num_packing_bins`` open rows),
    without it each row is one example padded to ``seq_len``.

    ``batch`` is the global micro-batch (every process of a run iterates the same order). The last
    one of the data is filled up to ``batch`` rows with empty rows (no token, loss weight zero), so
    that every micro-batch has the shape the step was compiled for. ``rows=(lo, hi)`` keeps rows
    ``lo:hi`` of each micro-batch: the rows this process feeds to its devices. Each micro-batch also
    says ``real_tokens`` (of the whole micro-batch, before ``rows``) and ``filler_rows``."""
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
    return it.batch(batch, drop_remainder=False).map(functools.partial(_fill_and_keep, batch=batch, rows=rows))


def _fill_and_keep(b: dict, *, batch: int, rows: tuple[int, int] | None) -> dict:
    n = len(b["tokens"])
    out = {k: np.asarray(v) for k, v in b.items()}
    if n < batch:
        out = {k: np.concatenate([v, np.zeros((batch - n, *v.shape[1:]), v.dtype)]) for k, v in out.items()}
    real = int((out["segment_ids"] > 0).sum())
    if rows is not None:
        out = {k: v[rows[0]:rows[1]] for k, v in out.items()}
    out["real_tokens"] = np.asarray(real, np.int64)
    out["filler_rows"] = np.asarray(batch - n, np.int64)
    return out


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
        real += int(b["real_tokens"])
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

