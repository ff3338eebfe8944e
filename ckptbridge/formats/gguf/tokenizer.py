"""A model's tokenizer as GGUF metadata (``tokenizer.ggml.*`` and the chat template), read from the
HF tokenizer files beside its weights, the way ggml's converter writes it.

Three forms: a byte-level BPE (``tokenizer.json`` with a ``ByteLevel`` pre-tokenizer) as ``gpt2``
with its merges and the name of its pre-tokenizer; a SentencePiece model (``tokenizer.model``) with
pieces, scores and types; a byte-fallback BPE converted from SentencePiece under the family's own
tokenizer name. Anything else is refused in one line: ggml could not tokenize it as HF does. The
family's part (names, marked tokens) comes from its spec (:class:`ckptbridge.specs.ggml.GGUFSpec`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from ckptbridge.errors import UnsupportedError
from ckptbridge.io.gguf import Value, ValueType, array, boolean, string, u32

# token types (ggml's token type enum)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "sep": "seperator_token_id",
                "pad": "padding_token_id", "mask": "mask_token_id"}
def _json(directory: str, name: str) -> dict | None:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _looks_special(token: str) -> bool:
    """The converter's ``does_token_look_special``."""
    if token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]"):
        return True
    if (token.startswith("<|") and token.endswith("|>")) or (token.startswith("<｜") and token.endswith("｜>")):
        return True
    return token.startswith("<unused") and token.endswith(">")


def _content(v: Any) -> str | None:
    return v.get("content") if isinstance(v, Mapping) else v if isinstance(v, str) else None


