"""Golden files for the ``--json`` output of every CLI verb of ``python -m ckptbridge``.

Each case runs the CLI in a fresh process (as a user does) on tiny inputs built here with fixed
seeds, normalises the few values that differ between runs or machines (:func:`normalise`), and
compares the result with ``tests/golden/<case>.json``: keys, values, types and key order, shown
as a unified diff when they differ. The raw stdout must also be exactly the JSON that
``json.dumps(..., indent=2)`` prints.

Verbs covered: ``convert safetensors-to-orbax``, ``convert orbax-to-safetensors``,
``convert orbax-to-peft`` (``--target hf`` and ``vllm``), ``convert peft-to-orbax`` (``--kv
exact``, ``--kv svd``, a vLLM export), ``merge`` (Orbax LoRA and PEFT adapter), ``inspect`` (HF
model, Orbax weights, Orbax LoRA saved by Tunix and written by ckptbridge, PEFT adapter made by
PEFT and by ckptbridge, a single .safetensors file), ``verify logits``, ``verify tensors``
(identical and different), ``verify adapter`` (full on a PEFT adapter, ``--no-exact`` on an Orbax
LoRA, ``--lint-only`` with and without findings) and ``env --json`` (machine-dependent: only its
key structure and value types are pinned, see :func:`env_skeleton`).

Not covered: ``verify served`` (it needs a running vLLM server).

The inputs are built here (fixed seeds, one tiny base) rather than with conftest's
``checkpoints`` fixture, so that the goldens do not depend on that fixture's rows.

Re-record after an intended change of an output::

    CKPTBRIDGE_RECORD_GOLDEN=1 python -m pytest tests/test_json_golden.py

(rewrites every golden file; the cases are then skipped).
"""

from __future__ import annotations

import difflib
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")
RECORD = os.environ.get("CKPTBRIDGE_RECORD_GOLDEN") == "1"
TMP = "<TMP>"

# Keys whose values differ between runs or machines: the value is replaced by "<TYPE>" (its JSON
# type, so that a changed type still shows), wherever the key occurs. Everything else is exact.
NORMALISED_KEYS = {
    "seconds",  # wall time of a conversion or merge
    "tunix_version",  # the installed google-tunix (s2o report; Orbax metadata read back by inspect)
    "orbax_writer",  # "streaming" or "public": depends on the installed orbax-checkpoint (or CKPTBRIDGE_ORBAX_WRITER)
    # Floating-point measurements: identical run to run on one machine (checked when recorded), but
    # their low digits depend on the CPU's BLAS / XLA kernels, so they are pinned as floats only.
    "rel_l2",  # verify logits, verify adapter (exact): transformers vs Tunix
    "max_abs_diff",  # verify logits
    "rel_change",  # verify adapter (live): how much the adapter moves the logits
    "svd_relative_error",  # peft-to-orbax --kv svd: {module: error}; the module names stay exact
    "weight_rel_l2", "rel_l2_weights_only",  # verify quantized: stored weights vs the source's, and their logits
}
# Absolute paths: every string that contains the tmp root gets TMP instead of it (not by key:
# paths occur under many keys and nested in metadata).


def _type_name(value) -> str:
    return {type(None): "null", bool: "bool", int: "int", float: "float", str: "str", list: "list",
            dict: "dict"}[type(value)]


def _placeholder(value):
    """A normalised value: its type in angle brackets; a dict keeps its keys (and their order)."""
    if isinstance(value, dict):
        return {k: _placeholder(v) for k, v in value.items()}
    return f"<{_type_name(value)}>"


# Keys normalised in one output only: verify quantized's argmax agreement is of logits that differ by
# design (a near tie can go either way), while verify logits' must stay 1.0.
CASE_NORMALISED_KEYS = {"verify_quantized": {"argmax_agreement"}}


def normalise(value, tmp_roots: tuple[str, ...], keys: frozenset | set = NORMALISED_KEYS):
    """``value`` (parsed JSON) with the values of :data:`NORMALISED_KEYS` replaced by placeholders
    and the tmp roots in strings by :data:`TMP`; order and everything else kept."""
    if isinstance(value, dict):
        return {normalise(k, tmp_roots, keys): _placeholder(v) if k in keys else normalise(v, tmp_roots, keys)
                for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v, tmp_roots, keys) for v in value]
    if isinstance(value, str):
        for root in tmp_roots:
            value = value.replace(root, TMP)
    return value


# env --json describes the machine: only its key structure and the types of its values are pinned.
# Paths (with "*" for any key) whose type or presence depends on the machine, and what is pinned
# for them: a set of allowed types, or None for an optional key (left out of the skeleton).
ENV_VARYING = {
    ("platform", "libc"): {"str", "null"},
    ("cpus", "usable"): {"int", "null"},
    ("cpus", "affinity"): {"str", "null"},
    ("memory", "*"): {"int", "null"},
    ("transparent_hugepages", "*"): {"str", "null"},
    ("packages", "*", "version"): {"str", "null"},  # null: not installed here
    ("packages", "*", "distribution"): None,  # only where another distribution provides the package
    ("extras", "*", "problems"): None,  # only where the extra is not usable here
    ("accelerators", "*"): {"dict", "null"},  # null: not installed; its keys depend on the devices found
    ("environment_variables",): {"dict"},  # which of the variables env reports are set
}


