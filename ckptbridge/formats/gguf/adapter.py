"""GGUF LoRA: any adapter written as a GGUF LoRA adapter, which ggml's runtimes apply to the base
model's GGUF file at load time (``--lora FILE``, Ollama's ``ADAPTER``).

A GGUF LoRA holds ``<tensor>.lora_a`` (PEFT's A, ``(rank, in)``) and ``<tensor>.lora_b`` (B,
``(out, rank)``) per adapted tensor of the base, under the base's GGUF names and with ggml's value
changes (q/k rows reordered in B where the family's GGUF form rotates interleaved pairs), and one
``adapter.lora.alpha``: ggml scales each delta by alpha / rank with the rank read from B, and by 1
when alpha is 0. Where every module's PEFT
scale times its rank is the same number, that number is the alpha (the file ggml's own
``convert_lora_to_gguf.py`` writes for such adapters); where it is not (per-module ranks or
alphas, rsLoRA with several ranks), each module's scale is folded into its B and alpha is 0, so
the adapter computes exactly what it computes in PEFT. ggml's converter writes one alpha whatever
the patterns, which changes those adapters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import numpy as np

from ckptbridge import mapping
from ckptbridge.errors import ConfigError, UnsupportedError
from ckptbridge.formats.gguf.model import GGML_QUANT_VERSION, OUTTYPES, _family, _plan, store, stored_type, title
from ckptbridge.io import gguf
from ckptbridge.lora.factors import AdapterRows
from ckptbridge.progress import Progress
from ckptbridge.report import Report, human_bytes
from ckptbridge.rows import Request
from ckptbridge.specs.ggml import interleaved_rope_rows


@dataclasses.dataclass(frozen=True)
class GGUFAdapterReport(Report):
    direction: str
    source: str
    base: str
    destination: str
    family: str
    architecture: str
    outtype: str
    modules: int
    alpha: float
    scales_folded: bool
    bytes: int
    seconds: float

    def summary(self) -> str:
        how = ("each module's scale folded into its B, alpha 0 (its modules' scales differ)" if self.scales_folded
               else f"alpha {self.alpha:g}")
        return (f"{self.direction}: {self.source} -> {self.destination}\n"
                f"  {self.family} as GGUF {self.architecture} LoRA, {self.outtype}: {self.modules} modules, {how}; "
                f"{human_bytes(self.bytes)} in {self.seconds:.2f} s")


def write(ad: AdapterRows, dst: str, req: Request, *, outtype: str = "f32",
          name: str | None = None) -> GGUFAdapterReport:
    """Write ``ad`` as the GGUF LoRA ``dst`` for its base (whose GGUF is ``convert --to gguf`` of the
    base). ``outtype``: stored type of the factors (default f32, as ggml's converter)."""
    if outtype not in OUTTYPES:
        raise ConfigError(f"outtype (--outtype) {outtype!r}: one of {', '.join(OUTTYPES)}")
    wanted = OUTTYPES[outtype][0]
    b = ad.base
    spec_gguf, h = _family(b.cfg, b.path)
    tensors = _plan(b.cfg, spec_gguf, mapping.entries(b.cfg, b.spec, b.prefix), lambda n, s: wanted, h)
    by_key = {k: t for t in tensors for k in t.keys}
    deltas = []
    for key, row, scale, (a, bm) in ad.deltas():
        t = by_key.get(key)
        if t is None:
            raise UnsupportedError(f"{ad.path}: LoRA on {key}, which ggml's {spec_gguf.arch} has no tensor for")
        rows = math.prod(t.hf_shape[:-1])
        if len(t.keys) > 1 or row != 0 or len(bm) != rows:
            raise UnsupportedError(f"{ad.path}: LoRA on rows {row}:{row + len(bm)} of {key} (one expert of a "
                                   "stacked tensor), which a GGUF LoRA cannot express; merge it instead "
                                   "(convert BASE DST.gguf --adapter ADAPTER)")
        deltas.append((key, t, float(scale), np.asarray(a, np.float32), np.asarray(bm, np.float32)))
    if not deltas:
        raise UnsupportedError(f"{ad.path}: no LoRA module ggml can apply")
    products = [scale * len(a) for _, _, scale, a, _ in deltas]
    folded = not all(math.isclose(p, products[0], rel_tol=1e-9) for p in products)
    lora_alpha = 0.0 if folded else _alpha(ad, products[0])
    planned: list[gguf.PlannedTensor] = []
    for _key, t, scale, a, bm in sorted(deltas, key=lambda d: d[0]):  # the converter's order: by module name
        if folded:
            bm = bm * np.float32(scale)
        if t.rope_heads is not None:
            bm = interleaved_rope_rows(bm, t.rope_heads)
        for suffix, values in ((".lora_a", a), (".lora_b", bm)):
            n = t.name + suffix
            kind = stored_type(n, values.shape, wanted)
            planned.append(gguf.PlannedTensor(n, values.shape, kind, functools.partial(store, values, kind)))
    metadata = {"general.architecture": gguf.string(spec_gguf.arch), "general.type": gguf.string("adapter"),
                "adapter.type": gguf.string("lora"),
                "general.name": gguf.string(name or title(os.path.basename(os.path.normpath(req.source)))),
                "adapter.lora.alpha": gguf.f32(lora_alpha),
                "general.quantization_version": gguf.u32(GGML_QUANT_VERSION)}
    bar = Progress(sum(p.nbytes for p in planned), req.desc, enabled=req.progress)
    size = gguf.write_gguf(dst, metadata, planned, overwrite=req.overwrite, sources=[b.path, req.source],
                           on_written=bar.update)
    bar.close()
    return GGUFAdapterReport(direction=req.direction, source=req.source, base=b.path, destination=dst,
                             family=b.cfg.family, architecture=spec_gguf.arch, outtype=outtype, modules=len(deltas),
                             alpha=lora_alpha, scales_folded=folded, bytes=size,
                             seconds=round(time.perf_counter() - req.t0, 3))


def _alpha(ad, product: float) -> float:
    """The alpha of an adapter whose modules share scale x rank: PEFT's ``lora_alpha`` as recorded
    (what ggml's converter writes) when it is that product, else the product."""
    recorded = getattr(getattr(ad, "config", None), "lora_alpha", None)
    if isinstance(recorded, (int, float)) and math.isclose(float(recorded), product, rel_tol=1e-9):
        return float(recorded)
    return product


__all__ = ["GGUFAdapterReport", "write"]
