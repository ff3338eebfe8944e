"""The house's shape: families live only in their spec modules, formats only under
``ckptbridge/formats/`` (one module or package each, every one the registry names), the
project's modules import each other without cycles (function-level and ``TYPE_CHECKING`` imports
included, and a package's ``__init__`` importing its own submodules too), and the file
conversions do not import the Tunix model builder."""

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


PACKAGES = ("ckptbridge", "training", "serving", "pipeline")


def _imports(path: str, module: str) -> set[str]:
    """Project modules imported anywhere in ``path`` (in functions and under ``if TYPE_CHECKING:`` too;
    relative imports resolved)."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in PACKAGES and n != module}
    return out


def _module_graph(*packages: str) -> dict[str, set[str]]:
    modules = {}
    for path in _sources(*(packages or PACKAGES)):
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        modules[rel.removesuffix(".__init__")] = path
    graph = {}
    for m, p in modules.items():
        edges = set()
        for i in _imports(p, m):
            while i and i not in modules:  # "from pkg import name": pkg.name when it is a module, else pkg
                i = i.rpartition(".")[0]
            if i and i != m:
                edges.add(i)
        # "from pkg import module": an edge to the module, not to pkg as well
        graph[m] = {e for e in edges if not any(o.startswith(e + ".") and o in _named(p, e) for o in edges)}
    return graph


def _named(path: str, package: str) -> set[str]:
    """The modules ``path`` takes from ``package`` by ``from package import module``."""
    tree = ast.parse(open(path).read())
    return {f"{package}.{a.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and node.module == package for a in node.names}


def cycles_of(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(" -> ".join(stack[stack.index(n):] + [n]))
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_import_cycles():
    """Anywhere in the project: ckptbridge, training, serving and the main job."""
    assert cycles_of(_module_graph()) == []


def test_a_cycle_through_a_package_init_is_seen(tmp_path):
    """A package whose ``__init__`` imports a submodule that imports the package back is a cycle
    (it is how ``lora/__init__`` once hid one)."""
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}}
    assert cycles_of(graph) == ["p -> p.a -> p.b -> p"]


# words of a format in a module's file name (the registry's format names and their parts)
FORMAT_WORDS = ("maxtext", "gguf", "peft", "qwix", "vllm", "quantize", "compressed", "tunix_lora", "safetensors_")


def test_formats_live_under_formats():
    """Every module the registry names is under ckptbridge/formats/, and no module elsewhere in
    ckptbridge is named after a format (the low-level codecs of io/ and what a family says of a
    format, data in specs/, excepted)."""
    from ckptbridge import formats

    for f in formats.FORMATS.values():
        for module in (f.module, f.read_module):
            assert module is None or module.startswith("ckptbridge.formats."), (f.name, module)
            if module:
                __import__(module)
    outside = [os.path.relpath(p, ROOT) for p in _sources("ckptbridge")
               if not any(os.sep + d + os.sep in p for d in ("formats", "io", "specs"))
               and any(w in os.path.basename(p) for w in FORMAT_WORDS)]
    assert outside == []


def test_file_conversions_do_not_import_the_tunix_model_builder():
    """What Tunix computes differently is a family fact (FamilySpec.config_mismatches), not a
    reason for a file conversion to load the JAX model builder."""
    graph = _module_graph("ckptbridge")
    conversions = ["ckptbridge.conversion", "ckptbridge.api", "ckptbridge.merge", "ckptbridge.inspect"]
    conversions += [m for m in graph if m.startswith("ckptbridge.formats")]
    for module in conversions:
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
