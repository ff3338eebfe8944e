"""Where the threads of one ``ckptbridge`` command spend their wall time: the command runs in this
process (``ckptbridge.cli.main``) while a sampler thread looks at every other thread every
``--interval`` seconds and counts its innermost frames. Printed: the wall time, the samples per
thread group (the writer is ``MainThread``; the engine's workers are named after the conversion,
e.g. ``tunix-gguf``; ``writeback`` hands written pages to the disk), and the most frequent
stacks. Reading it: workers mostly in ``thread.py:_worker`` are idle (the writer, or the memory
budget, holds them back); a writer mostly in ``stream.py:take`` waits for the workers; frames in
``orbax.py:result`` wait on TensorStore's own threads (decoding, encoding, reading).

    .venv/bin/python benchmarks/convert_profile.py [--interval 0.01] [--top 25] -- convert SRC DST --to FORMAT ...
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--interval", type=float, default=0.01, help="seconds between samples")
    ap.add_argument("--top", type=int, default=25, help="stacks to print")
    ap.add_argument("--depth", type=int, default=4, help="innermost frames of a stack")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the ckptbridge command and its arguments")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    stacks: collections.Counter = collections.Counter()
    groups: collections.Counter = collections.Counter()
    stop = threading.Event()

    def sample() -> None:
        me = threading.get_ident()
        while not stop.wait(args.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                group = names.get(tid, "?").rstrip("0123456789_-")
                frames = traceback.extract_stack(frame)[-args.depth:]
                stacks[group, " < ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in reversed(frames))] += 1
                groups[group] += 1

    from ckptbridge.cli import main as cli

    sampler = threading.Thread(target=sample, daemon=True)
    t0 = time.perf_counter()
    cpu0 = os.times()
    sampler.start()
    try:
        code = cli(command)
    finally:
        stop.set()
        wall = time.perf_counter() - t0
        cpu = os.times()
        print(f"wall {wall:.1f} s, CPU {cpu.user - cpu0.user:.1f} user + {cpu.system - cpu0.system:.1f} system s; "
              f"samples per thread group: {dict(groups)}", file=sys.stderr)
        for (group, stack), n in stacks.most_common(args.top):
            print(f"{n:7d} {group:<16} {stack}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
