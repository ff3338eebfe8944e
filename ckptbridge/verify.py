"""Checks that a conversion is exact: bitwise tensor comparison and cross-framework logits.

``compare_tensors`` needs nothing but numpy. ``logits_parity`` runs the HF model with
transformers (torch) and the Tunix model loaded through ckptbridge's map (jax) on the same
tokens, in float32 with full-precision matmuls, over a sequence longer than the sliding window.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from ckptbridge.config import read_config_file
from ckptbridge.errors import ConfigError, MismatchError, UnsupportedError
from ckptbridge.formats.peft import ADAPTER_CONFIG
from ckptbridge.io.hf import HFModelDir
from ckptbridge.lora.base import open_base
from ckptbridge.options import LOGITS_TOLERANCE, SERVED_TOKENS
from ckptbridge.report import Report, internal
from ckptbridge.specs import family_for, get_family, parse_config


@dataclasses.dataclass(frozen=True)
class TensorsReport(Report):
    """Two HF model directories compared tensor by tensor."""

    a: str
    b: str
    tensors: int
    only_in_a: list[str]
    only_in_b: list[str]
    differing: list[str]
    identical: bool
    bytes: int

    def summary(self) -> str:
        text = f"{self.a} vs {self.b}: {self.tensors} tensors, " + (
            "identical (keys, dtypes, shapes, bytes)" if self.identical else
            f"DIFFERENT: {len(self.differing)} differ, {len(self.only_in_a)} only in A, "
            f"{len(self.only_in_b)} only in B")
        for key in (self.differing + self.only_in_a + self.only_in_b)[:10]:
            text += f"\n  {key}"
        return text


@dataclasses.dataclass(frozen=True)
class LogitsReport(Report):
    """transformers vs Tunix logits on the same random tokens."""

    hf: str
    tunix: str
    tokens: list[int]  # batch, sequence length
    sliding_window: int | None
    rel_l2: float
    max_abs_diff: float
    argmax_agreement: float
    config_mismatch: list[str]  # what Tunix computes otherwise (then the gap is expected)
    ok: bool  # rel_l2 within tolerance and every argmax equal
    tolerance: float = internal(LOGITS_TOLERANCE)

    def summary(self) -> str:
        return (
            f"logits parity, transformers ({self.hf}) vs Tunix ({self.tunix}), tokens {self.tokens[0]}x"
            f"{self.tokens[1]} (sliding window {self.sliding_window}):\n  relative L2 {self.rel_l2:.3e}, max |diff| "
            f"{self.max_abs_diff:.3e}, argmax agreement {self.argmax_agreement:.4f} -> {'OK' if self.ok else 'FAIL'} "
            f"(tolerance {self.tolerance:g})"
            + (f"\n  the gap measured for what Tunix computes otherwise: {'; '.join(self.config_mismatch)}"
               if self.config_mismatch else ""))


@dataclasses.dataclass(frozen=True)
class ServedReport(Report):
    """Greedy tokens of a running server vs transformers (+ PEFT)."""

    url: str
    model: str
    base: str
    adapter: str | None
    prompt_ids: list[int]
    tokens: int
    server: list[int]
    reference: list[int]
    equal: bool
    first_divergence: int | None

    def summary(self) -> str:
        ref = f"transformers{' + PEFT ' + self.adapter if self.adapter else ''} (float32)"
        if self.equal:
            return f"verify served: {self.model} at {self.url}: {self.tokens} greedy tokens equal {ref} -> OK"
        i = self.first_divergence or 0
        got = self.server[i] if i < len(self.server) else "none"
        want = self.reference[i] if i < len(self.reference) else "none"
        return (f"verify served: {self.model} at {self.url}: greedy tokens leave {ref} at position {i} of "
                f"{self.tokens} (server {got}, reference {want}) -> FAIL\n  a server computing in bfloat16 (vLLM's "
                "--dtype auto on a float32 checkpoint) can diverge: serve with --dtype float32; an adapter exported "
                "for transformers diverges on k_eq_v layers: check it with `ckptbridge verify adapter ADAPTER --base "
                "BASE --target vllm`")


def compare_tensors(a: str, b: str, *, revision: str | None = None) -> TensorsReport:
    """Compare two HF model directories tensor by tensor: key sets, dtypes, shapes and bytes."""
    from ckptbridge import hub

    a, b = hub.local(a, hub.MODEL, revision=revision), hub.local(b, hub.MODEL)
    with HFModelDir(a) as da, HFModelDir(b) as db:
        ka, kb = set(da.keys()), set(db.keys())
        differing = []
        for key in sorted(ka & kb):
            ia, ib = da.info(key), db.info(key)
            if ia.dtype != ib.dtype or ia.shape != ib.shape or bytes(da.file_of(key).raw(key)) != bytes(
                db.file_of(key).raw(key)
            ):
                differing.append(key)
        return TensorsReport(a=a, b=b, tensors=len(ka | kb), only_in_a=sorted(ka - kb), only_in_b=sorted(kb - ka),
                             differing=differing, identical=ka == kb and not differing,
                             bytes=sum(da.info(k).nbytes for k in ka))


def hf_model_class(model_dir: str):
    """The transformers class that loads the HF model directory ``model_dir`` (its family says which)."""
    import transformers

    path = os.path.join(model_dir, "config.json")
    hf_config = read_config_file(path)
    spec = family_for(hf_config, path)
    return getattr(transformers, spec.hf_classes[hf_config["model_type"]])


def hf_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    """Logits of the HF model in ``hf_dir`` (float32, eager attention) for ``tokens`` (B, T)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cls = hf_model_class(hf_dir)
    model = cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()


