"""The package's layering: imports run one way, recipes -> algorithms/servers -> models/data/environments
-> utils, with no circle; algorithms (trainer loops) name no concrete model class; every change to
torch's or megatron-core's behaviour lives under ``utils/patches``."""

import ast
import os
import re

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nemo_aligner")

# Higher floors may import lower ones (and their own floor's other packages); never the other way.
FLOORS = {
    "recipes": 4, "trainers": 4, "launchers": 4, "api": 4, "demo": 4,
    "algorithms": 3, "servers": 3,
    "models": 2, "data": 2, "environments": 2,
    "utils": 1,
}
# Same floor, but one way only.
SAME_FLOOR_ONE_WAY = {("servers", "algorithms"), ("algorithms", "servers")}


def modules():
    """Module name -> path of every module of the package."""
    out = {}
    for base, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(base, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                out[re.sub(r"\.__init__$", "", rel)] = path
    return out


def imports(path):
    """Every ``nemo_aligner`` module a file imports, at any depth (function-level imports count)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nemo_aligner"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("nemo_aligner"))
    return found


def package_of(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


@pytest.fixture(scope="module")
def graph():
    known = modules()
    return {mod: {imp for imp in imports(path) if imp in known and imp != mod} for mod, path in known.items()}


def test_imports_run_down_the_floors(graph):
    wrong = []
    for mod, targets in graph.items():
        src = package_of(mod)
        for target in targets:
            dst = package_of(target)
            if src is None or dst is None or src == dst:
                continue
            if FLOORS[dst] > FLOORS[src] or (src, dst) in SAME_FLOOR_ONE_WAY:
                wrong.append(f"{mod} -> {target}")
    assert not wrong, "imports that run back up the layers:\n" + "\n".join(sorted(wrong))


def test_every_package_has_a_floor(graph):
    assert {package_of(m) for m in graph} - {None} <= set(FLOORS)


def test_no_import_circle(graph):
    state, stack, circles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    # a package's __init__ importing its own submodules is not a circle of dependencies
    circles = [c for c in circles if not any(b.startswith(a + ".") or a.startswith(b + ".") for a, b in zip(c, c[1:]))]
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_trainer_loops_see_models_only_through_the_interface(graph):
    concrete = [(mod, target) for mod, targets in graph.items() if package_of(mod) == "algorithms"
                for target in targets if target.startswith("nemo_aligner.models.")
                and not target.startswith("nemo_aligner.models.alignable_interface")]
    assert not concrete, concrete


PATCH = re.compile(r"^\s*(torch|megatron|mrandom|rope_utils|filesystem_async|[a-z_]+_module)\.[\w.]+\s*=(?!=)", re.M)


def test_global_patches_live_under_utils_patches():
    """Assignments to torch's or megatron-core's module attributes happen only in utils/patches."""
    outside = []
    for mod, path in modules().items():
        if mod.startswith("nemo_aligner.utils.patches"):
            continue
        text = open(path, encoding="utf-8").read()
        outside += [f"{mod}: {m.group(0).strip()}" for m in PATCH.finditer(text)]
    assert not outside, outside
