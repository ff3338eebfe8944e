"""Version skew is never an internal error: a missing, too-old or incompatible dependency is
one line naming the package, the version found, the supported range and the pip command, exit
8, nothing written. Versions are forced in by putting distribution metadata of another
version first on the path (what pip leaves behind when it installs one), or a package that
fails at import."""

import json
import os
import re
import tomllib

import pytest

from ckptbridge import deps

from conftest import ROOT, run_cli


def fake_dists(root, versions: dict[str, str]) -> str:
    """A directory with installed-distribution metadata claiming ``versions``."""
    os.makedirs(root, exist_ok=True)
    for name, version in versions.items():
        info = os.path.join(root, f"{re.sub(r'[-.]', '_', name)}-{version}.dist-info")
        os.makedirs(info)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return str(root)


def one_line_exit_8(r, *needles):
    assert r.returncode == 8, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_declared_ranges_are_pyproject_toml():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    got = deps.declared()

    def ranges(reqs):
        from packaging.specifiers import SpecifierSet

        return [(r.name, SpecifierSet(str(r.specifier))) for r in reqs]

    assert ranges(got[None]) == ranges(map(deps._requirement, project["dependencies"]))
    for extra, reqs in project["optional-dependencies"].items():
        assert ranges(got[extra]) == ranges(map(deps._requirement, reqs)), extra
    assert set(project["optional-dependencies"]) == set(deps.EXTRAS)


def test_every_floor_is_a_lower_bound():
    """A declared range without a floor promises every release ever made."""
    from packaging.specifiers import SpecifierSet

    for extra, reqs in deps.declared().items():
        for r in reqs:
            assert any(s.operator in (">=", "==", "~=") for s in SpecifierSet(r.specifier)), (extra, str(r))


@pytest.fixture
def fake_installed(monkeypatch):
    """Pretend versions of some packages (None: not installed), in this process."""
    def fake(versions):
        real = deps.installed.__wrapped__

        def installed(name):
            return (name, versions[name]) if versions.get(name) else None if name in versions else real(name)

        monkeypatch.setattr(deps, "installed", installed)
        monkeypatch.setattr(deps, "_ok", set())

    return fake


def test_missing_too_old_and_conflicting(fake_installed):
    fake_installed({"orbax-checkpoint": None, "tensorstore": "0.1.70", "flax": "0.12.8", "jax": "0.11.2"})
    orbax = deps.problems("orbax")
    assert orbax[0] == ("orbax-checkpoint is not installed here; ckptbridge[orbax] needs orbax-checkpoint>=0.12: "
                        "pip install 'ckptbridge[orbax]'")
    assert "tensorstore 0.1.70 is installed" in orbax[1] and "tensorstore>=0.1.84" in orbax[1]
    assert orbax[1].endswith("pip install 'tensorstore>=0.1.84'")
    verify = deps.problems("verify")
    assert ("flax 0.12.8 does not work with jax 0.11.2 (flax.nnx does not import: jax.experimental.hijax has no "
            "HiPrimitive): pip install 'flax>=0.12.10'") in verify
    assert deps.problems(None) == []
    with pytest.raises(deps.DependencyError) as e:
        deps.require("orbax")
    assert e.value.exit_code == 8


def test_a_fixed_flax_is_accepted(fake_installed):
    fake_installed({"flax": "0.12.10", "jax": "0.11.2", "jaxlib": "0.11.2"})
    assert not [p for p in deps.problems("verify") if "flax" in p]


def test_installed_versions_are_importlib_metadatas():
    """The metadata scan that spares importing importlib.metadata finds what it finds."""
    import importlib.metadata as md

    for dist in md.distributions():
        name = dist.metadata["Name"]
        assert deps.installed(name) == (name, md.version(name)), name
    assert deps.installed("no-such-package-here") is None


