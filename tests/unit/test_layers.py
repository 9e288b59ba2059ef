"""The package's import graph: data flows image -> Machine -> engine -> records -> diff ->
report, and a lower layer never imports a higher one (issue 13: the vmctl <-> engine /
images / snapshot circle existed because Machine fetched guest files on demand)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "harness"


def _imports() -> dict[str, set[str]]:
    """module -> harness modules it imports anywhere (top level or inside functions)."""
    graph: dict[str, set[str]] = {}
    for f in PKG.rglob("*.py"):
        mod = ".".join(f.relative_to(PKG.parent).with_suffix("").parts)
        if mod.endswith(".__init__"):
            mod = mod[: -len(".__init__")]
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node in _walk_runtime(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("harness"):
                    subs = [f"{target}.{a.name}" for a in node.names]
                    subs = [m for m in subs                 # from . import facts
                            if (PKG.parent / (m.replace(".", "/") + ".py")).exists()]
                    deps |= set(subs)
                    if len(subs) < len(node.names):     # names of the package itself
                        deps.add(target)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("harness")}
        graph[mod] = {d for d in deps if d != mod and d != "harness"}
    return graph


def _walk_runtime(tree: ast.AST):
    """ast.walk, without ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and isinstance(child.test, ast.Name) \
                    and child.test.id == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


#: Known and accepted: the kprobe_events grammar hands uprobe lines to the uprobe_events
#: grammar, which builds on its types (one grammar in two files; the version-keyed grammar
#: of the kernel matrix, issue 16, replaces both).
ALLOWED = {("harness.kernel.grammar.kprobe", "harness.kernel.grammar.uprobe")}


def test_no_import_cycles_in_the_package():
    g = _imports()
    for a, b in ALLOWED:
        g[a].discard(b)
    assert _cycle(g) is None, " -> ".join(_cycle(g) or [])


def test_the_machine_imports_nothing_above_it():
    above = {"harness.engines.gdbstub_engine", "harness.diff.runner", "harness.diff.verdict", "harness.diff.report",
             "harness.cli", "harness.backends", "harness.engines.uprobes", "harness.apps.trapflow",
             "harness.apps.repro", "harness.machine.image.build", "harness.apps.pytest_plugin"}
    g = _imports()
    bad = {d for d in g["harness.vmctl"] if any(d == a or d.startswith(a + ".") for a in above)}
    assert not bad, bad
    for leaf in ("harness.errors", "harness.constants", "harness.procs", "harness.machine.handlerctx"):
        assert not (g[leaf] - {"harness.constants", "harness.errors"}), (leaf, g[leaf])


#: Known debt, to go with the grammar's split into one parser and two users (issue 26):
#: the uprobe_events grammar still takes the kprobe_events grammar's private helpers.
PRIVATE_ALLOWED = {("harness.kernel.grammar.uprobe", "harness.kernel.grammar.kprobe")}


def test_no_module_takes_another_module_s_private_names():
    bad = []
    for f in PKG.rglob("*.py"):
        mod = ".".join(f.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") \
                        and (mod, target) not in PRIVATE_ALLOWED:
                    bad.append(f"{mod} takes {target}.{a.name}")
    assert not bad, bad
