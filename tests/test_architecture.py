"""The import graph: no module imports itself back through others (no cycles), and layers only point down."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module → the shardline modules it imports anywhere in its body (lazy and type-only imports count)."""
    files = {_module(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets |= {f"{base}.{a.name}" for a in node.names} | {base}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that import each other (size > 1)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_the_cycle_finder_finds_a_cycle():
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back_through_others():
    cycles = strongly_connected(import_graph())
    assert cycles == [], "import cycles:\n" + "\n".join(" ↔ ".join(c) for c in cycles)


# docs/architecture.md §1: the layers, bottom (1) to top (9), by module-name prefix (the longest prefix wins).
LAYERS = {
    "shardline.version": 1, "shardline.errors": 1, "shardline.hardware": 1, "shardline.network_profiles": 1,
    "shardline.storage": 1, "shardline.failures": 1, "shardline.jsonl": 1, "shardline.procfs": 1,
    "shardline.clock": 1, "shardline.precision": 1, "shardline.third_party_noise": 1, "shardline.example": 1,
    "shardline.spec": 2, "shardline.presets": 2,
    "shardline.data": 3, "shardline.tasks": 3, "shardline.model": 3, "shardline.planning": 3, "shardline.rundir": 3,
    "shardline.run_status": 3, "shardline.goodput": 3, "shardline.parallel": 3,
    "shardline.training": 4, "shardline.checkpointing": 4, "shardline.resilience": 4,
    "shardline.planning.simulation": 4,  # the planner's step simulator runs the loop's own step parts
    "shardline.worker": 5, "shardline.environment": 5, "shardline.export": 5, "shardline.observe": 5,
    "shardline.ops": 5, "shardline.ops.checks": 5,  # what a worker checks on its nodes
    "shardline.engines": 6, "shardline.ops.cluster": 6,  # cluster setup reads what the Kubernetes engine grants a pod
    "shardline.api": 7,
    "shardline.cli": 8, "shardline.cli_launch": 8, "shardline.cli_dry_run": 8,
    "shardline": 9,  # the package's face: `import shardline` offers the API (lazily); nothing imports it
}
# docs/architecture.md §1.1: upward imports that are allowed, each with its reason there.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def layer(module: str) -> int:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)]


def test_every_module_has_a_layer():
    unplaced = [m for m in import_graph() if m != "shardline" and layer(m) == LAYERS["shardline"]]
    assert unplaced == [], f"modules without a layer in LAYERS: {unplaced}"


def test_imports_point_down_except_the_documented_few():
    upward = {(m, t) for m, targets in import_graph().items() for t in targets if layer(t) > layer(m)}
    assert upward <= ALLOWED_UPWARD, "imports from a lower layer up:\n" + "\n".join(
        f"{m} (layer {layer(m)}) -> {t} (layer {layer(t)})" for m, t in sorted(upward - ALLOWED_UPWARD))
    assert len(ALLOWED_UPWARD) <= 3


# docs/architecture.md §1.2: the packages of one layer, bottom first. A package imports only packages before it
# in its layer's list (and any lower layer): data reads the task plug-ins, the model reads document spans, parallel
# layouts wrap the model, the loop uses checkpoints, which use the fault hooks. Units are the keys of LAYERS.
PACKAGE_ORDER: dict[int, list[str]] = {
    3: ["shardline.goodput", "shardline.rundir", "shardline.run_status", "shardline.tasks", "shardline.data",
        "shardline.model", "shardline.parallel", "shardline.planning"],
    4: ["shardline.resilience", "shardline.checkpointing", "shardline.training", "shardline.planning.simulation"],
    5: ["shardline.ops", "shardline.environment", "shardline.observe", "shardline.ops.checks", "shardline.export",
        "shardline.worker"],
    6: ["shardline.engines", "shardline.ops.cluster"],
}


def unit(module: str) -> str:
    """The package (or top-level module) `module` belongs to: its longest prefix in LAYERS."""
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def test_every_package_of_an_ordered_layer_is_ordered():
    units = {unit(m) for m in import_graph() if layer(m) in PACKAGE_ORDER}
    unordered = sorted(u for u in units if u not in PACKAGE_ORDER[layer(u)])
    assert unordered == [], f"packages missing from PACKAGE_ORDER[their layer]: {unordered}"


def test_packages_of_one_layer_import_only_those_below_them():
    """Module cycles aside, two packages of one layer must not import each other (data ↔ model through document
    spans, say): each imports only the packages listed before it."""
    def rank(module: str) -> int:
        return PACKAGE_ORDER[layer(module)].index(unit(module))

    sideways = sorted((m, t) for m, targets in import_graph().items() for t in targets
                      if layer(m) == layer(t) in PACKAGE_ORDER and unit(m) != unit(t) and rank(t) > rank(m))
    assert sideways == [], "imports of a package listed later in the same layer:\n" + "\n".join(
        f"{m} ({unit(m)}) -> {t} ({unit(t)})" for m, t in sideways)


def test_readme_layout_names_every_module():
    """docs/layout.md is the newcomer's map: every source file is named in it (by file name, under its folder)."""
    readme = (SRC.parents[0] / "docs" / "layout.md").read_text()
    layout = readme[readme.index("## Layout"):]
    missing = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
               if p.name != "__init__.py" and p.name not in layout]
    folders = {p.parent.name for p in SRC.rglob("*.py")} - {"shardline"}
    missing += [f"{d}/" for d in folders if f"{d}/" not in layout]
    assert missing == [], f"docs/layout.md misses: {missing}"


def test_every_torchrun_test_worker_ends_without_interpreter_finalisation():
    """gloo's threads can abort a finished process's interpreter finalisation ("terminate called without an active
    exception"): every script a test starts under torchrun ends through `shardline.worker.exit_without_teardown`."""
    tests = Path(__file__).resolve().parent
    workers = sorted(p for p in tests.rglob("*_worker.py") if not p.name.startswith("test_"))
    assert workers
    missing = [str(p.relative_to(tests)) for p in workers if "exit_without_teardown(" not in p.read_text()]
    assert not missing, missing