def _pre_tokenizer(tok: dict, where: str, known: Mapping[str, str]) -> str:
    """ggml's name of a byte-level BPE's pre-tokenizer: a plain ``ByteLevel`` one is GPT-2's; a
    ``Split`` regex must be one ggml knows."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    regexes = [s.get("pattern", {}).get("Regex") for s in steps if s.get("type") == "Split"]
    if not regexes:
        if any(s.get("type") == "ByteLevel" and s.get("use_regex", True) for s in steps):
            return "gpt-2"
    elif len(regexes) == 1 and regexes[0] in known:
        return known[regexes[0]]
    raise UnsupportedError(f"{where}: a pre-tokenizer ggml does not know ({json.dumps(pre)[:120]}); export the weights "
                           "without the tokenizer (--no-tokenizer)")


def _special_ids(directory: str, tok: dict | None, tconf: dict, config: Mapping[str, Any], n_vocab: int) -> dict:
    """bos/eos/... ids as gguf-py's ``SpecialVocab`` finds them: tokenizer_config's tokens looked up
    among tokenizer.json's added tokens, else config.json's ``*_token_id`` (ints only)."""
    added = {t["content"]: t["id"] for t in (tok or {}).get("added_tokens", [])}
    nested = config.get("text_config")
    text: Mapping[str, Any] = nested if isinstance(nested, Mapping) else {}
    out: dict[str, int] = {}
    for typ in SPECIAL_KEYS:
        content = _content(tconf.get(f"{typ}_token"))
        tid = added.get(content) if content is not None else None
        if tid is None:
            v = config.get(f"{typ}_token_id", text.get(f"{typ}_token_id"))
            tid = v if isinstance(v, int) and not isinstance(v, bool) else None
        if tid is not None and 0 <= tid < n_vocab:
            out[typ] = tid
    return out


def _add_flags(tok: dict | None, tconf: dict) -> dict[str, bool]:
    """Whether bos/eos are added: tokenizer.json's template, then tokenizer_config's ``add_*_token``."""
    out: dict[str, bool] = {}
    post = (tok or {}).get("post_processor") or {}
    for proc in post.get("processors", [post]):
        if proc.get("type") == "TemplateProcessing":
            single = proc.get("single", [])
            if len(single) > 1:
                first, last = single[0].get("SpecialToken", {}).get("id"), single[-1].get("SpecialToken", {}).get("id")
                if first:
                    out["bos"] = first == _content(tconf.get("bos_token"))
                if last:
                    out["eos"] = last == _content(tconf.get("eos_token"))
    for typ in ("bos", "eos", "sep"):
        v = tconf.get(f"add_{typ}_token")
        if isinstance(v, bool):
            out[typ] = v
    return out


def _chat_template(directory: str, tconf: dict) -> str | None:
    tmpl = tconf.get("chat_template")
    if isinstance(tmpl, str) and tmpl:
        return tmpl
    path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return None


def _merges(tok: dict) -> list[str]:
    merges = tok.get("model", {}).get("merges") or []
    return [m if isinstance(m, str) else " ".join("".join(chr(ord(c) + 256) if c == " " else c for c in part)
                                                   for part in m) for m in merges]


def _bpe_tokens(tok: dict, tconf: dict, n_vocab: int) -> tuple[list[str], list[int]]:
    """Tokens and types in id order up to ``n_vocab`` (holes as ``[PAD{i}]``, unused)."""
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    decoder = {int(k): v for k, v in (tconf.get("added_tokens_decoder") or {}).items()}
    added = {t["id"]: t for t in tok.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(n_vocab):
        if i in added:
            t = added[i]
            special = decoder.get(i, t).get("special", t.get("special", False))
            tokens.append(t["content"])
            types.append(CONTROL if special or _looks_special(t["content"]) else USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    return tokens, types


def _sentencepiece(path: str, tconf: dict, n_vocab: int, where: str) -> tuple[list[str], list[float], list[int]]:
    try:
        import sentencepiece
    except ImportError:
        raise UnsupportedError(f"{where}: a SentencePiece tokenizer (tokenizer.model) needs the sentencepiece package: "
                               "pip install sentencepiece") from None
    sp = sentencepiece.SentencePieceProcessor(model_file=path)
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores, types = [-10000.0] * n_vocab, [UNUSED] * n_vocab
    for i in range(min(sp.vocab_size(), n_vocab)):
        tokens[i], scores[i] = sp.id_to_piece(i), sp.get_score(i)
        types[i] = (UNKNOWN if sp.is_unknown(i) else CONTROL if sp.is_control(i) else UNUSED if sp.is_unused(i)
                    else BYTE if sp.is_byte(i) else NORMAL)
    for i, t in sorted((int(k), v) for k, v in (tconf.get("added_tokens_decoder") or {}).items()):
        if i < n_vocab:
            special = t.get("special", False) or _looks_special(t["content"])
            tokens[i], scores[i] = (t["content"] if special else t["content"].replace("\u2581", " ")), -1000.0
            types[i] = CONTROL if special else USER_DEFINED
    return tokens, scores, types


def tokenizer_metadata(directory: str, config: Mapping[str, Any], n_vocab: int, where: str, *,
                       pre_tokenizers: Mapping[str, str], spm_model: str, family_model: str | None = None,
                       visible: frozenset[str] = frozenset(), spm_ids: Mapping[str, int] | None = None,
                       ) -> list[tuple[str, Value]]:
    """The ``tokenizer.*`` keys of the tokenizer in ``directory`` for a model of ``n_vocab`` rows.
    ``pre_tokenizers``: ggml's names of byte-level BPE pre-tokenizers by their regex; ``spm_model``:
    its name of SentencePiece vocabularies; ``family_model``, ``visible``, ``spm_ids``: the family's
    (:class:`ckptbridge.specs.ggml.GGUFSpec`). Raises UnsupportedError for a tokenizer ggml cannot
    run as HF does, or none at all."""
    tok = _json(directory, "tokenizer.json")
    tconf = _json(directory, "tokenizer_config.json") or {}
    spm = os.path.join(directory, "tokenizer.model")
    out: list[tuple[str, Value]] = []
    model = (tok or {}).get("model", {})
    byte_fallback_bpe = model.get("type") == "BPE" and bool(model.get("byte_fallback"))
    if tok is not None and byte_fallback_bpe and family_model:
        tokens, types = _bpe_tokens(tok, tconf, n_vocab)
        special_ids = set(_special_ids(directory, tok, tconf, config, n_vocab).values())
        types = [USER_DEFINED if t in visible else BYTE if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", t)
                 else CONTROL if ty == CONTROL or i in special_ids else ty
                 for i, (t, ty) in enumerate(zip(tokens, types))]
        out += [("tokenizer.ggml.model", string(family_model)),
                ("tokenizer.ggml.tokens", array(tokens, ValueType.STRING)),
                ("tokenizer.ggml.scores", array([-1000.0] * len(tokens), ValueType.FLOAT32)),
                ("tokenizer.ggml.token_type", array(types, ValueType.INT32))]
    elif os.path.isfile(spm):
        tokens, scores, types = _sentencepiece(spm, tconf, n_vocab, where)
        out += [("tokenizer.ggml.model", string(spm_model)), ("tokenizer.ggml.pre", string("default")),
                ("tokenizer.ggml.tokens", array(tokens, ValueType.STRING)),
                ("tokenizer.ggml.scores", array(scores, ValueType.FLOAT32)),
                ("tokenizer.ggml.token_type", array(types, ValueType.INT32))]
        tok = tok if byte_fallback_bpe else None  # merges only for BPE
    elif tok is not None and model.get("type") == "BPE" and not model.get("byte_fallback"):
        pre = _pre_tokenizer(tok, os.path.join(directory, "tokenizer.json"), pre_tokenizers)
        tokens, types = _bpe_tokens(tok, tconf, n_vocab)
        out += [("tokenizer.ggml.model", string("gpt2")), ("tokenizer.ggml.pre", string(pre)),
                ("tokenizer.ggml.tokens", array(tokens, ValueType.STRING)),
                ("tokenizer.ggml.token_type", array(types, ValueType.INT32))]
    elif tok is None:
        raise UnsupportedError(f"{where}: no tokenizer (tokenizer.json or tokenizer.model) beside the weights; copy "
                               "the model's tokenizer files there, or leave it out with --no-tokenizer")
    else:
        raise UnsupportedError(f"{os.path.join(directory, 'tokenizer.json')}: a {model.get('type')} tokenizer, which "
                               "GGUF cannot express (byte-level BPE or SentencePiece); use --no-tokenizer")
    if tok is not None and model.get("type") == "BPE":
        merges = _merges(tok)
        if merges:
            out.append(("tokenizer.ggml.merges", array(merges, ValueType.STRING)))
    for typ, tid in _special_ids(directory, tok, tconf, config, n_vocab).items():
        out.append((f"tokenizer.ggml.{SPECIAL_KEYS[typ]}", u32(tid)))
    for typ, on in _add_flags(tok, tconf).items():
        out.append((f"tokenizer.ggml.add_{typ}_token", boolean(on)))
    tmpl = _chat_template(directory, tconf)
    if tmpl:
        out.append(("tokenizer.chat_template", string(tmpl)))
    if os.path.isfile(spm) and not (byte_fallback_bpe and family_model):
        out += [(f"tokenizer.ggml.{key}", u32(tid)) for key, tid in (spm_ids or {}).items() if tid < n_vocab]
    if (byte_fallback_bpe and family_model) or os.path.isfile(spm):  # SentencePiece's own spaces, not a prefix
        out.append(("tokenizer.ggml.add_space_prefix", boolean(False)))
    if byte_fallback_bpe and family_model:
        out = [(k, v) for k, v in out if k != "tokenizer.ggml.add_bos_token"] + [
            ("tokenizer.ggml.add_bos_token", boolean(True))]
    return out
