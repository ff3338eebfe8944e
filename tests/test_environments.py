"""The same conversions in another environment give the same bytes.

``.venv-floor`` has every dependency at the floor ``pyproject.toml`` declares
(``requirements/floor.txt``: orbax-checkpoint 0.12.0, jax 0.10.0, tensorstore 0.1.84, flax
0.12.7, ...); ``CKPTBRIDGE_COMPARE_ENVS`` names others (``scripts/setup.sh --newest`` builds
``.venv-newest``). Each conversion of ``ckptbridge.testing.COMPAT_STEPS`` (both directions of
weights and LoRA, merge of either adapter kind) runs through that environment's CLI on the same
inputs as here: HF and PEFT outputs must be identical files, Orbax outputs identical arrays
(bytes, dtypes, shapes) and metadata (``ckptbridge.testing.output_digest``).
"""

import os
import sys

import pytest

from ckptbridge.testing import COMPAT_STEPS, build_compat_inputs, run_compat_steps

from conftest import ROOT, run_cli

ENVS = [p for p in os.environ.get("CKPTBRIDGE_COMPARE_ENVS", ".venv-floor").split(":") if p]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_compat_inputs(str(tmp_path_factory.mktemp("env_inputs")))


@pytest.fixture(scope="module")
def here(inputs, tmp_path_factory):
    return run_compat_steps(sys.executable, inputs, str(tmp_path_factory.mktemp("here")))


@pytest.mark.parametrize("env", ENVS)
def test_outputs_are_byte_identical(env, inputs, here, tmp_path):
    python = os.path.join(ROOT, env, "bin", "python")
    if not os.path.exists(python):
        pytest.fail(f"{env} is missing: run scripts/setup.sh (it builds the floor environment)")
    if os.path.realpath(sys.prefix) == os.path.realpath(os.path.join(ROOT, env)):
        pytest.skip(f"running in {env} itself")
    versions = run_cli("env", "--json", "--no-accelerators", python=python)
    assert versions.returncode == 0, versions.stderr
    there = run_compat_steps(python, inputs, str(tmp_path))
    for name, _ in COMPAT_STEPS:
        assert there[name] == here[name], f"{name}: {env} wrote other bytes"
