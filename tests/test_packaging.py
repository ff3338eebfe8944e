"""`pip install .` alone (no extras) in a fresh virtual environment: the `ckptbridge` CLI and
`import ckptbridge` work with no jax, torch, tunix or huggingface_hub; merge of a PEFT adapter
gives the same bytes as in the full environment; verbs that need an extra say which in one line."""

import json
import os
import subprocess
import sys

import pytest

from ckptbridge.testing import build_peft_adapter
from ckptbridge.verify import compare_tensors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module", params=["floor", "newest"])
def core_venv(request, tmp_path_factory):
    """The core install with its dependencies at the floors pyproject.toml declares
    (requirements/floor-core.txt), or at the newest versions pip resolves."""
    venv = str(tmp_path_factory.mktemp(f"core-{request.param}") / "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    floor = ["-c", os.path.join(ROOT, "requirements", "floor-core.txt")] if request.param == "floor" else []
    pip = subprocess.run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q",
                          "--disable-pip-version-check", *floor, ROOT], capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    return venv


def _run(venv, *args, env=None):
    return subprocess.run([os.path.join(venv, "bin", "ckptbridge"), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_core_install_merges_and_inspects(core_venv, checkpoints, tmp_path):
    py = os.path.join(core_venv, "bin", "python")
    installed = subprocess.run([py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True).stdout
    names = {line.split("==")[0].lower() for line in installed.split()}
    assert not names & {"jax", "torch", "google-tunix", "orbax-checkpoint", "transformers", "peft", "huggingface-hub"}
    # ckptbridge is the only top-level package installed (training/serving/pipeline run from a checkout),
    # and it says it is typed
    record = subprocess.run([py, "-c", "import importlib.metadata as m; print('\\n'.join(str(f) for f in "
                             "m.distribution('ckptbridge').files))"], capture_output=True, text=True, cwd=str(tmp_path))
    files = record.stdout.split()
    top = {f.split("/")[0] for f in files if not f.startswith("..") and ".dist-info" not in f.split("/")[0]}
    assert top == {"ckptbridge"} and "ckptbridge/py.typed" in files, (top, record.stderr)
    probe = subprocess.run([py, "-c", "import sys, ckptbridge, ckptbridge.cli, ckptbridge.merge, ckptbridge.inspect; "
                            "print(sorted(m for m in ('jax', 'torch', 'orbax', 'tensorstore') if m in sys.modules))"],
                           capture_output=True, text=True, cwd=str(tmp_path))
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stderr
    assert _run(core_venv, "--help").returncode == 0

    base = checkpoints["kv_text_f32_sharded"]
    peft_dir = build_peft_adapter(base, str(tmp_path / "peft"), r=4, lora_alpha=8, seed=9)
    from ckptbridge.merge import merge_lora

    merge_lora(base, peft_dir, str(tmp_path / "full"), progress=False)
    cli = _run(core_venv, "merge", base, peft_dir, str(tmp_path / "core"), "--quiet")
    assert cli.returncode == 0, cli.stderr
    assert compare_tensors(str(tmp_path / "full"), str(tmp_path / "core")).identical
    info = _run(core_venv, "inspect", base, "--json")
    assert info.returncode == 0 and '"family": "gemma4"' in info.stdout, info.stderr
    lint = _run(core_venv, "verify", "adapter", peft_dir, "--base", base, "--lint-only")
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_core_env_report(core_venv):
    r = _run(core_venv, "env", "--json")
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    pins = dict(line.split("==") for line in open(os.path.join(ROOT, "requirements", "floor-core.txt"))
                if "==" in line and not line.startswith("#"))
    for name, pin in pins.items():
        version = env["packages"][name]["version"]
        assert version is not None and (version == pin.strip() if "core-floor" in core_venv else True), (name, version)
    for name in ("orbax-checkpoint", "jax", "torch", "transformers", "google-tunix", "huggingface_hub"):
        assert env["packages"][name]["version"] is None, name
    assert env["extras"]["core"]["usable"] and not env["extras"]["orbax"]["usable"]
    assert "pip install 'ckptbridge[orbax]'" in env["extras"]["orbax"]["problems"][0]
    assert env["verbs"]["merge"]["works"] and not env["verbs"]["convert safetensors-to-orbax"]["works"]
    assert env["accelerators"] == {"jax": None, "torch": None}


@pytest.mark.parametrize("argv, extra", [
    (("convert", "safetensors-to-orbax", "{base}", "{tmp}/orbax"), "orbax"),
    (("verify", "logits", "{base}"), "verify"),
    (("merge", "acme/tiny", "acme/lora", "{tmp}/merged"), "hub"),
])
def test_missing_extras_say_which(core_venv, checkpoints, tmp_path, argv, extra):
    args = [a.format(base=checkpoints["kv_text_f32_sharded"], tmp=tmp_path) for a in argv]
    cli = _run(core_venv, *args)
    assert cli.returncode == 8, cli.stderr
    assert f"pip install 'ckptbridge[{extra}]'" in cli.stderr and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert not any(os.path.exists(a) for a in args if a.startswith(str(tmp_path)))
