"""Are this environment's conversions byte-identical to a reference environment's?

For an environment the test suite does not build (a CUDA or TPU image with its own jax, flax,
orbax-checkpoint, transformers): make the inputs and the expected digests where the project's
setup runs, carry the folder over, check there.

    .venv/bin/python scripts/compat_check.py make DIR     # inputs + DIR/expected.json (needs the verify extra)
    python scripts/compat_check.py check DIR              # run the conversions here, compare; JSON on stdout

The conversions (``ckptbridge.testing.COMPAT_STEPS``) read and write under the fixed folder
/tmp/ckptbridge-compat, so that the paths recorded in outputs (metadata, model cards) are the
same on both machines. Exit 0 when every output is identical, 6 when one differs, 1 when a
conversion failed.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ckptbridge import deps  # noqa: E402
from ckptbridge.testing import COMPAT_STEPS, build_compat_inputs, run_compat_steps  # noqa: E402

WORK = "/tmp/ckptbridge-compat"
PACKAGES = ("python", "numpy", "ml_dtypes", "jax", "jaxlib", "flax", "orbax-checkpoint", "tensorstore",
            "google-tunix", "qwix", "transformers", "safetensors", "peft", "torch")


def _versions() -> dict:
    out = {"python": sys.version.split()[0]}
    out.update({p: deps.installed_version(p) for p in PACKAGES[1:]})
    return out


def _inputs() -> dict[str, str]:
    return {k: os.path.join(WORK, "inputs", k) for k in ("base", "bf16", "peft")} | {
        "lora": os.path.join(WORK, "inputs", "tunix_lora")}


def make(folder: str) -> int:
    shutil.rmtree(WORK, ignore_errors=True)
    inputs = build_compat_inputs(os.path.join(WORK, "inputs"))
    assert inputs == _inputs(), inputs
    digests = run_compat_steps(sys.executable, inputs, tempfile.mkdtemp(prefix="out-", dir=WORK))
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(os.path.join(WORK, "inputs"), os.path.join(folder, "inputs"))
    with open(os.path.join(folder, "expected.json"), "w") as f:
        json.dump({"versions": _versions(), "digests": digests}, f, indent=1)
    print(f"{folder}: inputs and the digests of {len(digests)} conversions")
    return 0


def check(folder: str) -> int:
    with open(os.path.join(folder, "expected.json")) as f:
        expected = json.load(f)
    shutil.rmtree(WORK, ignore_errors=True)
    shutil.copytree(os.path.join(folder, "inputs"), os.path.join(WORK, "inputs"))
    report = {"versions": _versions(), "reference": expected["versions"], "steps": {}}
    try:
        got = run_compat_steps(sys.executable, _inputs(), tempfile.mkdtemp(prefix="out-", dir=WORK))
    except RuntimeError as e:
        report["error"] = str(e)
        print(json.dumps(report, indent=1))
        return 1
    for name, _ in COMPAT_STEPS:
        report["steps"][name] = "identical" if got[name] == expected["digests"][name] else "DIFFERENT"
    print(json.dumps(report, indent=1))
    return 0 if all(v == "identical" for v in report["steps"].values()) else 6


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("make", "check"):
        print(__doc__.strip().splitlines()[0] + "\nusage: compat_check.py make|check DIR", file=sys.stderr)
        sys.exit(2)
    sys.exit((make if sys.argv[1] == "make" else check)(sys.argv[2]))