def _varying(path: tuple[str, ...]):
    for pattern, allowed in ENV_VARYING.items():
        if len(pattern) == len(path) and all(p in ("*", k) for p, k in zip(pattern, path)):
            return pattern, allowed
    return None


def env_skeleton(value, path: tuple[str, ...] = ()):
    """Keys (recursively, in order) and value types of ``env --json``; lists are "list"."""
    match = _varying(path) if path else None
    if match is not None:
        pattern, allowed = match
        assert allowed is not None and _type_name(value) in allowed, (path, value)
        return "|".join(sorted(allowed))
    if isinstance(value, dict):
        return {k: env_skeleton(v, path + (k,)) for k, v in value.items()
                if not ((m := _varying(path + (k,))) is not None and m[1] is None)}
    return _type_name(value)


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m ckptbridge ARGS`` in a fresh process, with this checkout's ckptbridge (as
    conftest.run_cli, plus the working directory) and none of ckptbridge's switches set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPTBRIDGE_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "ckptbridge", *args], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)


# kv at rank 8 with its own alpha, the rest rank 4 (alpha != rank): patterns in PEFT, padding for vLLM
LORA_RULES = [{"module_path": ".*kv_einsum", "rank": 8, "alpha": 32.0},
              {"module_path": ".*(q_einsum|k_einsum|attn_vec_einsum|gate_proj|up_proj|down_proj)", "rank": 4,
               "alpha": 10.0}]

# name (golden file), expected exit code, CLI arguments ({x}: the path of input or output x).
# In order: later cases read what earlier ones wrote.
CASES = [
    ("convert_safetensors-to-orbax", 0, "convert safetensors-to-orbax {base} {out}/orbax --quiet"),
    ("convert_orbax-to-safetensors", 0, "convert orbax-to-safetensors {out}/orbax {out}/back --max-shard-size 200KB --quiet"),
    ("convert_orbax-to-peft_hf", 0, "convert orbax-to-peft {lora} {out}/o2p-hf --base {base} --quiet"),
    ("convert_orbax-to-peft_vllm", 0, "convert orbax-to-peft {lora} {out}/o2p-vllm --base {base} --target vllm --quiet"),
    ("convert_peft-to-orbax", 0, "convert peft-to-orbax {peft} {out}/p2o --base {base} --quiet"),
    ("convert_peft-to-orbax_svd", 0, "convert peft-to-orbax {peft} {out}/p2o-svd --base {base} --kv svd --quiet"),
    ("convert_peft-to-orbax_vllm-export", 0,
     "convert peft-to-orbax {out}/o2p-vllm {out}/p2o-vllm --base {base} --step 9 --quiet"),
    ("merge_orbax-lora", 0, "merge {base} {lora} {out}/merged-orbax --quiet"),
    ("merge_peft", 0, "merge {base} {peft} {out}/merged-peft --max-shard-size 150KB --quiet"),
    ("quantize_int8", 0, "quantize {base} {out}/q8 --scheme int8 --quiet"),
    ("merge_peft_fp8", 0, "merge {base} {peft} {out}/merged-fp8 --quantize fp8 --quiet"),
    ("convert_to-gguf_orbax-lora", 0, "convert to-gguf {base} {out}/merged.gguf --adapter {lora} --outtype q8_0 --quiet"),
    ("convert_adapter-to-gguf_orbax-lora", 0, "convert adapter-to-gguf {lora} {out}/lora.gguf --base {base} --quiet"),
    ("inspect_hf-model", 0, "inspect {base}"),
    ("inspect_quantized-model", 0, "inspect {out}/q8"),
    ("inspect_safetensors-file", 0, "inspect {base}/model-00001-of-00002.safetensors"),
    ("inspect_orbax-weights", 0, "inspect {out}/orbax"),
    ("inspect_orbax-lora_tunix", 0, "inspect {lora}"),
    ("inspect_orbax-lora_ckptbridge", 0, "inspect {out}/p2o"),
    ("inspect_gguf-model", 0, "inspect {out}/merged.gguf"),
    ("inspect_gguf-adapter", 0, "inspect {out}/lora.gguf"),
    ("inspect_peft-adapter_peft", 0, "inspect {peft}"),
    ("inspect_peft-adapter_ckptbridge", 0, "inspect {out}/o2p-vllm"),
    ("verify_logits", 0, "verify logits {base} --tunix {out}/orbax"),
    ("verify_quantized", 0, "verify quantized {out}/q8 --source {base}"),
    ("verify_tensors_identical", 0, "verify tensors {base} {out}/back"),
    ("verify_tensors_different", 6, "verify tensors {base} {out}/merged-peft"),
    ("verify_adapter_peft", 0, "verify adapter {peft} --base {base}"),
    ("verify_adapter_orbax-lora_no-exact", 0, "verify adapter {lora} --base {base} --no-exact"),
    ("verify_adapter_lint-only", 0, "verify adapter {lora} --base {base} --lint-only"),
    ("verify_adapter_lint-only_findings", 6, "verify adapter {out}/o2p-hf --base {base} --target vllm --lint-only"),
    ("env", 0, "env"),
]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """Build the inputs (fixed seeds) and run every case in order: name -> (process, tmp roots)."""
    from ckptbridge.testing import build_checkpoint, build_peft_adapter, build_tunix_lora, save_tunix_lora

    root = tmp_path_factory.mktemp("golden")
    tmp_roots = tuple(dict.fromkeys([os.path.realpath(root), str(root)]))
    base = build_checkpoint(str(root / "base"), attention_k_eq_v=True, prefix="model.language_model.",
                            dtype="float32", shards=2, seed=0)
    model, rules = build_tunix_lora(base, LORA_RULES, seed=1)
    lora = save_tunix_lora(model, str(root / "lora"), step=3, custom_metadata={
        "ckptbridge": {"kind": "lora", "family": "gemma4", "lora": {"rules": rules}}})
    del model
    peft = build_peft_adapter(base, str(root / "peft"), r=4, lora_alpha=10, seed=3,
                              rank_pattern={"down_proj": 6}, alpha_pattern={"down_proj": 3})
    paths = {"base": base, "lora": lora, "peft": peft, "out": str(root / "out")}
    os.makedirs(paths["out"])
    done = {}
    for name, _, argv in CASES:
        done[name] = _cli(*argv.format(**paths).split(), "--json")
    return done, tmp_roots