@pytest.mark.parametrize("text, want", [
    ('orbax-checkpoint>=0.12; extra == "orbax"', ("orbax-checkpoint", ">=0.12", "orbax")),
    ("ml_dtypes!=0.7.0,>=0.4", ("ml_dtypes", "!=0.7.0,>=0.4", None)),
    ("numpy (>=1.26)", ("numpy", ">=1.26", None)),
    ("vllm[audio]>=0.32 ; extra == 'serve'", ("vllm", ">=0.32", "serve")),
    ('pyyaml; extra == "train"', ("pyyaml", "", "train")),
    ('foo>=1; python_version < "3.12" and extra == "hub"', ("foo", ">=1", "hub")),
])
def test_requirements_parse(text, want):
    r = deps._requirement(text)
    assert (r.name, r.specifier, r.extra) == want


def test_other_exceptions_stay_internal():
    try:
        raise ValueError("a bug")
    except ValueError as e:
        assert deps.import_failure(e) is None


@pytest.fixture(scope="module")
def orbax_inputs(checkpoints, tmp_path_factory):
    """An Orbax weights checkpoint and an Orbax LoRA checkpoint, written with the real Orbax."""
    from ckptbridge import convert_peft_to_orbax
    from ckptbridge import convert_safetensors_to_orbax
    from ckptbridge.testing import write_random_adapter

    tmp = tmp_path_factory.mktemp("orbax_inputs")
    base = checkpoints["kv_text_f32_sharded"]
    convert_safetensors_to_orbax(base, str(tmp / "weights"), progress=False)
    peft = write_random_adapter(base, str(tmp / "peft"), r=4, dtype="float32")
    convert_peft_to_orbax(peft, str(tmp / "lora"), base=base, progress=False)
    return {"base": base, "weights": str(tmp / "weights"), "lora": str(tmp / "lora"), "peft": peft}


ORBAX_VERBS = [
    ("convert", "safetensors-to-orbax", "{base}", "{out}"),
    ("convert", "orbax-to-safetensors", "{weights}", "{out}"),
    ("convert", "orbax-to-peft", "{lora}", "{out}", "--base", "{base}"),
    ("convert", "peft-to-orbax", "{peft}", "{out}", "--base", "{base}"),
    ("merge", "{base}", "{lora}", "{out}"),
    ("inspect", "{weights}"),
    ("verify", "adapter", "{lora}", "--base", "{base}", "--lint-only"),
]


@pytest.mark.parametrize("argv", ORBAX_VERBS, ids=lambda a: " ".join(w for w in a[:2] if "{" not in w))
def test_orbax_below_the_floor_every_orbax_verb_says_so(orbax_inputs, tmp_path, argv):
    path = fake_dists(tmp_path / "site", {"orbax-checkpoint": "0.11.40"})
    out = str(tmp_path / "out")
    args = [a.format(out=out, **orbax_inputs) for a in argv]
    r = run_cli(*args, env={"PYTHONPATH": path})
    one_line_exit_8(r, "orbax-checkpoint 0.11.40", "orbax-checkpoint>=0.12", "pip install")
    assert sorted(os.listdir(tmp_path)) == ["site"]  # nothing written, not even a temporary directory


def test_a_known_conflict_is_refused_before_import(checkpoints, tmp_path):
    """flax before 0.12.10 does not import on jax 0.11.2: said before anything is imported."""
    path = fake_dists(tmp_path / "site", {"jax": "0.11.2", "flax": "0.12.9"})
    r = run_cli("verify", "logits", checkpoints["kv_text_f32_sharded"], env={"PYTHONPATH": path})
    one_line_exit_8(r, "flax 0.12.9 does not work with jax 0.11.2", "pip install 'flax>=0.12.10'")


FAILING_TUNIX = "raise TypeError(\"jit() got an unexpected keyword argument 'abstracted_axes'\")\n"


def test_an_import_failure_names_the_versions(checkpoints, tmp_path):
    """A package that fails at import with the versions beside it (any exception) is one line
    naming it, the versions of what it stands on, and the pip command."""
    site = tmp_path / "site"
    os.makedirs(site / "tunix")
    (site / "tunix" / "__init__.py").write_text(FAILING_TUNIX)
    r = run_cli("verify", "logits", checkpoints["kv_text_f32_sharded"], env={"PYTHONPATH": str(site)})
    jax = deps.installed_version("jax")
    one_line_exit_8(r, f"google-tunix {deps.installed_version('google-tunix')} does not import with jax {jax}",
                    "TypeError: jit() got an unexpected keyword argument 'abstracted_axes'",
                    "pip install -U 'ckptbridge[verify]'")


