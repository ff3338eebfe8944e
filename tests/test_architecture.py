"""The package's shape: families live only in their spec modules, ckptbridge's own modules
import each other without cycles (function-level and ``TYPE_CHECKING`` imports included), and
the file conversions do not import the Tunix model builder."""

import ast
import os
import re

import ckptbridge
from ckptbridge.specs import FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ckptbridge.__file__)))


def _sources(*packages):
    for package in packages:
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(dirpath, name)


def test_no_module_outside_specs_names_a_family():
    from training.config import PRESETS

    words = {w for spec in FAMILIES.values() for w in (spec.name, *spec.model_types)}
    words |= {re.sub(r"\d.*", "", w) for w in words}  # "gemma", "qwen"
    pattern = re.compile(r"(?i)\b(" + "|".join(sorted(map(re.escape, words), key=len, reverse=True)) + r")")
    found = []
    for path in _sources("ckptbridge", "training"):
        if os.sep + "specs" + os.sep in path:
            continue
        text = open(path).read()
        for preset in PRESETS:  # recipe names are data, not code paths
            text = text.replace(preset, "")
        found += [f"{os.path.relpath(path, ROOT)}: {m.group(0)}" for m in pattern.finditer(text)]
    assert found == []


def _imports(path: str, module: str) -> set[str]:
    """ckptbridge modules imported anywhere in ``path`` (in functions and under ``if TYPE_CHECKING:`` too)."""
    tree = ast.parse(open(path).read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n.startswith("ckptbridge") and n != module}
    return out


def test_no_import_cycles():
    graph = _module_graph()
    # a package's __init__ importing its own submodules is not a cycle through them
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if m.startswith(n + ".") or n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]) if n in stack else f"{m} -> {n}")
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def _module_graph() -> dict[str, set[str]]:
    modules = {}
    for path in _sources("ckptbridge"):
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        modules[rel.removesuffix(".__init__")] = path
    return {m: {i for i in _imports(p, m) if i in modules} for m, p in modules.items()}


def test_file_conversions_do_not_import_the_tunix_model_builder():
    """What Tunix computes differently is a family fact (FamilySpec.config_mismatches), not a
    reason for a file conversion to load the JAX model builder."""
    graph = _module_graph()
    for module in ("ckptbridge.convert", "ckptbridge.adapters", "ckptbridge.merge", "ckptbridge.inspect"):
        assert "ckptbridge.tunix_model" not in graph[module], module


def test_type_checking_imports_are_counted():
    """The cycle test sees imports under ``if TYPE_CHECKING:`` (a cycle hidden there is still one)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ckptbridge.lora import Base\n")
    try:
        assert _imports(f.name, "ckptbridge.x") >= {"ckptbridge.lora", "ckptbridge.lora.Base"}
    finally:
        os.unlink(f.name)


def test_cli_reads_reports_by_attribute():
    """The CLI prints what the verbs return (typed reports): it looks up no string keys (a renamed
    field fails in the type checker, not at run time on one text path)."""
    tree = ast.parse(open(os.path.join(ROOT, "ckptbridge", "cli.py")).read())
    lookups = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Subscript)
               and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)
               and ast.unparse(n.value) != "os.environ"]
    assert lookups == []