def _golden_path(name: str) -> str:
    return os.path.join(GOLDEN, f"{name}.json")


@pytest.mark.parametrize("name, code", [(name, code) for name, code, _ in CASES], ids=[c[0] for c in CASES])
def test_json_output_matches_golden(outputs, name, code):
    done, tmp_roots = outputs
    proc = done[name]
    assert proc.returncode == code, f"{name}: exit {proc.returncode} (expected {code})\n{proc.stderr[-3000:]}"
    try:
        parsed = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        pytest.fail(f"{name}: stdout is not JSON ({e}):\n{proc.stdout[:3000]}\nstderr:\n{proc.stderr[-3000:]}")
    # the text itself, not only what it parses to: one JSON document as json.dumps(indent=2) prints it
    assert proc.stdout == json.dumps(parsed, indent=2) + "\n", f"{name}: --json output is not indent=2 JSON"
    got = env_skeleton(parsed) if name == "env" else normalise(
        parsed, tmp_roots, NORMALISED_KEYS | CASE_NORMALISED_KEYS.get(name, set()))
    text = json.dumps(got, indent=2) + "\n"
    path = _golden_path(name)
    if RECORD:
        os.makedirs(GOLDEN, exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        pytest.skip(f"recorded {os.path.relpath(path, ROOT)}")
    assert os.path.isfile(path), f"{path}: no golden file; record with CKPTBRIDGE_RECORD_GOLDEN=1"
    with open(path) as f:
        want = f.read()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            f"golden/{name}.json", f"{name} (now)", n=3))
        pytest.fail(f"`ckptbridge {name}` --json differs from its golden file (- golden, + now); re-record with "
                    f"CKPTBRIDGE_RECORD_GOLDEN=1 only if the change is intended:\n{diff}", pytrace=False)


def test_no_stray_golden_files():
    """Every golden file belongs to a case (a renamed or dropped case leaves none behind)."""
    names = {f"{name}.json" for name, _, _ in CASES}
    stray = sorted(set(os.listdir(GOLDEN)) - names) if os.path.isdir(GOLDEN) else []
    assert not stray, f"golden files of no case in {GOLDEN}: {stray}"


def test_normalise():
    """The normalisation: only the listed keys and the tmp root change; order is kept."""
    value = {"z": "/t/x/a", "seconds": 1.5, "svd_relative_error": {"m2": 0.5, "m1": 0.25}, "a": [1, 2.0, None],
             "tunix_version": None, "rel_l2": 1e-7}
    got = normalise(value, ("/t/x",))
    assert list(got) == ["z", "seconds", "svd_relative_error", "a", "tunix_version", "rel_l2"]
    assert got == {"z": "<TMP>/a", "seconds": "<float>", "svd_relative_error": {"m2": "<float>", "m1": "<float>"},
                   "a": [1, 2.0, None], "tunix_version": "<null>", "rel_l2": "<float>"}
    assert json.dumps(normalise({"a": 1}, ())) != json.dumps(normalise({"a": 1.0}, ()))
    skel = env_skeleton({"memory": {"total": None}, "extras": {"x": {"usable": False, "problems": ["p"]}},
                         "packages": {"p": {"version": "1", "distribution": "d", "required": {"core": ">=1"}}}})
    assert skel == {"memory": {"total": "int|null"}, "extras": {"x": {"usable": "bool"}},
                    "packages": {"p": {"version": "null|str", "required": {"core": "str"}}}}