def test_the_python_api_raises_the_same(tmp_path, monkeypatch):
    site = tmp_path / "site"
    os.makedirs(site / "tunix")
    (site / "tunix" / "__init__.py").write_text(FAILING_TUNIX)
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in list(__import__("sys").modules) if m == "tunix" or m.startswith("tunix.")]:
        monkeypatch.delitem(__import__("sys").modules, name)
    with pytest.raises(deps.DependencyError, match=r"google-tunix \S+ does not import .*abstracted_axes"):
        deps.load("tunix", "verify")


def test_env_json_names_every_package(tmp_path):
    r = run_cli("env", "--json")
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    declared = {req.name for reqs in deps.declared().values() for req in reqs}
    assert declared <= set(env["packages"])
    from importlib.metadata import version

    for name in ("orbax-checkpoint", "jax", "numpy", "tensorstore", "torch", "transformers", "google-tunix", "flax"):
        assert env["packages"][name]["version"] == version(name), name
    assert env["packages"]["orbax-checkpoint"]["required"]["orbax"] == ">=0.12"
    assert env["extras"]["core"]["usable"] and env["extras"]["orbax"]["usable"]
    assert env["verbs"]["convert safetensors-to-orbax"] == {"extra": "orbax", "works": True}
    assert env["verbs"]["merge"] == {"extra": "core", "works": True}
    assert env["cpus"]["usable"] == len(os.sched_getaffinity(0))
    assert env["memory"]["total"] > 0 and env["python"]["version"].startswith("3.")
    assert env["accelerators"]["jax"]["backend"] == "cpu" and env["accelerators"]["torch"]["cuda"] is False
    text = run_cli("env", "--no-accelerators")
    assert text.returncode == 0 and "orbax-checkpoint" in text.stdout and "accelerators" not in text.stdout


def test_env_shows_an_unusable_extra(tmp_path):
    path = fake_dists(tmp_path / "site", {"orbax-checkpoint": "0.11.40"})
    r = run_cli("env", "--json", "--no-accelerators", env={"PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert env["packages"]["orbax-checkpoint"]["version"] == "0.11.40"
    assert not env["extras"]["orbax"]["usable"]
    assert "orbax-checkpoint 0.11.40 is installed" in env["extras"]["orbax"]["problems"][0]
    assert env["verbs"]["convert orbax-to-peft"] == {"extra": "orbax", "works": False}
    assert env["verbs"]["merge"]["works"] and not env["verbs"]["merge (Orbax adapter)"]["works"]


def test_env_works_when_the_core_does_not(tmp_path, checkpoints):
    """env is what a bug report needs: it runs whatever is wrong; a verb says what."""
    path = fake_dists(tmp_path / "site", {"tqdm": "4.50.0"})
    r = run_cli("env", "--json", "--no-accelerators", env={"PYTHONPATH": path})
    assert r.returncode == 0, r.stderr
    env = json.loads(r.stdout)
    assert not env["extras"]["core"]["usable"] and "tqdm 4.50.0 is installed" in env["extras"]["core"]["problems"][0]
    assert not env["verbs"]["merge"]["works"]
    inspect = run_cli("inspect", checkpoints["kv_text_f32_sharded"], env={"PYTHONPATH": path})
    one_line_exit_8(inspect, "tqdm 4.50.0", "tqdm>=4.60", "pip install 'tqdm>=4.60'")


def test_training_says_so_too(checkpoints, tmp_path):
    import subprocess
    import sys

    base, out = checkpoints["kv_text_f32_sharded"], tmp_path / "run"
    argv = [sys.executable, "-m", "training", "--preset", "tiny-cpu", "--base", base, "--out", str(out),
            "--max-steps", "1", "--quiet"]
    old = fake_dists(tmp_path / "old", {"optax": "0.2.0"})
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": old})
    one_line_exit_8(r, "optax 0.2.0 is installed", "optax>=0.2.8")
    broken = tmp_path / "broken"
    os.makedirs(broken / "tunix")
    (broken / "tunix" / "__init__.py").write_text(FAILING_TUNIX)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(broken)})
    assert r.returncode == 8 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("training: error: google-tunix"), r.stderr
    assert not out.exists()
