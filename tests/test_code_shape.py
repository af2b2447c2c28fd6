"""The code stays readable: functions fit on a screen, and library code logs instead of printing."""

from __future__ import annotations

import ast
import sys

from tests.helpers.project import REPO

MAX_FUNCTION_LINES = 80


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


def test_no_function_in_src_is_longer_than_80_lines():
    long = []
    for path in sorted((REPO / "src").rglob("*.py")):
        for node in _functions(ast.parse(path.read_text(encoding="utf-8"))):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_library_code_does_not_print():
    printing = []
    for path in sorted((REPO / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                printing.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert printing == []


# --- imports run downward, without circles (issue 27), at module and function level (issue 37) -----------------

PACKAGE = REPO / "src" / "train_deploy"
ENTRY, STAGE, CONTROL, DOMAIN, GROUND = 5, 4, 3, 2, 1
FLOORS = {
    # what starts a run or a command: Kedro's settings and hooks, the project's commands
    **dict.fromkeys(("settings", "hooks", "cli", "commands", "__main__"), ENTRY),
    # the stages: Kedro's pipelines and their registry
    **dict.fromkeys(("pipelines", "pipeline_registry"), STAGE),
    # what runs around the stages and over every domain: the skip decision, the preflight checks, the scheduler
    **dict.fromkeys(("run_control.retrain", "run_control.preflight", "run_control.schedule"), CONTROL),
    # serving the champion
    **dict.fromkeys(("serve", "serving"), CONTROL),
    # what the stages do, one package each
    **dict.fromkeys(("corpus", "training", "export", "averaging", "registry", "retention", "validation"), DOMAIN),
    # the ground every floor stands on
    **dict.fromkeys(("__init__", "handoffs", "atomic", "project", "config", "environment", "cache", "console",
                     "datasets", "baselines", "hashing", "params", "progress", "redaction"), GROUND),
    # run control every floor may use: the run lock, signal handling, alerts, stopping a process tree
    **dict.fromkeys(("run_control", "run_control.lock", "run_control.signals", "run_control.notify",
                     "run_control.processes"), GROUND),
}
"""The floor of each module: a top-level module or package, or a dotted module inside a package whose modules
stand on different floors (the longest name that matches wins)."""
KNOWN_VIOLATIONS: set[tuple[str, str]] = set()
"""(importer, imported) pairs that go up a floor today; each must still exist, so the list only shrinks."""
KNOWN_CIRCLES: set[str] = set()
"""Circles found today, each written from its first module in sorted order; the list only shrinks too."""


def _module_name(path, package=PACKAGE) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The project modules an import statement names: ``from a.b import c`` names the sub-module ``a.b.c`` when
    there is one, else ``a.b``; relative imports count from the module's own package."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - node.level + 1] + ([node.module] if node.module else [])
        names = [".".join(["train_deploy", *base, alias.name]) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        names = [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        return []
    found = []
    for name in (n for n in names if n.startswith("train_deploy.")):
        inner = name.removeprefix("train_deploy.")
        while inner not in known and "." in inner:  # a function or class: its module
            inner = inner.rsplit(".", 1)[0]
        found.append(inner if inner in known else "__init__")  # from train_deploy import __version__
    return found


def import_graph(package=PACKAGE) -> dict[str, set[str]]:
    """Module → the project modules it imports, at module level or inside functions (``train_deploy.`` left off;
    the package itself is ``__init__``); ``package`` is the folder of ``train_deploy``."""
    files = {_module_name(path, package): path for path in sorted(package.rglob("*.py"))}
    known = set(files)
    graph = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_package = path.name == "__init__.py"
        graph[module] = {target for node in ast.walk(tree)
                         for target in _imported(node, module, is_package, known) if target != module}
    return graph


def _floor(module: str) -> int | None:
    parts = module.split(".")
    return next((FLOORS[name] for name in (".".join(parts[:n]) for n in range(len(parts), 0, -1)) if name in FLOORS),
                None)


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) pairs of ``graph`` where a module imports one on a higher floor."""
    return {(module, target) for module, targets in graph.items() for target in targets
            if (_floor(module) or 0) < (_floor(target) or 0)}


def test_every_module_stands_on_a_floor():
    assert sorted(m for m in import_graph() if _floor(m) is None) == []  # add new top-level modules to FLOORS


def test_no_module_imports_one_on_a_higher_floor():
    upward = upward_imports(import_graph())
    assert sorted(upward - KNOWN_VIOLATIONS) == []
    assert sorted(KNOWN_VIOLATIONS - upward) == []  # fixed: take it off the list


def test_an_import_up_inside_a_function_counts_as_one_at_module_level(tmp_path, monkeypatch):
    """A lazy import is still an import: the run-control floor's skip decision reaching into a stage's nodes from
    inside a function (as retrain.py once did at module level) is found, and so is a relative one."""
    monkeypatch.setattr(sys.modules[__name__], "FLOORS", {
        "cli": ENTRY, "pipelines": STAGE, "skip": CONTROL, "ground": GROUND, "__init__": GROUND})
    files = {"__init__.py": "", "cli.py": "",
             "skip.py": "def check():\n    from train_deploy.pipelines.corpus.nodes import node\n",
             "ground.py": "def run():\n    from .cli import main\n",
             "pipelines/__init__.py": "", "pipelines/corpus/__init__.py": "",
             "pipelines/corpus/nodes.py": "import train_deploy.ground\nfrom train_deploy.skip import check\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    assert sorted(upward_imports(import_graph(tmp_path))) == [("ground", "cli"), ("skip", "pipelines.corpus.nodes")]


def test_a_module_inside_a_package_may_stand_on_its_own_floor(monkeypatch):
    """A package whose modules stand on different floors names them: the longest name in FLOORS wins."""
    monkeypatch.setitem(FLOORS, "runs", GROUND)
    monkeypatch.setitem(FLOORS, "runs.retrain", CONTROL)
    assert (_floor("runs"), _floor("runs.lock"), _floor("runs.retrain"), _floor("runs.retrain.x")) == (
        GROUND, GROUND, CONTROL, CONTROL)
    assert upward_imports({"runs.lock": {"runs.retrain"}, "runs.retrain": {"runs.lock", "registry"}}) == {
        ("runs.lock", "runs.retrain")}


def test_no_import_circle():
    graph, state, circles = import_graph(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                circles.append(" → ".join(path[path.index(target):] + [module, target]) if target in path
                               else f"{module} → {target}")
            elif target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert sorted(set(circles) - KNOWN_CIRCLES) == []
    assert sorted(KNOWN_CIRCLES - set(circles)) == []  # gone: take it off the list


def test_training_knows_nothing_of_the_registry():
    """A warm start's champion is found and downloaded by ``registry/champion.py``; training/ reads folders."""
    graph = import_graph()
    assert sorted((m, t) for m, targets in graph.items() if m.startswith("training") for t in targets
                  if t.startswith("registry")) == []