def peft_logits(base_dir: str, adapter_dir: str, tokens: np.ndarray) -> np.ndarray:
    """Logits of the HF base model with a PEFT adapter (float32, eager attention)."""
    import torch
    from peft import PeftModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cls = hf_model_class(base_dir)
    base = cls.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(tokens)).logits.float().numpy()


def hf_greedy(base_dir: str, adapter_dir: str | None, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` from the HF model (with a PEFT adapter if given), float32."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    cls = hf_model_class(base_dir)
    model = cls.from_pretrained(base_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    """Relative L2 distance of ``a`` from the reference ``b``."""
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(np.asarray(b, np.float64)))


def tunix_logits(model, tokens: np.ndarray) -> np.ndarray:
    """Logits of a Tunix model for ``tokens`` (B, T) with a causal mask (full forward, no cache)."""
    import jax.numpy as jnp

    from ckptbridge.tunix_model import forward

    b, t = tokens.shape
    mask = jnp.tril(jnp.ones((b, t, t), dtype=bool))
    positions = jnp.tile(jnp.arange(t)[None], (b, 1))
    return np.asarray(forward(model, jnp.asarray(tokens), positions, mask), dtype=np.float32)


def logits_parity(hf_dir: str, tunix_src: str | None = None, *, seq_len: int | None = None,
                  batch: int = 2, seed: int = 0, allow_config_mismatch: bool = False,
                  tolerance: float = LOGITS_TOLERANCE, revision: str | None = None) -> LogitsReport:
    """Run transformers on ``hf_dir`` and Tunix on ``tunix_src`` (an HF directory or an Orbax
    checkpoint; default ``hf_dir``) on the same random tokens; report relative L2 and argmax
    (``ok``: relative L2 within ``tolerance`` and every argmax equal). ``hf_dir`` may be a Hub id
    (at ``revision``)."""
    import jax

    from ckptbridge import hub
    from ckptbridge.tunix_model import load_tunix_model

    hf_dir = hub.local(hf_dir, hub.MODEL, revision=revision)
    jax.config.update("jax_default_matmul_precision", "highest")
    config_path = os.path.join(hf_dir, "config.json")
    cfg = parse_config(read_config_file(config_path), config_path)
    model, _ = load_tunix_model(tunix_src or hf_dir, param_dtype=np.float32, dtype=np.float32, skip_multimodal=True,
                                allow_config_mismatch=allow_config_mismatch)
    tokens = _random_tokens(cfg, seq_len, batch, seed)
    ours = tunix_logits(model, tokens)
    ref = hf_logits(hf_dir, tokens)
    if ours.shape != ref.shape:
        raise MismatchError(f"logits shapes differ: Tunix {ours.shape}, transformers {ref.shape}")
    rel = float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))
    agreement = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    return LogitsReport(hf=hf_dir, tunix=tunix_src or hf_dir, tokens=list(tokens.shape),
                        sliding_window=cfg.sliding_window,
                        rel_l2=rel, max_abs_diff=float(np.max(np.abs(ours - ref))), argmax_agreement=agreement,
                        config_mismatch=get_family(cfg.family).config_mismatches(cfg),
                        ok=rel <= tolerance and agreement == 1.0, tolerance=tolerance)


@dataclasses.dataclass(frozen=True)
class QuantizedReport(Report):
    """What quantization cost: a quantized model's logits against its unquantized source."""

    quantized: str
    source: str
    scheme: str
    quantized_tensors: int
    tokens: list[int]  # batch, sequence length
    weight_rel_l2: float  # the stored weights (weight x scale) against the source's, all quantized tensors
    rel_l2_weights_only: float  # logits with the stored weights, activations unrounded
    rel_l2: float  # logits as served: stored weights, activations rounded per token as the scheme does
    max_abs_diff: float
    argmax_agreement: float
    ok: bool  # rel_l2 within tolerance (always, when no tolerance is given)
    tolerance: float | None = internal()

    def summary(self) -> str:
        verdict = "" if self.tolerance is None else f" -> {'OK' if self.ok else 'FAIL'} (tolerance {self.tolerance:g})"
        return (f"verify quantized: {self.quantized} ({self.scheme}, {self.quantized_tensors} weights) vs "
                f"{self.source}, tokens {self.tokens[0]}x{self.tokens[1]}, float32:\n"
                f"  weights: relative L2 {self.weight_rel_l2:.3e}\n"
                f"  logits: relative L2 {self.rel_l2:.3e} (weights alone {self.rel_l2_weights_only:.3e}), max |diff| "
                f"{self.max_abs_diff:.3e}, argmax agreement {self.argmax_agreement:.4f}{verdict}")


def _round_per_token(x, scheme):
    """Activations quantized and dequantized per token (the last axis), as vLLM does at run time:
    scale = the token's largest magnitude / the largest quantized value (127, or 448 for e4m3)."""
    import torch

    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / scheme.q_max, torch.ones_like(amax))
    y = (x / scale).clamp(scheme.q_min, scheme.q_max)
    y = torch.round(y) if scheme.ct_type == "int" else y.to(torch.float8_e4m3fn).to(x.dtype)
    return y * scale


def _random_tokens(cfg, seq_len: int | None, batch: int, seed: int) -> np.ndarray:
    """``batch`` x ``seq_len`` random ids of the model's vocabulary; default length: past its window."""
    if seq_len is None:
        seq_len = 2 * (cfg.sliding_window or 8) + 3
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(batch, seq_len))


def quantized_cost(quantized: str, source: str, *, seq_len: int | None = None, batch: int = 2, seed: int = 0,
                   tolerance: float | None = None) -> QuantizedReport:
    """The logits of the quantized model ``quantized`` (compressed-tensors int8 or fp8, as ``ckptbridge
    quantize`` or llm-compressor write it) against its unquantized ``source`` on the same random tokens,
    in float32 with transformers: the source model with its quantized weights replaced by the stored
    ``weight x weight_scale`` (one at a time, in place: memory is the float32 model) and, for the
    served figure, the inputs of those layers rounded per token as vLLM quantizes activations."""
    import torch
    from transformers.utils import logging as hf_logging

    from ckptbridge.formats.compressed_tensors import SCALE_SUFFIX, scheme_of

    hf_logging.disable_progress_bar()
    config_path = os.path.join(source, "config.json")
    cfg = parse_config(read_config_file(config_path), config_path)
    tokens = _random_tokens(cfg, seq_len, batch, seed)
    with HFModelDir(quantized) as q:
        scheme = scheme_of(q.config)
        if scheme is None:
            raise UnsupportedError(f"{quantized}: not a model quantized to int8 or fp8 (compressed-tensors "
                                   "quantization_config); give the output of `ckptbridge quantize`")
        weights = [key[: -len(SCALE_SUFFIX)] + "weight" for key in q.keys() if key.endswith("." + SCALE_SUFFIX)]
        model = hf_model_class(source).from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()
        params = dict(model.named_parameters())
        for key in weights:
            if key not in params or tuple(params[key].shape) != tuple(q.info(key).shape):
                raise MismatchError(f"{quantized}: quantized weight {key} is not a parameter of that shape in the "
                                    f"source model {source}; give the model it was quantized from")
        ids = torch.as_tensor(tokens)
        with torch.no_grad():
            ref = model(input_ids=ids).logits.float().numpy()
            diff = norm = 0.0
            for key in weights:  # one tensor at a time
                value = q.array(key).astype(np.float32) * q.array(key + "_scale").astype(np.float32)
                p = params[key]
                diff += float(np.sum((value - p.numpy()) ** 2))
                norm += float(np.sum(p.numpy() ** 2))
                p.copy_(torch.from_numpy(value))
            weights_only = model(input_ids=ids).logits.float().numpy()
            modules = dict(model.named_modules())
            hooks = [modules[key[: -len(".weight")]].register_forward_pre_hook(
                lambda _, args: (_round_per_token(args[0], scheme), *args[1:])) for key in weights]
            served = model(input_ids=ids).logits.float().numpy()
            for h in hooks:
                h.remove()
    rel = rel_l2(served, ref)
    return QuantizedReport(
        quantized=quantized, source=source, scheme=scheme.name, quantized_tensors=len(weights),
        tokens=list(tokens.shape), weight_rel_l2=float(np.sqrt(diff / norm)) if norm else 0.0,
        rel_l2_weights_only=rel_l2(weights_only, ref), rel_l2=rel, max_abs_diff=float(np.max(np.abs(served - ref))),
        argmax_agreement=float(np.mean(served.argmax(-1) == ref.argmax(-1))),
        ok=tolerance is None or rel <= tolerance, tolerance=tolerance)


# --------------------------------------------------------------------------- adapters and token ids


def adapter_kind(path: str) -> str:
    """``"peft"`` for a PEFT adapter directory, ``"orbax"`` for anything else (a LoRA checkpoint)."""
    return "peft" if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) else "orbax"


def prompt_ids(base: str, *, ids: list[int] | None = None, prompt: str | None = None, length: int = 24,
               seed: int = 0) -> list[int]:
    """Token ids to check with: ``ids``, ``prompt`` tokenized by BASE's tokenizer, or ``length``
    random ids from BASE's vocabulary."""
    cfg = open_base(base).cfg
    if ids is not None and prompt is not None:
        raise ConfigError("give ids or prompt (--ids, --prompt), not both")
    if prompt is not None:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(base)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"{base}: no tokenizer to encode the prompt ({type(e).__name__}); pass ids (--ids) instead") from None
        ids = list(tok(prompt)["input_ids"])
        if not ids:
            raise ConfigError("the prompt (--prompt) encodes to no tokens")
    if ids is None:
        ids = [int(x) for x in np.random.default_rng(seed).integers(3, cfg.vocab_size, size=length)]
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise ConfigError(f"token id {bad[0]} is outside BASE's vocabulary (0..{cfg.vocab_size - 1})")
    return [int(i) for i in ids]


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"--ids {text!r}: expected comma-separated integers such as 1,2,3") from None
    if not ids:
        raise ConfigError("--ids is empty")
    return ids


def as_peft(adapter: str, base: str, tmp: str, *, step: int | None = None, alpha: float | None = None) -> str:
    """``adapter`` itself when it is a PEFT directory; an Orbax LoRA checkpoint is converted
    (``orbax-to-peft``, target hf) into ``tmp``."""
    if adapter_kind(adapter) == "peft":
        return adapter
    from ckptbridge import convert_orbax_to_peft

    out = os.path.join(tmp, "peft")
    convert_orbax_to_peft(adapter, out, base=base, step=step, alpha=alpha, progress=False)
    return out


def server_greedy(url: str, model: str, ids: list[int], n: int, timeout: float = 300.0) -> list[int]:
    """``n`` greedy token ids after ``ids`` from an OpenAI-compatible server (``/v1/completions``
    with the prompt as token ids, temperature 0, end-of-sequence held off for ``n`` tokens)."""
    import httpx

    from ckptbridge.errors import InputNotFoundError

    body = {"model": model, "prompt": ids, "max_tokens": n, "min_tokens": n, "ignore_eos": True,
            "temperature": 0.0, "return_token_ids": True}
    try:
        r = httpx.post(f"{url.rstrip('/')}/v1/completions", json=body, timeout=timeout)
    except httpx.HTTPError as e:
        raise InputNotFoundError(
            f"{url}: no answer from the server ({type(e).__name__}: {e}); is it running?") from None
    if r.status_code != 200:
        try:
            reason = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            reason = r.text[:300]
        raise ConfigError(f"{url}: completions for model {model!r} failed with HTTP {r.status_code}: {reason}")
    choice = (r.json().get("choices") or [{}])[0]
    tokens = choice.get("token_ids")
    if not isinstance(tokens, list):
        raise ConfigError(f"{url}: the server returned no token ids (return_token_ids); verify served needs a vLLM "
                          "server (>= 0.10)")
    return [int(t) for t in tokens]


def served_parity(url: str, model: str, base: str, *, adapter: str | None = None, ids: list[int] | None = None,
                  tokens: int = SERVED_TOKENS, step: int | None = None, alpha: float | None = None) -> ServedReport:
    """Greedy token ids of ``model`` on a running server against transformers (+ PEFT with
    ``adapter``, a PEFT directory or an Orbax LoRA checkpoint) in float32 on the same ids."""
    import tempfile

    ids = prompt_ids(base, ids=ids, length=12)
    got = server_greedy(url, model, ids, tokens)
    with tempfile.TemporaryDirectory(prefix="ckptbridge-served-") as tmp:
        want = hf_greedy(base, as_peft(adapter, base, tmp, step=step, alpha=alpha) if adapter else None, ids, tokens)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None and len(got) != len(want):
        first = min(len(got), len(want))
    return ServedReport(url=url, model=model, base=base, adapter=adapter, prompt_ids=ids, tokens=tokens, server=got,
                        reference=want, equal=first is None, first_divergence=first)


@dataclasses.dataclass(frozen=True)
class GGUFVerifyReport(Report):
    """A GGUF file against the model it was made from, tensor by tensor."""

    gguf: str
    source: str
    adapter: str | None
    architecture: str
    tensors: int
    identical: bool
    differing: list[str]
    missing: list[str]
    unexpected: list[str]
    seconds: float

    def summary(self) -> str:
        head = f"verify gguf: {self.gguf} against {self.source}" + (f" + {self.adapter}" if self.adapter else "")
        if self.identical:
            return (f"{head}\n  identical: {self.tensors} tensors ({self.architecture}), each the source's values as "
                    "stored (float types bit for bit, Q8_0 as quantized again)")
        lines = [f"{head}\n  DIFFERENT ({self.tensors} tensors compared)"]
        for what, names in (("differ", self.differing), ("missing from the file", self.missing),
                            ("not made from the source", self.unexpected)):
            if names:
                lines.append(f"  {len(names)} {what}: {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
        return "\n".join(lines)


def verify_gguf(path: str, src: str, *, adapter: str | None = None, step: int | None = None,
                alpha: float | None = None, workers: int | None = None, memory_budget: str | int | None = None,
                revision: str | None = None) -> GGUFVerifyReport:
    """Compare the GGUF file ``path`` (written by ckptbridge or by ggml's converter) with the model
    ``src`` it was made from (any model format; an adapter merged as ``convert`` would), tensor by
    tensor: each tensor must hold the source's values in its stored type (F32, F16, BF16 bit for
    bit; Q8_0 equal to quantizing them again), with ggml's value changes (norms + 1, reordered q/k
    rows, stacked experts). Streaming, as the export."""
    import time

    from ckptbridge import formats, hub
    from ckptbridge.conversion import merged, open_model, parallelism
    from ckptbridge.formats.gguf import model as gguf_model
    from ckptbridge.io import gguf

    t0 = time.perf_counter()
    file = gguf.read_gguf(path)
    src = hub.local(src, hub.MODEL, revision=revision)
    adapters = [hub.local(adapter, hub.ADAPTER, what="adapter")] if adapter is not None else []
    fmt = formats.detect(src, step)
    if fmt.kind != formats.MODEL:
        raise ConfigError(f"{src}: a {fmt.name} adapter; give the model the GGUF file was made from (and the "
                          "adapter with --adapter)")
    if not adapters and (alpha is not None or (step is not None and "step" not in fmt.read_options)):
        raise ConfigError("step/alpha (--step, --alpha) apply with --adapter (--step also to an Orbax source)")
    chunk_bytes, _, parallel = parallelism({"workers": workers, "memory_budget": memory_budget}, False)

    def type_of(name: str, shape: tuple[int, ...]) -> gguf.TensorType:
        info = file.tensors.get(name)
        if info is not None and isinstance(info.type, gguf.TensorType):
            return info.type
        return gguf_model.stored_type(name, shape, gguf.TensorType.F32)

    differing: list[str] = []
    own_step = step if "step" in fmt.read_options else None
    with parallel.engine("verify-gguf") as engine, \
            open_model(src, fmt, {"step": own_step} if own_step is not None else {}, towers="drop") as rows:
        if adapters:
            rows = merged(rows, adapters, step=None if own_step is not None else step, alpha=alpha)
        o = gguf_model.plan(rows, type_of, engine, min(gguf_model.BLOCK_BYTES, chunk_bytes, engine.budget.limit // 2))
        arch = file.metadata.get("general.architecture")
        if arch != o.spec_gguf.arch:
            raise MismatchError(f"{path}: general.architecture is {arch!r}; {src} is GGUF {o.spec_gguf.arch!r}")
        made = {t.name: t for t in o.tensors}
        extra = dict(o.extra())
        missing = [n for n in list(extra) + list(made) if n not in file.tensors]
        unexpected = [n for n in file.tensors if n not in made and n not in extra]
        for n, v in extra.items():
            if n in file.tensors and not _same(file, n, [v], v.shape):
                differing.append(n)
        for t in o.tensors:
            pieces = o.parts.take_many(t.name, o.counts[t.name])
            if t.name not in file.tensors:
                for _ in pieces:
                    pass
                continue
            if not _same(file, t.name, pieces, t.shape):
                differing.append(t.name)
    return GGUFVerifyReport(gguf=path, source=src, adapter=adapter, architecture=o.spec_gguf.arch,
                            tensors=len(made) + len(extra), identical=not (differing or missing or unexpected),
                            differing=differing, missing=missing, unexpected=unexpected,
                            seconds=round(time.perf_counter() - t0, 3))


def _same(file, name: str, pieces, shape: tuple[int, ...]) -> bool:
    """Whether tensor ``name`` of ``file`` has ``shape`` and the bytes of ``pieces`` (consumed)."""
    from ckptbridge.io import gguf

    info = file.tensors[name]
    ok = tuple(info.shape) == tuple(shape) and isinstance(info.type, gguf.TensorType)
    stored = file.array(name).reshape(-1).view(np.uint8) if ok else None
    at = 0
    for piece in pieces:
        if not ok or stored is None:
            ok = False
            continue
        b = np.ascontiguousarray(piece).reshape(-1).view(np.uint8)
        ok = at + b.size <= stored.size and np.array_equal(stored[at:at + b.size], b)
        at += b.size
    return ok and stored is not None and at == stored.size
