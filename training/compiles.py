"""What JAX compiles, and its persistent compilation cache: the one module that knows the events.

Counting goes through ``jax.monitoring`` (a public listener) on the events JAX records around each
backend compilation (``BACKEND_COMPILE_EVENT``: its duration and the program's name, cache loads
included) and each persistent-cache hit (``CACHE_HIT_EVENT``, recorded inside the compilation it
belongs to, on the same thread). Their names are JAX's; ``tests/test_training.py`` fails if a
compilation stops being seen, so a rename upstream cannot silently zero the counts.
"""

from __future__ import annotations

import dataclasses
import os
import threading

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class Counts:
    compiles: int = 0  # backend compilations (a persistent-cache hit is one too, loaded not compiled)
    seconds: float = 0.0  # spent in them
    cache_hits: int = 0  # of them loaded from the persistent cache
    # per program name: [compilations, seconds, cache hits]
    programs: dict[str, list] = dataclasses.field(default_factory=dict)

    def since(self, before: Counts) -> Counts:
        programs = {}
        for name, (n, s, h) in self.programs.items():
            n0, s0, h0 = before.programs.get(name, (0, 0.0, 0))
            if n > n0:
                programs[name] = [n - n0, s - s0, h - h0]
        return Counts(self.compiles - before.compiles, self.seconds - before.seconds,
                      self.cache_hits - before.cache_hits, programs)

    def by_program(self) -> dict[str, dict]:
        """``{name: {"compiles", "seconds", "cache_hits"}}``, the slowest first."""
        rows = sorted(self.programs.items(), key=lambda kv: -kv[1][1])
        return {name: {"compiles": n, "seconds": round(s, 3), "cache_hits": h} for name, (n, s, h) in rows}


_lock = threading.Lock()
_totals = Counts()
_watching = False
_pending = threading.local()  # cache hits seen on this thread since its last compilation ended


def _on_duration(event: str, duration: float, fun_name: str = "?", **_) -> None:
    if event == BACKEND_COMPILE_EVENT:
        hits = getattr(_pending, "hits", 0)
        _pending.hits = 0
        with _lock:
            _totals.compiles += 1
            _totals.seconds += duration
            row = _totals.programs.setdefault(str(fun_name), [0, 0.0, 0])
            row[0] += 1
            row[1] += duration
            row[2] += hits


def _on_event(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:
        _pending.hits = getattr(_pending, "hits", 0) + 1
        with _lock:
            _totals.cache_hits += 1


def watch() -> None:
    """Start counting this process's compilations (once; later calls do nothing)."""
    global _watching
    import jax

    with _lock:
        if _watching:
            return
        _watching = True
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    jax.monitoring.register_event_listener(_on_event)


def totals() -> Counts:
    """The compilations counted since :func:`watch`."""
    with _lock:
        return Counts(_totals.compiles, _totals.seconds, _totals.cache_hits,
                      {k: list(v) for k, v in _totals.programs.items()})


def use_cache(directory: str) -> str:
    """Keep JAX's compiled programs in ``directory`` (created), every program whatever its compile
    time, so a resumed or repeated run with the same shapes loads instead of compiling. Returns the
    absolute directory."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = os.path.abspath(directory)
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != path:
        jax.config.update("jax_compilation_cache_dir", path)
        compilation_cache.reset_cache()  # a cache opened earlier in this process (another run) is left
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
