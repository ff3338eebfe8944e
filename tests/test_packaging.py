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
    from ckptbridge import merge_lora

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


# What only torch or peft install: a train-only environment has none of them.
TORCH_SIDE = ("torch", "torchgen", "functorch", "peft", "nvidia", "triton", "accelerate")


def _torch_side(entry: str) -> bool:
    name = entry.split("-")[0].split(".")[0].lower()
    return name in TORCH_SIDE or name.startswith(("nvidia_", "torch_", "_torch"))


@pytest.fixture(scope="module")
def train_venv(tmp_path_factory):
    """A virtual environment holding the project's environment (.venv) less torch, peft and what
    only they bring: every other entry of its site-packages linked in (its .pth files too, so
    ckptbridge is the same editable install)."""
    import glob
    import sysconfig

    venv = str(tmp_path_factory.mktemp("train-only") / "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    target = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))[0]
    source = sysconfig.get_paths()["purelib"]
    for entry in os.listdir(source):
        if not _torch_side(entry) and not os.path.exists(os.path.join(target, entry)):
            os.symlink(os.path.join(source, entry), os.path.join(target, entry))
    return venv


def test_train_extra_resolves_without_torch_or_peft(tmp_path):
    """``pip install 'ckptbridge[train]'`` (the JAX side: what a TPU VM installs) resolves
    without torch or peft; the verify extra still asks for them."""
    report = tmp_path / "report.json"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
                          "--disable-pip-version-check", "--report", str(report), "-c",
                          os.path.join(ROOT, "requirements", "core.lock"), f"{ROOT}[train]"],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    names = {i["metadata"]["name"].lower() for i in json.load(open(report))["install"]}
    assert {"jax", "flax", "google-tunix", "qwix", "grain", "optax", "orbax-checkpoint"} <= names
    assert not names & {"torch", "peft"}, sorted(names & {"torch", "peft"})
    from ckptbridge import deps

    assert {"torch", "peft"} <= {r.name for r in deps.declared()["verify"]}


def test_training_runs_without_torch_or_peft(train_venv, checkpoints, tmp_path):
    """In an environment without torch and peft, ``python -m training`` trains and checkpoints
    (a TPU VM's install); ``ckptbridge env`` says train is usable and verify is not."""
    py = os.path.join(train_venv, "bin", "python")
    probe = subprocess.run([py, "-c", "import torch"], capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    out = tmp_path / "run"
    r = subprocess.run([py, "-m", "training", "--preset", "tiny-cpu", "--base", checkpoints["keqv_lm_f32_sharded"],
                        "--out", str(out), "--max-steps", "2", "--quiet", "max_length=256"],
                       capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["steps"] == 2 and os.listdir(out / "checkpoints")
    env = subprocess.run([py, "-m", "ckptbridge.cli", "env", "--json"], capture_output=True, text=True, cwd=ROOT)
    extras = json.loads(env.stdout)["extras"]
    assert extras["train"]["usable"] and not extras["verify"]["usable"], extras
