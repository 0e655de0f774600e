"""The package's dependencies run one way, read from the source with ``ast`` (imports inside functions included):

models, head architectures and the shared core (sampling, trees, verification, ...) at the bottom; drafters; the
decoding loop; then training, bench and the demo; then the fronts (``cli``, ``api``, the package itself and
``export``), which nothing below imports. Every module has its layer here. Inside a package, its subpackages are
layered too (:data:`SUBLAYERS`), and a module of a subpackage never imports the modules of a package above it
(``training/runs/folders.py`` never imports ``training/commands.py``). No module uses another module's private
names (``_x``). The two decoding loops are peers: neither imports the other, and neither makes a speculation
policy. Every module is drawn in its layer in docs/architecture.md's module map.
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

# Layer of a module, by its longest matching prefix (every module has one: test_every_module_has_a_layer).
LAYERS = {
    "errors": 0, "files": 0, "hardware": 0, "compat": 0, "prompts": 0, "stopping": 0, "sampling": 0, "trees": 0,
    "grammar": 0,
    "verification": 0, "stats": 0, "draft_vocab": 0, "datastore_index": 0, "models": 0, "heads": 0, "costs": 0,
    "corpus": 0, "tau": 0, "engines": 0,
    "drafters": 1,
    "decoding": 2, "batching": 2, "batch_drafting": 2, "speculation": 2, "step": 2, "sequence": 2,
    "training": 3, "bench": 3, "demo": 3, "datastore": 3, "serve": 3,
    "cli": 4, "api": 4, "export": 4,
}
FRONT = 4
# The layers inside a package, by subpackage (its plain modules, e.g. training/commands.py, sit above them all).
SUBLAYERS = {
    "training": {"runs": 0, "objectives": 0, "data": 1, "heads": 2, "drafter": 2},
}
MAP = SRC.parent.parent / "docs" / "architecture.md"
MAX_MODULES = 12  # a folder of training holds at most this many modules (its __init__ aside)
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


def climbs(name: str, other: str, known: dict) -> str | None:
    """Why ``name`` importing ``other`` climbs back up inside a package, or None: ``other`` is a plain module of a
    package that holds ``name`` in one of its subpackages (that package's front), or a sibling subpackage of a higher
    :data:`SUBLAYERS` layer. The root package is layered by :data:`LAYERS` instead."""
    mine, theirs = name.split("."), other.split(".")
    common = 0
    while common < min(len(mine), len(theirs)) and mine[common] == theirs[common]:
        common += 1
    folder = len(mine) - (0 if known[name][1] else 1)  # parts of the package that holds name's file
    if common < 2 or common >= folder or common == len(theirs):
        return None  # other package trees, other in name's own folder or below it, or an enclosing package
    package = ".".join(theirs[:common])
    if common == len(theirs) - 1 and not known[other][1]:
        return f"{other} is a plain module of {package}, above its subpackages"
    order = SUBLAYERS.get(".".join(theirs[1:common]), {})
    here, there = order.get(mine[common]), order.get(theirs[common])
    if here is None or there is None:
        return f"SUBLAYERS has no order for {package}.{mine[common]} and {package}.{theirs[common]}"
    return f"{package}.{theirs[common]} is above {package}.{mine[common]}" if there > here else None


def map_entries(text: str) -> set[str]:
    """The module paths (below ``src/specdraft``) a map names: a path in full (``training/runs/folders.py``), or a
    file name on a line that names its folder (``training/runs/  folders.py  trainer.py``) or on the lines that
    follow it up to a blank line or a line naming another folder."""
    found, folders = set(), []
    for line in text.splitlines():
        words = line.replace("`", " ").replace(",", " ").split()
        named = [w for w in words if w.endswith("/")]
        folders = named or (folders if words and not line.startswith("```") else [])
        for word in (w for w in words if w.endswith(".py")):
            found.add(word)
            found.update(folder + word for folder in folders)
    return found


def unmapped(prefix: str = "") -> list[str]:
    """The module files under ``src/specdraft/<prefix>`` that docs/architecture.md does not name."""
    entries = map_entries(MAP.read_text())
    files = [str(path.relative_to(SRC)) for path in sorted(SRC.rglob("*.py"))]
    return [f for f in files if f.startswith(prefix) and not f.endswith("__init__.py") and f not in entries]


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


def test_every_module_has_a_layer():
    unplaced = [name for name in modules() if name != PACKAGE
                and not any(".".join(name.split(".")[1:end]) in LAYERS for end in range(2, name.count(".") + 2))]
    assert unplaced == [], "give each its layer in LAYERS, and its place in docs/architecture.md"


def test_the_climb_check_sees_fronts_and_sublayers():
    known = {"specdraft.training": (None, True), "specdraft.training.commands": (None, False),
             "specdraft.training.runs": (None, True), "specdraft.training.runs.folders": (None, False),
             "specdraft.training.runs.trainer": (None, False), "specdraft.training.data": (None, True),
             "specdraft.training.data.records": (None, False), "specdraft.training.lab": (None, True),
             "specdraft.training.lab.x": (None, False), "specdraft.decoding": (None, False)}
    assert "plain module" in climbs("specdraft.training.runs.folders", "specdraft.training.commands", known)
    assert "is above" in climbs("specdraft.training.runs.folders", "specdraft.training.data.records", known)
    assert "no order" in climbs("specdraft.training.lab.x", "specdraft.training.runs.folders", known)
    assert climbs("specdraft.training.data.records", "specdraft.training.runs.folders", known) is None
    assert climbs("specdraft.training.runs.folders", "specdraft.training.runs.trainer", known) is None
    assert climbs("specdraft.training.runs.folders", "specdraft.training", known) is None
    assert climbs("specdraft.training.commands", "specdraft.training.runs.folders", known) is None
    assert climbs("specdraft.training.runs.folders", "specdraft.decoding", known) is None  # LAYERS' business


def test_no_import_climbs_back_up_inside_a_package(graph):
    known = modules()
    climbing = [f"{name} imports {other}: {why}" for name, edges in sorted(graph.items()) for other in sorted(edges)
                if (why := climbs(name, other, known))]
    assert climbing == []


def test_training_folders_hold_at_most_12_modules():
    folders = {path.parent for path in (SRC / "training").rglob("*.py")}
    crowded = {str(folder.relative_to(SRC)): count for folder in sorted(folders)
               if (count := len([p for p in folder.glob("*.py") if p.name != "__init__.py"])) > MAX_MODULES}
    assert len(folders) > 1 and crowded == {}


def test_the_map_check_reads_paths_and_folder_lines():
    entries = map_entries("`training/runs/folders.py` and\n training/data/   records.py, batches.py\n   scoring.py\n"
                          "\n sampling.py\n")
    assert {"training/runs/folders.py", "training/data/records.py", "training/data/batches.py",
            "training/data/scoring.py", "sampling.py"} <= entries
    assert "training/data/folders.py" not in entries and "training/data/sampling.py" not in entries


def test_every_training_module_is_in_the_map():
    assert unmapped("training") + unmapped("corpus") + unmapped("tau") == []


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
