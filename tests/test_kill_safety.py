"""SIGKILL `convert` and `merge` at random moments: the destination is then either absent or complete
and valid, and the temporary directory a killed run leaves is clearly named and cleaned by the next run."""

import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.pinned_only]
TRIALS = 12  # per verb (two verbs: 24 kills in all)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from ckptbridge.testing import write_random_adapter, write_random_checkpoint

    root = tmp_path_factory.mktemp("kill")
    # wide enough that writing takes a good share of each run
    base = write_random_checkpoint(str(root / "base"), dtype="bfloat16", vocab_size=8192, hidden_size=512,
                                   intermediate_size=1536, num_hidden_layers=6, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, global_head_dim=128,
                                   num_global_key_value_heads=1, max_shard_size=8 * 2**20)
    adapter = write_random_adapter(base, str(root / "adapter"), r=16)
    return {"root": root, "base": base, "adapter": adapter}


def cli(*args):
    return [sys.executable, "-m", "ckptbridge", *args, "--quiet"]


def timed(argv):
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return time.perf_counter() - t0


def orbax_leaves(path):
    from ckptbridge.io.orbax import OrbaxCheckpoint

    ckpt = OrbaxCheckpoint(path)
    leaves = list(ckpt.leaves)
    return {p: np.asarray(v).tobytes() for p, v in ckpt.read(leaves).items()}


def kill_trials(argv_for, dst_of, check_complete, total_s, tmp, rng):
    outcomes = {"absent": 0, "complete": 0}
    for i in range(TRIALS):
        argv = argv_for(i)
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.3) * total_s)  # from the imports to past the end (a third land after it)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        dst = dst_of(i)
        if os.path.exists(dst):
            check_complete(dst)
            outcomes["complete"] += 1
        else:
            outcomes["absent"] += 1
        parent = os.path.dirname(dst)
        for name in os.listdir(parent):  # only our own clearly named temporary directories remain
            assert re.fullmatch(r"dst\d+|\.dst\d+\.ckptbridge-tmp-\d+\.\w+", name), name
    return outcomes


def test_kill_convert_and_merge(inputs, tmp_path):
    from ckptbridge.verify import compare_tensors

    rng = random.Random(1234)
    base, adapter = inputs["base"], inputs["adapter"]

    # references, and the time a full run takes
    ref_orbax, ref_merged = str(tmp_path / "ref-orbax"), str(tmp_path / "ref-merged")
    t_convert = timed(cli("convert", "safetensors-to-orbax", base, ref_orbax))
    t_merge = timed(cli("merge", base, adapter, ref_merged))
    want = orbax_leaves(ref_orbax)

    work = tmp_path / "convert"
    work.mkdir()
    convert = kill_trials(lambda i: cli("convert", "safetensors-to-orbax", base, str(work / f"dst{i}")),
                          lambda i: str(work / f"dst{i}"), lambda d: (orbax_leaves(d) == want) or pytest.fail(d),
                          t_convert, work, rng)
    work_m = tmp_path / "merge"
    work_m.mkdir()

    def merged_ok(d):
        r = compare_tensors(ref_merged, d)
        assert r.identical, d

    merge = kill_trials(lambda i: cli("merge", base, adapter, str(work_m / f"dst{i}")),
                        lambda i: str(work_m / f"dst{i}"), merged_ok, t_merge, work_m, rng)
    # both outcomes happened: kills landed before and after the commit
    assert convert["absent"] and convert["complete"], convert
    assert merge["absent"] + merge["complete"] == TRIALS and merge["absent"], merge

    # a leftover of a killed run is removed by the next run writing the same destination (a kill
    # between the rename into place and the clean-up leaves one beside a complete destination,
    # which only a run with --overwrite writes again)
    for work_dir, run in ((work, lambda d, *o: cli("convert", "safetensors-to-orbax", base, d, *o)),
                          (work_m, lambda d, *o: cli("merge", base, adapter, d, *o))):
        for i in range(TRIALS):
            dst = str(work_dir / f"dst{i}")
            left = [n for n in os.listdir(work_dir) if n.startswith(f".dst{i}.ckptbridge-tmp-")]
            if not os.path.exists(dst) or left:
                argv = run(dst, "--overwrite") if os.path.exists(dst) else run(dst)
                assert subprocess.run(argv, capture_output=True, timeout=600).returncode == 0
        assert not [n for n in os.listdir(work_dir) if ".ckptbridge-tmp-" in n]
    assert orbax_leaves(str(work / "dst0")) == want and compare_tensors(ref_merged, str(work_m / "dst0")).identical
