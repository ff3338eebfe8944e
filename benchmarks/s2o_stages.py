"""Where the CPU time of safetensors-to-orbax goes, stage by stage, in one process: each stage
adds one step to the one before, over the same row blocks the conversion makes (``--chunk-size``,
read with ``pread``, rearranged by ``layout.rearrange``, written by TensorStore as zarr v2 chunks
with zstd level 1, which is what Orbax writes), with the wall, user and system CPU of each.

    GLIBC_TUNABLES=glibc.malloc.hugetlb=1 .venv/bin/python benchmarks/s2o_stages.py BASE [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ckptbridge import mapping  # noqa: E402
from ckptbridge.options import parse_size  # noqa: E402
from ckptbridge.formats.hf import open_hf_source  # noqa: E402


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def _stage(name: str, fn) -> None:
    u0, s0 = _cpu()
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    u1, s1 = _cpu()
    print(f"{name:48s} wall {t:6.2f}  user {u1 - u0:6.2f}  sys {s1 - s0:6.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", help="HF model directory (e.g. a base of benchmarks/convert_31b.py --keep)")
    ap.add_argument("--chunk-size", default="128MiB")
    ap.add_argument("--dir", help="where the files are written (default: the system's temporary directory)")
    args = ap.parse_args()
    import tensorstore as ts

    chunk = parse_size(args.chunk_size)
    source = open_hf_source(args.base)
    plan = []
    for e in source.entries:
        b = mapping.blocks(e)
        nbytes = int(np.prod(e.tunix_shape)) * source.dtype(e).itemsize
        if b is None or nbytes <= chunk:
            plan.append((e, None, None))
        else:
            per = max(1, chunk // max(1, nbytes // b.count))
            plan += [(e, b, r) for r in b.ranges(per)]

    def read_only() -> None:
        for e, b, r in plan:
            source.arrays(e) if b is None else source.hf_block(b, *r)

    def tunix(e, b, r) -> np.ndarray:
        return source.tunix_value(e) if b is None else b.to_tunix(source.hf_block(b, *r), *r)

    def rearranged() -> None:
        for p in plan:
            tunix(*p)

    def written(kvstore, compress: bool):
        def run() -> None:
            pending = []
            for n, p in enumerate(plan):
                a = np.ascontiguousarray(tunix(*p))
                raw = a.view(np.uint16 if a.dtype.itemsize == 2 else np.float32)
                store = ts.open({"driver": "zarr", "kvstore": kvstore(n), "metadata": {
                    "shape": list(a.shape), "chunks": list(a.shape), "dtype": raw.dtype.str,
                    "compressor": {"id": "zstd", "level": 1} if compress else None}},
                    create=True, delete_existing=True).result()
                pending.append(store.write(raw))
                while len(pending) > 2:
                    pending.pop(0).result()
            for f in pending:
                f.result()
        return run

    out = tempfile.mkdtemp(prefix="s2o-stages-", dir=args.dir)
    try:
        _stage("read (page cache -> fresh arrays)", read_only)
        _stage("+ rearrange", rearranged)
        _stage("+ zstd level 1 in TensorStore, into memory",
               written(lambda n: {"driver": "memory", "path": f"a{n}/"}, True))
        _stage("+ writing the files", written(lambda n: {"driver": "file", "path": f"{out}/a{n}/"}, True))
        shutil.rmtree(out)
        os.makedirs(out)
        _stage("read + rearrange + write, no compression",
               written(lambda n: {"driver": "file", "path": f"{out}/a{n}/"}, False))
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
