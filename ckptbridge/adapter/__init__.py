"""Adapter algebra on every adapter format: combine, resize, extract.

- :func:`combine`: several adapters (PEFT, Tunix/qwix LoRA, MaxText LoRA; mixed, each with its own
  rank and alpha) into one, with PEFT's ``add_weighted_adapter`` methods (:mod:`.methods`);
- :func:`resize`: an adapter at another rank per module: the best rank-``r`` factors of each
  module's delta (Eckart-Young, from the factors' small QR), or the smallest rank that keeps a
  fraction of its squared norm;
- :func:`extract`: a LoRA from a model of any format minus its base, one module at a time in
  float32 (:mod:`.lowrank`).

Each computes every module's factors first (on ``workers`` threads, kept in a temporary
directory, not in memory), then hands them as one adapter (:class:`~ckptbridge.lora.factors.ComputedLora`)
to the writer of the format asked for (``to``: ``peft``, ``tunix-lora``, ``maxtext-lora``,
``gguf-lora``), with that format's options. Results are float32 unless ``dtype`` says otherwise.
Nothing is written at ``dst`` unless the whole operation succeeds.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ckptbridge import formats, hub, options
from ckptbridge.adapter.lowrank import factor_matrix, truncate_product
from ckptbridge.adapter.methods import METHODS, NEEDS_DENSITY, SIGN_METHODS, SVD_METHODS, combine_module
from ckptbridge.errors import ConfigError, MismatchError
from ckptbridge.formats import ADAPTER, Format
from ckptbridge.lora.modules import Scaling
from ckptbridge.report import Report

DTYPES = options.ADAPTER_DTYPES
MODULE_LIST = 8  # modules named in a summary line before "and N more"
ROW_BLOCK = 32 << 20  # bytes of rows compared at a time outside the LoRA modules


@dataclasses.dataclass(frozen=True)
class AlgebraReport(Report):
    """What ``adapter combine|resize|extract`` did: the inputs, the method, every module's rank and
    the relative error its factors left (``||D - B A||_F / ||D||_F``, 0 where exact), the
    modules left out, and the writer's own report."""

    OMIT_NONE = ("method", "weights", "base", "left_out", "other_differences", "kept_full")

    direction: str
    sources: list[str]
    destination: str
    format: str
    modules: int
    ranks: dict[str, int]
    relative_errors: dict[str, float]
    written: Report
    seconds: float
    method: str | None = None
    weights: list[float] | None = None
    base: str | None = None
    left_out: list[str] | None = None
    other_differences: dict[str, float] | None = None
    kept_full: list[str] | None = None
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def max_error(self) -> float:
        return max(self.relative_errors.values(), default=0.0)

    def summary(self) -> str:
        ranks = sorted(set(self.ranks.values()))
        rank = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        how = f" ({self.method})" if self.method else ""
        lines = [f"{self.direction}{how}: {', '.join(self.sources)} -> {self.destination} ({self.format})",
                 f"  {self.modules} modules, {rank}, largest relative error {self.max_error:.3g}, "
                 f"{self.seconds:.2f} s"]
        if self.left_out:
            lines.append(f"  left out (delta zero): {_listed(self.left_out)}")
        if self.other_differences:
            kept = (" (kept whole: modules_to_save)" if self.kept_full
                    else " (not in the adapter; --keep-full keeps them)")
            lines.append(f"  other tensors that differ{kept}: {_listed(list(self.other_differences))}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - MODULE_LIST} more" if len(names) > MODULE_LIST else ""
    return ", ".join(names[:MODULE_LIST]) + more


class _Spill:
    """Computed factors kept on disk until the writer reads them (one ``.npy`` pair per module)."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="ckptbridge-adapter-")

    def _path(self, name: str, which: str) -> str:
        return os.path.join(self.dir, f"{name}.{which}.npy")

    def put(self, name: str, a: np.ndarray, b: np.ndarray) -> None:
        np.save(self._path(name, "A"), a)
        np.save(self._path(name, "B"), b)

    def get(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return np.load(self._path(name, "A")), np.load(self._path(name, "B"))

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _dtype(dtype: str | None, default: np.dtype) -> np.dtype:
    if dtype is None:
        return np.dtype(default)
    options.choice("dtype (--dtype)", dtype, DTYPES)
    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def _destination(to: str | None, default: str, write_options: dict[str, Any]) -> Format:
    fmt = formats.get(to or default)
    if fmt.kind != ADAPTER or not fmt.writes:
        names = ", ".join(n for n, f in formats.FORMATS.items() if f.kind == ADAPTER and f.writes)
        raise ConfigError(f"--to {fmt.name}: not an adapter format ckptbridge writes; use one of {names}")
    for name, value in write_options.items():
        if value is not None and name not in fmt.write_options:
            opt = formats.OPTIONS.get(name)
            raise ConfigError(f"{opt.cli if opt else name}: not an option of writing {fmt.name}; drop it "
                              "(`ckptbridge formats` says which format takes which)")
    return fmt


def _local_adapter(ref: str) -> str:
    return hub.local(ref, hub.ADAPTER, what="adapter")


def recorded_base(src: str, fmt: Format, step: int | None) -> str | None:
    """The base model an adapter records: PEFT's ``base_model_name_or_path``, or the base an
    Orbax LoRA checkpoint written by ckptbridge names in its metadata."""
    if fmt.name == "peft":
        from ckptbridge.formats.peft import AdapterConfig

        return AdapterConfig.read(src).base_model_name_or_path
    if fmt.orbax:
        from ckptbridge.io.orbax import OrbaxCheckpoint, resolve_checkpoint

        ckpt = OrbaxCheckpoint(resolve_checkpoint(src, step))
        try:
            return ckpt.metadata.base
        finally:
            ckpt.close()
    return None


def _base_of(base: str | None, first: str, fmt: Format, step: int | None, revision: str | None):
    from ckptbridge.lora.base import open_base

    if base is None:
        base = recorded_base(first, fmt, step)
        if base is None or not (os.path.isdir(base) or hub.parse_id(base) is not None):
            raise ConfigError(f"{first}: records no base model that is here ({base!r}); pass --base with the HF "
                              "base model directory or Hub id")
    return open_base(hub.local(base, hub.CONFIG, revision=revision, what="base model"))


def _check_rank(rank: int | None, name: str, shape_a: tuple[int, ...], shape_b: tuple[int, ...]) -> None:
    if rank is not None and rank > min(shape_a[-1], shape_b[0]):
        raise ConfigError(f"--rank {rank}: larger than module {name} allows ({shape_b[0]} x {shape_a[-1]}: at most "
                          f"{min(shape_a[-1], shape_b[0])}); give a smaller rank")


def _compute_all(names: list, work: Callable[[Any], None], workers: int | None, desc: str,
                 progress: bool | None) -> None:
    """``work(name)`` for every module on ``workers`` threads (default: the usable cores), with a bar."""
    from ckptbridge.progress import Progress
    from ckptbridge.stream import default_workers

    count = options.workers("workers (--workers)", workers) or default_workers(None)
    bar = Progress(len(names), desc, enabled=progress, unit=" modules")
    with concurrent.futures.ThreadPoolExecutor(count, thread_name_prefix="adapter") as pool:
        futures = [pool.submit(work, n) for n in names]
        try:
            for f in futures:
                f.result()
                bar.update(1)
        except BaseException:
            for f in futures:
                f.cancel()
            raise
    bar.close()


def _write(modules: dict[str, tuple[Scaling, np.dtype]], spill: _Spill, base, path: str, dst: str, dest: Format,
           write_options: dict[str, Any], *, overwrite: bool, progress: bool | None, direction: str,
           workers: int | None) -> Report:
    from ckptbridge.lora.factors import ComputedLora
    from ckptbridge.rows import Request
    from ckptbridge.stream import Parallelism

    def pair(name: str):
        dtype = modules[name][1]
        a, b = spill.get(name)
        return a.astype(dtype), b.astype(dtype)

    ad = ComputedLora(path, base, modules, pair)
    parallel = Parallelism.of(workers)
    with parallel.engine(direction) as engine:
        req = Request(source=path, destination=dst, direction=direction, engine=engine, chunk_bytes=0, chunked=False,
                      overwrite=overwrite, progress=progress, desc=f"{direction} -> {dest.name}", adapters=(),
                      adapter_step=None, t0=time.perf_counter())
        return dest.write(ad, dst, req, **{k: v for k, v in write_options.items() if v is not None})


def _check_dst(dst: str, sources: list[str], overwrite: bool) -> None:
    from ckptbridge.io.atomic import check_destination

    check_destination(dst, sources, overwrite)


def _open_adapters(paths: Sequence[str], base, step: int | None, alpha: float | None, stack) -> list:
    from ckptbridge.conversion import open_adapter

    return [stack.enter_context(open_adapter(p, base, step=step, alpha=alpha)) for p in paths]


def _ordered(base, names: set[str]) -> list[str]:
    return [n for n in base.by_hf_module() if n in names]


def _shape(base, name: str, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    mod, _ = base.by_hf_module()[name]
    shapes = mod.shapes(rank)
    return shapes["a_peft"], shapes["b_peft"]


def combine(adapters: Sequence[str], dst: str, *, method: str, weights: Sequence[float] | None = None,
            rank: int | None = None, density: float | None = None, majority_sign: str | None = None,
            seed: int = 0, base: str | None = None, to: str | None = None, dtype: str | None = None,
            step: int | None = None, alpha: float | None = None, overwrite: bool = False,
            progress: bool | None = None, workers: int | None = None, revision: str | None = None,
            **write_options: Any) -> AlgebraReport:
    """Combine ``adapters`` (any adapter formats, mixed; each with its own rank and alpha) into one
    at ``dst`` with PEFT's ``add_weighted_adapter`` ``method`` and ``weights`` (default 1 each):
    ``cat`` (rank: the sum), ``linear``, ``ties``, ``dare_linear``, ``dare_ties``,
    ``magnitude_prune`` (equal ranks; the rank stays), ``svd`` and the ``_svd`` forms (``rank``,
    default the largest). ``density`` for the pruning methods, ``majority_sign`` (``total``,
    ``frequency``) for the ``ties`` ones, ``seed`` for ``dare``. ``base``: the HF base model
    (default: the one the first adapter records). ``to``: the format written (default the first
    adapter's), with its ``write_options``. The result has ``lora_alpha = r`` (scale 1), float32
    unless ``dtype``."""
    t0 = time.perf_counter()
    options.choice("method (--method)", method, METHODS)
    if not adapters:
        raise ConfigError("give at least one adapter to combine")
    weights = [1.0] * len(adapters) if weights is None else [float(w) for w in weights]
    if len(weights) != len(adapters):
        raise ConfigError(f"--weights: {len(weights)} weights for {len(adapters)} adapters; give one weight per "
                          "adapter")
    notes = []
    if len(adapters) == 1 and method != "linear":
        notes.append(f"one adapter: combined with linear, not {method} (PEFT's rule)")
        method = "linear"
    base_method = method.removesuffix("_svd")
    if method in NEEDS_DENSITY:
        if density is None:
            raise ConfigError(f"--method {method} prunes: give --density, the fraction of entries kept (0 < D <= 1)")
        if not 0 < density <= 1:
            raise ConfigError(f"--density {density}: the fraction of entries kept, 0 < D <= 1")
    elif density is not None:
        raise ConfigError(f"--density applies to {', '.join(NEEDS_DENSITY)}; --method {method} does not prune: drop it")
    if majority_sign is not None:
        options.choice("majority_sign (--majority-sign)", majority_sign, SIGN_METHODS)
        if base_method not in ("ties", "dare_ties"):
            raise ConfigError(f"--majority-sign applies to the ties methods; --method {method} elects no sign: drop it")
    if rank is not None and method not in SVD_METHODS:
        raise ConfigError(f"--rank applies to svd and the _svd methods; {method} gives "
                          + ("the sum of the ranks" if method == "cat" else "the adapters' common rank") + ": drop it")
    if rank is not None and rank < 1:
        raise ConfigError(f"--rank {rank}: must be >= 1")
    paths = [_local_adapter(a) for a in adapters]
    first = formats.detect(paths[0], step)
    dest = _destination(to, first.name, write_options)
    _check_dst(dst, [*paths, *([base] if base and os.path.exists(base) else [])], overwrite)
    with contextlib.ExitStack() as stack:
        b = _base_of(base, paths[0], first, step, revision)
        opened = _open_adapters(paths, b, step, alpha, stack)
        names = _ordered(b, {n for ad in opened for n in ad.names()})
        ranks = [max((ad.scaling_of(n).rank for n in ad.names()), default=0) for ad in opened]
        if method == "cat":
            new_rank = sum(ranks)
        elif method in SVD_METHODS:
            new_rank = rank or max(ranks)
        else:
            new_rank = ranks[0]
            for n in names:
                have = {p: ad.scaling_of(n).rank for p, ad in zip(adapters, opened) if n in set(ad.names())}
                if len(set(have.values())) > 1:
                    raise MismatchError(
                        f"{n}: ranks differ ({', '.join(f'{p}: {r}' for p, r in have.items())}); {method} needs equal "
                        "ranks (PEFT's rule): use cat or an svd method, or resize them first (ckptbridge adapter "
                        "resize --rank R)")
                new_rank = next(iter(have.values()))
        for n in names if method in SVD_METHODS else ():  # cat and the others keep their factors' ranks
            _check_rank(new_rank, n, *_shape(b, n, new_rank))
        out_dtype = _dtype(dtype, np.dtype(np.float32))
        have_sets = [set(ad.names()) for ad in opened]
        errors: dict[str, float] = {}
        lock = threading.Lock()
        spill = _Spill()
        stack.callback(spill.close)
        module_rank: dict[str, int] = {}

        def work(n: str) -> None:
            idx = [i for i, s in enumerate(have_sets) if n in s]
            pairs = [opened[i].pair(n) for i in idx]
            scales = [opened[i].scaling_of(n).scale for i in idx]
            r = new_rank if method in ("cat", *SVD_METHODS) else pairs[0][0].shape[0]
            rng = np.random.default_rng([seed, names.index(n)])
            a, bb, err = combine_module(method, pairs, scales, [weights[i] for i in idx], r, density=density,
                                        sign_method=majority_sign or "total", rng=rng)
            spill.put(n, a, bb)
            with lock:
                module_rank[n] = r
                errors[n] = float(err or 0.0)

        _compute_all(names, work, workers, f"combine ({method})", progress)
        modules = {n: (Scaling(module_rank[n], module_rank[n]), out_dtype) for n in names}
        written = _write(modules, spill, b, paths[0], dst, dest, write_options, overwrite=overwrite,
                         progress=progress, direction="adapter combine", workers=workers)
    return AlgebraReport(direction="adapter combine", sources=list(adapters), destination=dst, format=dest.name,
                         modules=len(names), ranks=module_rank, relative_errors=errors, written=written,
                         seconds=round(time.perf_counter() - t0, 3), method=method, weights=weights, notes=notes)


def resize(src: str, dst: str, *, rank: int | None = None, energy: float | None = None, base: str | None = None,
           to: str | None = None, dtype: str | None = None, step: int | None = None, alpha: float | None = None,
           overwrite: bool = False, progress: bool | None = None, workers: int | None = None,
           revision: str | None = None, **write_options: Any) -> AlgebraReport:
    """``src`` (any adapter format) at ``dst`` with every module's delta ``scale * B @ A`` cut to
    its best rank-``rank`` factors (a rank above the module's own pads with zeros), or to the
    smallest rank keeping ``energy`` of its squared Frobenius norm; each module keeps its alpha.
    Reports every module's rank and the relative error left (Eckart-Young: the norm of the
    singular values dropped)."""
    t0 = time.perf_counter()
    _rank_or_energy(rank, energy)
    path = _local_adapter(src)
    fmt = formats.detect(path, step)
    if fmt.kind != ADAPTER:
        raise ConfigError(f"{src}: a {fmt.name} model, not an adapter; to make an adapter from a model use "
                          "`ckptbridge adapter extract`")
    dest = _destination(to, fmt.name, write_options)
    _check_dst(dst, [path], overwrite)
    with contextlib.ExitStack() as stack:
        b = _base_of(base, path, fmt, step, revision)
        (ad,) = _open_adapters([path], b, step, alpha, stack)
        names = ad.names()
        for n in names:
            _check_rank(rank, n, *_shape(b, n, 1))
        spill = _Spill()
        stack.callback(spill.close)
        errors: dict[str, float] = {}
        module_rank: dict[str, int] = {}
        scalings: dict[str, Scaling] = {}
        lock = threading.Lock()

        def work(n: str) -> None:
            sc = ad.scaling_of(n)
            a, bb = ad.pair(n)
            f = truncate_product(bb, a, sc.scale, rank, energy)
            new = Scaling(f.rank, sc.alpha, sc.rslora)
            spill.put(n, f.a.astype(np.float32), (f.b / new.scale).astype(np.float32))
            with lock:
                module_rank[n], errors[n], scalings[n] = f.rank, f.error, new

        _compute_all(names, work, workers, "resize", progress)
        modules = {n: (scalings[n], _dtype(dtype, ad.dtype_of(n))) for n in names}
        written = _write(modules, spill, b, path, dst, dest, write_options, overwrite=overwrite, progress=progress,
                         direction="adapter resize", workers=workers)
    return AlgebraReport(direction="adapter resize", sources=[src], destination=dst, format=dest.name,
                         modules=len(names), ranks={n: module_rank[n] for n in names},
                         relative_errors={n: errors[n] for n in names}, written=written,
                         seconds=round(time.perf_counter() - t0, 3))


def _rank_or_energy(rank: int | None, energy: float | None) -> None:
    if (rank is None) == (energy is None):
        raise ConfigError("give one of --rank R (the rank of every module) or --energy F (the smallest rank keeping "
                          "the fraction F of each module's squared norm)")
    if rank is not None and rank < 1:
        raise ConfigError(f"--rank {rank}: must be >= 1")
    if energy is not None and not 0 < energy <= 1:
        raise ConfigError(f"--energy {energy}: a fraction of the squared norm, 0 < F <= 1")


def extract(model: str, dst: str, *, base: str, rank: int | None = None, energy: float | None = None,
            modules: str | None = None, randomized: bool = False, seed: int = 0, keep_full: bool = False,
            to: str = "peft", dtype: str | None = None, config: str | None = None, step: int | None = None,
            overwrite: bool = False, progress: bool | None = None, workers: int | None = None,
            revision: str | None = None, **write_options: Any) -> AlgebraReport:
    """A LoRA of ``model`` (any model format: HF, Tunix, MaxText, GGUF F32/F16/BF16; a GGUF file
    needs ``config``) against ``base`` (any model format of the same family and shapes), at ``dst``:
    per LoRA module of the family (those matching the regex ``modules``), the best rank-``rank``
    factors of ``model - base`` in float32 (or the smallest rank keeping ``energy`` of its squared
    norm), exactly (the Gram matrix of the smaller side, float64) or ``randomized``; one module at
    a time. Modules whose delta is zero are left out; other tensors that differ (norms,
    embeddings) are listed, and with ``keep_full`` (PEFT only) written whole as ``modules_to_save``.
    The adapter has ``lora_alpha = r`` (scale 1), float32 unless ``dtype``."""
    t0 = time.perf_counter()
    _rank_or_energy(rank, energy)
    pattern = None
    if modules is not None:
        try:
            pattern = re.compile(modules)
        except re.error as e:
            raise ConfigError(f"--modules {modules!r}: not a regular expression ({e})") from None
    dest = _destination(to, "peft", write_options)
    if keep_full and dest.name != "peft":
        raise ConfigError(f"--keep-full writes whole tensors as PEFT modules_to_save; --to {dest.name} cannot hold "
                          "them: write --to peft, or drop --keep-full")
    from ckptbridge.conversion import open_model

    model = hub.local(model, hub.MODEL, revision=revision, what="model")
    base = hub.local(base, hub.MODEL, revision=revision, what="base model")
    mfmt, bfmt = formats.detect(model, step), formats.detect(base, step)
    for path, fmt, what in ((model, mfmt, "MODEL"), (base, bfmt, "--base")):
        if fmt.kind == ADAPTER:
            raise ConfigError(f"{path}: a {fmt.name} adapter; {what} must be a model (to resize an adapter use "
                              "`ckptbridge adapter resize`)")
    _check_dst(dst, [model, base], overwrite)
    with contextlib.ExitStack() as stack:
        opts = {"config": config} if config else {}
        mrows = stack.enter_context(open_model(model, mfmt, {k: v for k, v in opts.items() if k in mfmt.read_options},
                                               towers="drop"))
        brows = stack.enter_context(open_model(base, bfmt, {k: v for k, v in opts.items() if k in bfmt.read_options},
                                               towers="drop"))
        if mrows.spec.name != brows.spec.name:
            raise MismatchError(f"{model}: a {mrows.spec.name} model, but the base {base} is {brows.spec.name}; "
                                "extract against the model it was fine-tuned from")
        b = _hf_base(base, bfmt, brows)
        by_path = {e.tunix_path: e for e in mrows.entries}
        base_by_path = {e.tunix_path: e for e in brows.entries}
        chosen = [(m, i, name) for m in b.modules for i, name in enumerate(m.hf_modules)
                  if pattern is None or pattern.search(name)]
        if not chosen:
            raise ConfigError(f"--modules {modules!r}: matches none of the model's LoRA modules (e.g. "
                              f"{b.modules[0].hf_modules[0]})")
        for m, i, name in chosen:
            for rows, path in ((mrows, model), (brows, base)):
                entries = by_path if rows is mrows else base_by_path
                if m.entry.tunix_path not in entries:
                    raise MismatchError(f"{path}: has no {name}; extract against the base the model was made from")
            mshape = mrows.key_info(by_path[m.entry.tunix_path].hf_keys[i])[1]
            bshape = brows.key_info(base_by_path[m.entry.tunix_path].hf_keys[i])[1]
            if mshape != bshape:
                raise MismatchError(f"{name}: {model} has shape {mshape}, the base {base} {bshape}; extract "
                                    "against the base the model was fine-tuned from")
            _check_rank(rank, name, (1, mshape[-1]), (int(np.prod(mshape[:-1])), 1))
        spill = _Spill()
        stack.callback(spill.close)
        errors: dict[str, float] = {}
        module_rank: dict[str, int] = {}
        lock = threading.Lock()
        by_entry: dict[tuple, list[tuple[int, str]]] = {}
        for m, i, name in chosen:
            by_entry.setdefault(m.entry.tunix_path, []).append((i, name))

        def work(path: tuple) -> None:
            new, old = mrows.arrays(by_path[path]), brows.arrays(base_by_path[path])
            for i, name in by_entry[path]:
                d = new[i].reshape(-1, new[i].shape[-1]).astype(np.float32)  # the delta in place: one float32 copy
                np.subtract(d, old[i].reshape(d.shape), out=d, casting="unsafe")
                new[i] = old[i] = None  # read, not needed any more
                f = factor_matrix(d, rank, energy, randomized=randomized, seed=seed)
                del d
                if f.rank:
                    spill.put(name, f.a.astype(np.float32), f.b.astype(np.float32))
                with lock:
                    module_rank[name], errors[name] = f.rank, f.error

        _compute_all(list(by_entry), work, workers or 1, "extract", progress)
        names = [name for _, _, name in chosen if module_rank[name]]
        left_out = [name for _, _, name in chosen if not module_rank[name]]
        if not names:
            raise ConfigError(f"{model}: equals the base {base} in every LoRA module asked for; there is nothing to "
                              "extract")
        extracted = {by_path[m.entry.tunix_path].hf_keys[i] for m, i, _ in chosen}
        others = _other_differences(mrows, brows, extracted)
        out_dtype = _dtype(dtype, np.dtype(np.float32))
        mods = {n: (Scaling(module_rank[n], module_rank[n]), out_dtype) for n in names}
        if keep_full and others:
            write_options["full"] = _full_tensors(mrows, list(others))
        written = _write(mods, spill, b, model, dst, dest, write_options, overwrite=overwrite, progress=progress,
                         direction="adapter extract", workers=workers)
    return AlgebraReport(direction="adapter extract", sources=[model], destination=dst, format=dest.name,
                         modules=len(names), ranks={n: module_rank[n] for n in names},
                         relative_errors={n: errors[n] for n in names}, written=written,
                         seconds=round(time.perf_counter() - t0, 3), base=base, left_out=left_out or None,
                         other_differences=others or None, kept_full=sorted(others) if keep_full and others else None)


def _hf_base(base: str, fmt: Format, rows):
    """The base as adapters name it: the HF directory's config and key names, or those of the rows."""
    from ckptbridge.lora.base import make_base, open_base

    if fmt.name == "hf":
        return open_base(base)
    return make_base(rows.asset_dir() or base, rows.cfg, rows.spec, rows.prefix)


def _other_differences(mrows, brows, extracted: set[str]) -> dict[str, float]:
    """HF keys of the model other than ``extracted`` whose values differ from the base's: the
    largest absolute difference of each, compared a block of rows at a time where both sources
    read rows on their own."""
    base_by_path = {e.tunix_path: e for e in brows.entries}
    out: dict[str, float] = {}
    for e in mrows.entries:
        if e.tunix_path not in base_by_path:
            continue
        for i, key in enumerate(e.hf_keys):
            if key in extracted:
                continue
            bkey = base_by_path[e.tunix_path].hf_keys[i]
            shape, bshape = mrows.key_info(key)[1], brows.key_info(bkey)[1]
            if shape != bshape:
                raise MismatchError(f"{key}: shape {shape} in the model, {bshape} in the base; extract against the "
                                    "base the model was fine-tuned from")
            diff = 0.0
            for new, old in _row_blocks(mrows, key, brows, bkey, e, base_by_path[e.tunix_path], i):
                if new.size:
                    diff = max(diff, float(np.max(np.abs(new.astype(np.float32) - old.astype(np.float32)))))
            if diff > 0:
                out[key] = diff
    return out


def _full_tensors(rows, keys: list[str]) -> dict:
    """HF key -> (dtype, shape, a read of its values) for the PEFT writer's ``full``."""
    where = {k: (e, i) for e in rows.entries for i, k in enumerate(e.hf_keys)}

    def read(key: str) -> np.ndarray:
        e, i = where[key]
        return rows.arrays(e)[i]

    return {k: (*rows.key_info(k), functools.partial(read, k)) for k in keys}


def _row_blocks(mrows, key: str, brows, bkey: str, entry, bentry, i: int):
    """``(model rows, base rows)`` of one HF tensor in blocks of about :data:`ROW_BLOCK` bytes."""
    from ckptbridge.rows import matrix_rows

    dtype, shape = mrows.key_info(key)
    if not (mrows.row_addressable and brows.row_addressable) or len(shape) < 2:
        yield mrows.arrays(entry)[i], brows.arrays(bentry)[i]
        return
    rows = matrix_rows(shape)
    step = max(1, ROW_BLOCK // max(1, shape[-1] * np.dtype(dtype).itemsize))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        yield mrows.key_rows(key, start, stop), brows.key_rows(bkey, start, stop)


__all__ = ["AlgebraReport", "DTYPES", "METHODS", "combine", "extract", "recorded_base", "resize"]
