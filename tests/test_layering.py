"""The package's dependencies run one way, read from the source with ``ast`` (imports inside functions included):

models, head architectures and the shared core (sampling, trees, verification, ...) at the bottom; drafters; the
decoding loop; then training, bench and the demo; then the fronts (``cli``, ``api``, the package itself and any
other front-end package), which nothing below imports. No module uses another module's private names (``_x``).
The two decoding loops are peers: neither imports the other, and neither makes a speculation policy. Every module is
drawn in its layer in docs/architecture.md's module map.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import specdraft

PACKAGE = "specdraft"
SRC = Path(specdraft.__file__).resolve().parent
ARCHITECTURE = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"

# Layer of a module, by its longest matching prefix; a module no prefix names is a front (the top layer).
LAYERS = {
    "errors": 0, "files": 0, "hardware": 0, "compat": 0, "prompts": 0, "stopping": 0, "sampling": 0, "trees": 0,
    "verification": 0, "stats": 0, "draft_vocab": 0, "datastore_index": 0, "models": 0, "heads": 0, "costs": 0,
    "engines": 0,
    "drafters": 1,
    "decoding": 2, "batching": 2, "batch_drafting": 2, "speculation": 2, "step": 2, "sequence": 2,
    "training": 3, "bench": 3, "demo": 3, "datastore": 3, "serve": 3,
}
FRONT = 4
NAMES = {0: "models, heads and core", 1: "drafters", 2: "decoding", 3: "training, bench and tools", FRONT: "fronts"}
MAP_LABELS = {"core": 0, "drafters": 1, "decoding": 2, "tools": 3, "fronts": FRONT}  # the map's layer names


def modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``), for every module of the package."""
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = [PACKAGE, *path.relative_to(SRC).with_suffix("").parts]
        package = parts[-1] == "__init__"
        found[".".join(parts[:-1] if package else parts)] = (path, package)
    return found


