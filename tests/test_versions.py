"""Every floor pyproject.toml declares is a version a test environment is built with, and the
README's "Supported versions" table is the one scripts/versions_table.py derives from them."""

import os
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import versions_table  # noqa: E402

# where each group's floors are pinned: the core alone, the extras' environment, vLLM's side
CORE, FLOOR, SERVE = "floor-core.txt", "floor.txt", "floor-serve.txt"
VLLM_SIDE = {"vllm", "transformers"}  # of the serve extra; its other packages are the client side


def pins(name: str) -> dict[str, Version]:
    out = {}
    for line in open(os.path.join(ROOT, "requirements", name)):
        line = line.split("#")[0].strip()
        if "==" in line:
            pkg, version = line.split("==", 1)
            out[versions_table.canonical(pkg)] = Version(version.split("+")[0])
    return out


def where(extra: str, package: str) -> str:
    if extra == "core":
        return CORE
    return SERVE if extra == "serve" and package in VLLM_SIDE else FLOOR


@pytest.mark.parametrize("extra", ["core", "orbax", "gcs", "hub", "verify", "train", "serve"])
def test_every_floor_is_pinned_in_a_test_environment(extra):
    import tomllib

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = project["dependencies"] if extra == "core" else project["optional-dependencies"][extra]
    for text in reqs:
        req = Requirement(text)
        floor = next(s.version for s in req.specifier if s.operator == ">=")
        names = [versions_table.canonical(d) for d in versions_table.PROVIDERS.get(req.name, (req.name,))]
        env = where(extra, req.name)
        pinned = [pins(env)[n] for n in names if n in pins(env)]
        assert pinned == [Version(floor)], f"{req.name}>={floor} ({extra}): {env} pins {pinned or 'nothing'}"
        lock = env.replace(".txt", ".lock")
        if os.path.exists(os.path.join(ROOT, "requirements", lock)):
            assert [pins(lock)[n] for n in names if n in pins(lock)] == [Version(floor)], (req.name, lock)


def test_readme_table_is_generated():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(re.escape(versions_table.START) + r"\n(.*?)\n" + re.escape(versions_table.END), readme, re.S)
    assert block, "README.md has no generated 'Supported versions' table"
    assert block.group(1) == versions_table.table(), "run: .venv/bin/python scripts/versions_table.py --write"


def test_table_script_runs():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "versions_table.py")], capture_output=True,
                       text=True)
    assert r.returncode == 0 and "| orbax-checkpoint |" in r.stdout, r.stderr
