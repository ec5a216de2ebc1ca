"""The layering rule, core < graphs < compiler < runtime (docs/ARCHITECTURE.md): a package
imports only from those below it, anywhere in its source (also imports inside functions),
and importing the lower packages leaves the runtime unloaded and the environment alone."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "graphs", "compiler", "runtime")  # lorac.<layer> lives in ROOT/<layer>


def lorac_imports(source: str, here: list[str]) -> set[str]:
    """The lorac layers a module's source imports (absolute or relative, at any depth);
    `here`: the module's package, e.g. ["lorac", "graphs"]."""
    tree = ast.parse(source)
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's own package
                base = here[:len(here) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
        for n in names:
            parts = n.split(".")
            if parts[0] == "lorac" and len(parts) > 1 and parts[1] in LAYERS:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_no_package_imports_from_a_layer_above(layer):
    above = set(LAYERS[LAYERS.index(layer) + 1:])
    bad = {}
    for path in sorted((ROOT / layer).rglob("*.py")):
        here = ["lorac", layer, *path.relative_to(ROOT / layer).parent.parts]
        hit = lorac_imports(path.read_text(), here) & above
        if hit:
            bad[str(path.relative_to(ROOT))] = sorted(hit)
    assert not bad, f"lorac.{layer} imports from layers above it: {bad}"


def test_the_scan_sees_imports():
    """The checker itself: a nested relative import of the runtime, as graphs/optimizer.py had
    one, is found (else the test above would pass on anything)."""
    probe = "def f():\n    from ..runtime.optim import group_of\n    import lorac.compiler.pipeline\n"
    assert lorac_imports(probe, ["lorac", "graphs"]) == {"runtime", "compiler"}
    assert lorac_imports("from .devices import cpu\nfrom . import x", ["lorac", "runtime"]) == {"runtime"}
    assert lorac_imports("from .. import errors", ["lorac", "runtime", "devices"]) == {"runtime"}


def _fresh(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TVM_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_importing_graphs_and_compiler_loads_no_runtime_and_sets_no_variable():
    got = _fresh("import json, os, sys; before = dict(os.environ); import lorac.graphs, lorac.compiler; "
                 "print(json.dumps({'mods': sorted(m for m in sys.modules if m.startswith('lorac.')), "
                 "'changed': sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k)), "
                 "'spin': os.environ.get('TVM_THREAD_POOL_SPIN_COUNT')}))")
    assert got["spin"] is None and got["changed"] == []
    assert not [m for m in got["mods"] if m.startswith("lorac.runtime")]
    assert "lorac.graphs" in got["mods"] and "lorac.compiler" in got["mods"]  # the probe did import them


def test_core_imports_no_other_layer():
    got = _fresh("import json, sys; import lorac.core, lorac.core.keys, lorac.core.loraplus, lorac.core.artifact_cache; "
                 "print(json.dumps(sorted(m for m in sys.modules if m.startswith('lorac.'))))")
    assert got and all(m.startswith("lorac.core") for m in got), got


def test_compiler_and_runtime_list_targets_in_one_order():
    from lorac.compiler import FAMILIES
    from lorac.core.constants import TARGET_ORDER
    from lorac.runtime.devices import targets
    assert FAMILIES == targets() == TARGET_ORDER


def module_graph(layer: str) -> dict[str, set[str]]:
    """Every module of lorac.<layer> -> the modules of that layer its source imports (anywhere
    in it, also inside functions); `from . import x` counts x itself where x is a module."""
    base = ROOT / layer
    mods = {}
    for path in sorted(base.rglob("*.py")):
        parts = ["lorac", layer, *path.relative_to(base).with_suffix("").parts]
        pkg = parts[:-1]
        if parts[-1] == "__init__":
            parts = pkg = parts[:-1]
        mods[".".join(parts)] = (path, pkg)
    graph = {}
    for name, (path, pkg) in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                target = (".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                          if node.level else node.module or "")
                subs = [f"{target}.{a.name}" for a in node.names]
                deps |= {s for s in subs if s in mods} or ({target} & set(mods))
                if not any(s in mods for s in subs) and target in mods:
                    deps.add(target)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names} & set(mods)
        graph[name] = deps - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of a module graph: its strongly connected components of more than one
    module (Tarjan's algorithm)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("layer", LAYERS)
def test_no_import_circles_inside_a_layer(layer):
    found = circles(module_graph(layer))
    assert not found, f"import circles in lorac.{layer}: {found}"


def test_the_circle_finder_finds_one():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


# -- the device decides, not the target's name ---------------------------------------------
# Outside runtime/devices/ (one module per device) and compiler/targets/ (one per target
# family) nothing compares a target or device name with a literal: the run resolves the device
# once (devices.for_target) and asks it (AUTO_CHECKPOINTING, LOSS_CHUNK_BYTES, memory_free, ...,
# the interface in runtime/devices/__init__.py); the compiler asks the target module.
BRANCH_FREE = (("runtime", "devices"), ("compiler", "targets"))
# what must stay, each with its reason in a comment: none today. An entry is "path: the line's code".
ALLOWED_BRANCHES: set[str] = set()


def target_names() -> set[str]:
    from lorac.compiler import FAMILIES
    from lorac.runtime import devices
    return set(FAMILIES) | set(devices.targets()) | set(devices.names())


def name_branches(source: str, names: set[str]) -> list[int]:
    """Lines of `source` that compare something with a literal target/device name: ==, !=,
    in / not in a literal tuple, list or set holding one, or a `case "cuda":`."""
    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names if isinstance(node.value, str) else False
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(named(x) for x in [node.left, *node.comparators]):
            hits.append(node.lineno)
        elif isinstance(node, ast.MatchValue) and named(node.value):
            hits.append(node.lineno)
    return sorted(hits)


def test_nothing_outside_the_devices_and_targets_branches_on_a_target_name():
    names = target_names()
    hits = []
    for layer, home in BRANCH_FREE:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if home in path.relative_to(ROOT / layer).parts[:1]:
                continue
            lines = path.read_text().splitlines()
            for n in name_branches(path.read_text(), names):
                where = f"{path.relative_to(ROOT)}: {lines[n - 1].strip()}"
                if where not in ALLOWED_BRANCHES:
                    hits.append(where)
    assert not hits, "branches on a target's name (ask the device or target module instead):\n" + "\n".join(hits)


def test_the_branch_finder_finds_them():
    names = {"cpu", "cuda"}
    probe = ('if cfg.target == "cuda":\n    pass\nx = 1 if t != "cpu" else 2\nok = target in ("cpu", "cuda")\n'
             'match t:\n    case "cuda":\n        pass\nfine = backend == "tvm" and kind == "llvm"\n')
    assert name_branches(probe, names) == [1, 3, 4, 6]


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists lorac's packages by hand (package-dir maps them to the top folders):
    a new sub-package missing there installs from a clone but not from the wheel."""
    import tomllib
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    have = {"lorac"} | {".".join(["lorac", *d.parent.relative_to(ROOT).parts])
                        for layer in LAYERS for d in (ROOT / layer).rglob("__init__.py")}
    assert not have - listed, f"packages missing from pyproject.toml: {sorted(have - listed)}"
