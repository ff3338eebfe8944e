"""Fixtures shared by the test files: the tiny checkpoints of tests/families.py (the family
contract's one table), built lazily once per session, and what is derived from them once (Orbax
conversions, LoRA adapters, reference logits); helpers to run the CLI and a server.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from collections.abc import Collection

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from families import CASES, TOKENS, seed, tunix_rules  # noqa: E402


class _Lazy(dict):
    """name -> value, made by ``make(name)`` the first time it is asked for."""

    def __init__(self, make):
        super().__init__()
        self._make = make

    def __missing__(self, name):
        value = self[name] = self._make(name)
        return value


# MaxText's own mapping and hooks for tiny configs per family row (scripts/maxtext_expected.py)
MAXTEXT_EXPECTED = os.path.join(ROOT, "tests", "data", "maxtext", "expected.json")
# every row of expected.json (MaxText has no scanned Gemma 4 E2B/E4B)
MAXTEXT_FAMILIES = ("qwen3-dense", "qwen3-moe", "qwen2.5", "llama3.1", "gemma4-dense", "gemma4-moe", "gemma3", "gemma2")
MAXTEXT_ROWS = [f"{family}/{scan}" for family in MAXTEXT_FAMILIES for scan in ("scanned", "unscanned")] + \
    ["gemma4-small/unscanned"]


def maxtext_plan(row: dict) -> list:
    """Our MaxText leaves (ckptbridge.formats.maxtext.layout.plan) for a row of expected.json, with the HF
    key prefix its keys use (the vision tower's too, in the multimodal rows)."""
    from ckptbridge import mapping, specs
    from ckptbridge.formats.maxtext.layout import plan, tower_plan
    from ckptbridge.formats.hf import find_prefix

    def flat(value):
        return [value] if isinstance(value, str) else [k for v in value for k in flat(v)]

    spec = specs.family_for(row["hf_config"])
    cfg = spec.parse_config(row["hf_config"], "expected.json")
    prefix = find_prefix(spec, [k for v in row["keys"].values() for k in flat(v["hf"])])
    towers = mapping.tower_entries(cfg, spec, prefix) if row["maxtext_config"]["use_multimodal"] else []
    return plan(mapping.entries(cfg, spec, prefix), spec.maxtext, row["scan_layers"], cfg.flags,
                vocab=row["maxtext_config"]["vocab_size"]) + tower_plan(towers, spec.maxtext)


@pytest.fixture(scope="session")
def maxtext_rows() -> dict:
    """``rows`` of tests/data/maxtext/expected.json: ``<family>/<scanned|unscanned>`` -> its keys."""
    import json

    with open(MAXTEXT_EXPECTED) as f:
        return json.load(f)["rows"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """row name (tests/families.py) -> path of its tiny HF checkpoint, built lazily, once per session.
    ``checkpoints.hashes[name]`` is the tree hash it was built with (inputs must stay untouched)."""
    from ckptbridge.testing import build_checkpoint

    root = tmp_path_factory.mktemp("hf")

    def build(name):
        path = build_checkpoint(str(root / name), seed=seed(name), **CASES[name].build)
        lazy.hashes[name] = tree_hash(path)
        return path

    lazy = _Lazy(build)
    lazy.hashes = {}
    return lazy


# Widths whose rows are whole Q8_0 blocks of 32 (the tiny rows' 40 and 56 are not; GGUF stores those F16)
WIDE = dict(hidden_size=64, intermediate_size=96)


@pytest.fixture(scope="session")
def wide(tmp_path_factory):
    """row name -> its model at widths of whole Q8_0 blocks (``WIDE``), built once."""
    from ckptbridge.testing import build_checkpoint

    root = tmp_path_factory.mktemp("wide")
    return _Lazy(lambda name: build_checkpoint(str(root / name), seed=seed(name), **{**CASES[name].build, **WIDE}))


@pytest.fixture(scope="session")
def converted(checkpoints, tmp_path_factory):
    """row name -> (Orbax checkpoint, report) of its safetensors-to-orbax conversion (towers
    included), made once per session. Read only."""
    from ckptbridge import convert_safetensors_to_orbax

    root = tmp_path_factory.mktemp("orbax")

    def convert(name):
        dst = str(root / name)
        report = convert_safetensors_to_orbax(checkpoints[name], dst, progress=False)
        return dst, report

    return _Lazy(convert)


@pytest.fixture(scope="session")
def precise():
    """float32 matmuls at full precision, for logits compared at 1e-5."""
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def base_logits(checkpoints, precise):
    """row name -> transformers' logits of its checkpoint on families.TOKENS (computed once)."""
    from ckptbridge.verify import hf_logits

    return _Lazy(lambda name: hf_logits(checkpoints[name], TOKENS))


class RowLora:
    """The LoRA adapters of one row, each made the first time it is asked for: ``peft`` (made by
    PEFT on the HF base), ``tunix`` (a Tunix+qwix LoRA model saved by Tunix's CheckpointManager at
    ``step``, its rules recorded), their logits on families.TOKENS, and each converted to the
    other kind with the verbs' defaults. Read only."""

    step = 3

    def __init__(self, name, base, root, base_logits):
        self.name, self.base, self._root, self._base_logits = name, base, root, base_logits

    @functools.cached_property
    def peft(self) -> str:
        from ckptbridge.testing import build_peft_adapter

        return build_peft_adapter(self.base, str(self._root / "peft"), r=4, lora_alpha=10, seed=3,
                                  **CASES[self.name].peft)

    @functools.cached_property
    def _tunix(self):
        from ckptbridge.testing import build_tunix_lora, save_tunix_lora
        from ckptbridge.verify import tunix_logits

        model, rules = build_tunix_lora(self.base, tunix_rules(self.name), seed=1)
        root = save_tunix_lora(model, str(self._root / "tunix"), step=self.step, custom_metadata={
            "ckptbridge": {"kind": "lora", "family": CASES[self.name].family, "lora": {"rules": rules}}})
        return root, rules, tunix_logits(model, TOKENS)

    @property
    def tunix(self) -> str:
        return self._tunix[0]

    @property
    def rules(self) -> list[dict]:
        return self._tunix[1]

    @property
    def tunix_logits(self):
        return self._tunix[2]

    @functools.cached_property
    def peft_logits(self):
        from ckptbridge.verify import peft_logits

        return peft_logits(self.base, self.peft, TOKENS)

    @property
    def base_logits(self):
        return self._base_logits[self.name]

    @functools.cached_property
    def peft_as_orbax(self):
        """``peft`` converted by peft-to-orbax with its defaults (kv exact, step 0): (root, report)."""
        from ckptbridge import convert_peft_to_orbax

        dst = str(self._root / "peft-as-orbax")
        return dst, convert_peft_to_orbax(self.peft, dst, base=self.base, progress=False)

    @functools.cached_property
    def tunix_as_peft(self):
        """``tunix`` converted by orbax-to-peft with its defaults (target hf): (directory, report)."""
        from ckptbridge import convert_orbax_to_peft

        dst = str(self._root / "tunix-as-peft")
        return dst, convert_orbax_to_peft(self.tunix, dst, base=self.base, progress=False)


@pytest.fixture(scope="session")
def adapters(checkpoints, base_logits, tmp_path_factory, precise):
    """row name -> its :class:`RowLora` (adapters made lazily, once per session). Read only."""
    root = tmp_path_factory.mktemp("lora")

    def make(name):
        (root / name).mkdir()
        return RowLora(name, checkpoints[name], root / name, base_logits)

    return _Lazy(make)


def assert_same_model(orig: str, back: str, allowed: set[str], values: bool = True,
                      without: Collection[str] = (), coarse: Collection[str] = ()) -> None:
    """Every tensor of ``back`` equals ``orig``'s bit for bit, but those of ``allowed`` keys, which
    may differ by two roundings of their dtype (of float16 for those ``coarse``: stored so on the
    way; by any amount without ``values``: a quantized weight of rounded inputs), and those
    ``without`` (a multimodal model's towers left out), which ``back`` does not have."""
    import numpy as np

    from ckptbridge.io.hf import HFModelDir

    with HFModelDir(orig) as a, HFModelDir(back) as b:
        assert set(a.keys()) - set(without) == set(b.keys())
        for key in b.keys():
            x, y = a.array(key), b.array(key)
            assert (x.dtype, x.shape) == (y.dtype, y.shape), key
            if x.tobytes() == y.tobytes():
                continue
            assert key in allowed, f"{key} differs"
            if not values:
                continue
            eps = float(np.finfo(np.float32).eps) if x.dtype == np.float32 else 2.0 ** -7
            if key in coarse:
                eps = max(eps, 2.0 ** -10)
            np.testing.assert_allclose(y.astype(np.float64), x.astype(np.float64), rtol=2 * eps,
                                       atol=2 * float(np.finfo(np.float32).eps), err_msg=key)


def tree_hash(path: str) -> str:
    """Hash of every file's relative path and bytes under ``path`` (inputs must stay untouched)."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(path)):
        dirnames.sort()
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            h.update(os.path.relpath(full, path).encode())
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def rewrite_checkpoint(src, dst, *, drop=None, add=None, rename=None, reshape=None) -> str:
    """A copy of the HF directory ``src`` with one tensor dropped, added, renamed or (``reshape``:
    (key, shape)) replaced by zeros of another shape (in whichever file holds it; an added one in
    the first file; the index follows)."""
    import json
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    index_path = os.path.join(dst, "model.safetensors.index.json")
    index = json.load(open(index_path)) if os.path.exists(index_path) else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    key = drop or (rename[0] if rename else None) or (reshape[0] if reshape else None)
    name = index["weight_map"][key] if (index and key) else files[0]
    tensors = load_file(os.path.join(dst, name))
    if drop:
        tensors.pop(drop)
    if add:
        tensors[add] = np.zeros(4, np.float32)
    if rename:
        tensors[rename[1]] = tensors.pop(rename[0])
    if reshape:
        tensors[reshape[0]] = np.zeros(reshape[1], tensors[reshape[0]].dtype)
    save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})
    if index:
        wm = index["weight_map"]
        if drop:
            wm.pop(drop)
        if add:
            wm[add] = name
        if rename:
            wm[rename[1]] = wm.pop(rename[0])
        json.dump(index, open(index_path, "w"))
    return str(dst)


def run_cli(*args: str, timeout: int = 300, env: dict | None = None,
            python: str = sys.executable) -> subprocess.CompletedProcess:
    """Run the ckptbridge CLI in a fresh process (``python``: another environment's), with
    ``env`` added to the environment."""
    return subprocess.run(
        [python, "-m", "ckptbridge", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})},
    )


def start_server(base: str, adapters: dict, tmp, *extra: str):
    """``python -m serving serve`` (cpu profile, float32) on ``base`` with ``adapters`` (name ->
    dir), waited for until it says ``serving``. Returns (process, url, log, stderr path)."""
    import time

    from serving.server import free_port

    port = free_port()
    log, err = str(tmp / "server.log"), str(tmp / "serve.stderr")
    proc = subprocess.Popen([sys.executable, "-m", "serving", "serve", "--profile", "cpu", "--model", base,
                             *[a for name, path in adapters.items() for a in ("--adapter", f"{name}={path}")],
                             *extra, "--port", str(port), "--log", log, "--dtype", "float32"],
                            stdout=subprocess.PIPE, stderr=open(err, "w"), text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        line = proc.stdout.readline()
        if line.startswith("serving ") or proc.poll() is not None:
            break
    assert proc.poll() is None, open(err).read()[-3000:] + (open(log).read()[-3000:] if os.path.exists(log) else "")
    return proc, f"http://127.0.0.1:{port}", log, err


def stop_server(proc) -> None:
    """SIGTERM lets `serving serve` stop vLLM's whole process group."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def flat_state(module) -> dict:
    """An nnx module's parameters as {path tuple of str: leaf} (leaves as nnx gives them)."""
    from flax import nnx

    flat = {}

    def walk(node, prefix=()):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, prefix + (str(key),))
        else:
            flat[prefix] = node

    walk(nnx.state(module).to_pure_dict())
    return flat