def _targets(node: ast.AST, name: str, package: bool, known: dict) -> list[str]:
    """The package modules an import statement names (``from X import y`` names X.y when that is a module)."""
    if isinstance(node, ast.Import):
        candidates = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            anchor = name.split(".")[: len(name.split(".")) - (0 if package else 1) - (node.level - 1)]
            base = ".".join([*anchor, *([node.module] if node.module else [])])
        # `from pkg import name` runs pkg's __init__ first: it depends on pkg, and on pkg.name if that is a module
        candidates = [base] + [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
    out = []
    for candidate in candidates:
        while candidate and candidate not in known:  # `import specdraft.x.y` names the module specdraft.x.y
            candidate = candidate.rpartition(".")[0]
        if candidate and candidate not in (name, PACKAGE):  # the root package is always initialised first anyway
            out.append(candidate)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (top level, functions, TYPE_CHECKING)."""
    known = modules()
    graph = {}
    for name, (path, package) in known.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(_targets(node, name, package, known))
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(name: str) -> int:
    parts = name.split(".")[1:]
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in LAYERS:
            return LAYERS[".".join(parts[:end])]
    return FRONT


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _base(node: ast.ImportFrom, name: str, package: bool) -> str:
    """The module a ``from ... import`` statement in module ``name`` reads from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    anchor = name.split(".")[: len(name.split(".")) - (0 if package else 1) - (node.level - 1)]
    return ".".join([*anchor, *([node.module] if node.module else [])])


def private_uses(source: str, name: str, package: bool = False) -> list[str]:
    """Where module ``name`` uses a private name of another package module: ``from specdraft.x import _y``, or
    ``x._y`` / ``specdraft.x._y`` where ``x`` was imported from the package."""
    tree = ast.parse(source)
    found, imported = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _base(node, name, package)
            if base.split(".")[0] == PACKAGE:
                imported.update(alias.asname or alias.name for alias in node.names)
                found += [f"{name}:{node.lineno}: from {base} import {alias.name}" for alias in node.names
                          if _is_private(alias.name)]
        elif isinstance(node, ast.Import):
            imported.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                            if alias.name.split(".")[0] == PACKAGE)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def reachable(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module ``start`` imports, directly or not -> the module that imports it (for the error message)."""
    seen, todo = {}, [start]
    while todo:
        node = todo.pop()
        for other in graph[node]:
            if other not in seen and other != start:
                seen[other] = node
                todo.append(other)
    return seen


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_imports_inside_functions_and_relative_imports():
    source = "def f():\n    from specdraft.heads import load_heads\nfrom . import options\nimport specdraft.api\n"
    tree = ast.parse(source)
    known = {"specdraft.heads": None, "specdraft.drafters": None, "specdraft.drafters.options": None,
             "specdraft.api": None}
    found = [t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
             for t in _targets(node, "specdraft.drafters.eagle", False, known)]
    assert sorted(found) == ["specdraft.api", "specdraft.drafters", "specdraft.drafters.options", "specdraft.heads"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_private_name_check_sees_every_form():
    source = ("from specdraft.decoding import _verify, check_inputs\nfrom . import _helpers\nimport specdraft.trees\n"
              "def f():\n    from specdraft.training import data\n    return data._opening(), specdraft.trees._x\n"
              "class A:\n    def g(self):\n        return self._mine, torch._dynamo, _local()\n")
    found = private_uses(source, "specdraft.batching")
    assert sorted(use.split(": ", 1)[1] for use in found) == [
        "data._opening", "from specdraft import _helpers", "from specdraft.decoding import _verify",
        "specdraft.trees._x"]


def test_no_module_uses_another_modules_private_names():
    uses = [use for name, (path, package) in sorted(modules().items())
            for use in private_uses(path.read_text(), name, package)]
    assert uses == [], "make the name public where it is defined, or keep its use inside its module"


def test_no_import_circle_among_the_package_modules(graph):
    assert len(graph) > 40  # the walk found the package
    assert cycles(graph) == [], "import circle(s); move the shared code down a layer instead of importing lazily"


def test_every_import_points_down_or_sideways(graph):
    upward = [f"{name} ({NAMES[layer(name)]}) imports {other} ({NAMES[layer(other)]})"
              for name, edges in sorted(graph.items()) for other in sorted(edges) if layer(other) > layer(name)]
    assert upward == []


def test_drafters_never_import_training_bench_cli_or_api(graph):
    forbidden = ("training", "bench", "cli", "api", "demo")
    bad = []
    for name in sorted(graph):
        if name.startswith(f"{PACKAGE}.drafters"):
            for other, via in sorted(reachable(graph, name).items()):
                if other.split(".")[1] in forbidden:
                    bad.append(f"{name} reaches {other} (imported by {via})")
    assert bad == []


def test_api_is_a_front_nothing_below_imports(graph):
    importers = sorted(name for name, edges in graph.items() if f"{PACKAGE}.api" in edges)
    assert all(layer(name) == FRONT for name in importers), importers


def module_map(text: str) -> dict[str, str]:
    """The module map of docs/architecture.md: file (relative to ``src/specdraft``) -> the layer it is drawn in.

    The map is the first fenced block after the heading "## Layers"; a line that starts in the first column starts a
    layer (its first word, one of :data:`MAP_LABELS`), indented lines continue it, and every ``*.py`` path on them is
    a module drawn in that layer (text in parentheses says what it does)."""
    section = text[text.index("\n## Layers"):]
    block = section.split("```", 2)[1]
    drawn, label = {}, None
    for line in block.splitlines()[1:]:
        if line[:1].strip():
            label = line.split()[0]
        for path in re.findall(r"(?<![\w/.])((?:\w+/)*\w+\.py)\b", line):
            drawn[path] = label
    return drawn


def test_the_map_reader_sees_layers_and_continued_lines():
    text = "x\n## Layers: map\n\n```\nfronts  cli.py (a job)\n        api.py\n\ncore  models/base.py\n```\n"
    assert module_map(text) == {"cli.py": "fronts", "api.py": "fronts", "models/base.py": "core"}


def test_every_module_is_drawn_in_its_layer_in_the_architecture_map():
    drawn = module_map(ARCHITECTURE.read_text())
    files = {str(path.relative_to(SRC)): path for path in SRC.rglob("*.py")}
    assert sorted(set(files) - set(drawn)) == [], "draw these modules in docs/architecture.md's module map"
    assert sorted(set(drawn) - set(files)) == [], "the module map names files that do not exist"
    wrong = []
    for relative, label in sorted(drawn.items()):
        parts = [PACKAGE, *Path(relative).with_suffix("").parts]
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if MAP_LABELS.get(label) != layer(name):
            wrong.append(f"{relative} is drawn in {label!r} but lies in {NAMES[layer(name)]}")
    assert wrong == []


def _calls(path: Path) -> set[str]:
    """The names a module calls (``f(...)`` and ``x.f(...)``)."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            func = node.func
            calls.add(func.id if isinstance(func, ast.Name) else getattr(func, "attr", ""))
    return calls


def test_the_two_loops_are_peers_and_neither_makes_a_policy(graph):
    loops = (f"{PACKAGE}.decoding", f"{PACKAGE}.batching")
    for name in loops:
        other = next(loop for loop in loops if loop != name)
        assert other not in reachable(graph, name), f"{name} reaches {other}"
        assert f"{PACKAGE}.sequence" in graph[name] and f"{PACKAGE}.step" in graph[name]
        made = _calls(modules()[name][0]) & {"FixedPolicy", "AdaptivePolicy", "speculation_policy", "cost_curve"}
        assert made == set(), f"{name} makes a policy itself ({', '.join(sorted(made))})"
