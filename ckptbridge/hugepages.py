"""Transparent huge pages for the large buffers of the verbs that move many bytes.

TensorStore encodes and decodes Orbax chunks in buffers from glibc's ``malloc``, each mapped
fresh and faulted in 4 KiB at a time: converting a 6.3 GiB checkpoint spends 13-22 s of CPU
in the kernel, most of it on those faults (``docs/benchmarks.md``). glibc 2.35 and later can
ask the kernel for transparent huge pages for them (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``),
which numpy already does for its own arrays; the tunable is read only when a process starts,
so the ``ckptbridge`` program re-executes itself once with it for those verbs when the system
allows it (Linux, glibc >= 2.35, transparent huge pages in ``madvise`` mode). Calling
:func:`ckptbridge.cli.main` with arguments never re-executes; ``CKPTBRIDGE_NO_HUGE_PAGES=1``
turns it off.
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "CKPTBRIDGE_NO_HUGE_PAGES"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _glibc_version() -> tuple[int, ...] | None:
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()
        return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):  # not glibc, or no confstr
        return None


def wanted(environ=os.environ) -> bool:
    """Whether re-executing with the tunable would change anything here."""
    if not sys.platform.startswith("linux") or environ.get(OPT_OUT):
        return False
    if "glibc.malloc.hugetlb" in environ.get("GLIBC_TUNABLES", ""):
        return False  # set already (by us, or by the user either way)
    version = _glibc_version()
    if version is None or version < (2, 35):
        return False
    try:
        with open(THP_MODE) as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def environment(environ=os.environ) -> dict:
    """``environ`` with the tunable added to ``GLIBC_TUNABLES``."""
    env = dict(environ)
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), TUNABLE) if t)
    return env


def reexec(argv: list[str]) -> None:
    """Replace this process by ``python -m ckptbridge ARGV`` with the tunable set (no return)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "ckptbridge", *argv], environment())
