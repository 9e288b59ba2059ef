"""The package's layers (issue 26): each module imports only its own layer and the layers to
its left, at the top of the module, and takes no private name from another module.

    ground <- kernel <- machine <- engines <- backends <- diff <- apps <- cli

``ground`` is the leaf modules that import nothing of the package; ``harness.vmctl`` and
``harness.gdbstub`` rank with ``machine`` (they stay at the package's top because the
project's design names them). Every import counts: at the top, inside a function, and under
``if TYPE_CHECKING:``; so does a twin built with ``type(x)(...)``, a coupling that names no
module. Within a layer the imports may go either way, but never in a circle.

Imports inside functions are allowed only where the module says why at its top: a measured
start-up cost (``LAZY_OK``)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "harness"

#: Left to right: a module may import its own layer and the layers before it.
RANKS = [
    ("ground", ("harness.errors", "harness.constants", "harness.records", "harness.progress",
                "harness.procs", "harness.aio")),
    ("kernel", ("harness.kernel",)),
    ("machine", ("harness.machine", "harness.vmctl", "harness.gdbstub")),
    ("engines", ("harness.engines",)),
    ("backends", ("harness.backends",)),
    ("diff", ("harness.diff",)),
    ("apps", ("harness.apps",)),
    ("cli", ("harness.cli",)),
]

#: Modules whose imports inside functions are a measured start-up cost (each says so at its
#: top): ``kph --help`` loads the CLI's verbs and nothing below them (0.04 s, against 0.18 s
#: with the layers loaded), every pytest run in the venv loads the pytest plugin, and
#: ``from harness import Machine`` loads only what the name needs (PEP 562).
LAZY_OK = ("harness", "harness.cli", "harness.apps.pytest_plugin")


def _modname(f: Path) -> str:
    return ".".join(f.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")


def _exists(mod: str) -> bool:
    p = PKG.parent / mod.replace(".", "/")
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _imports(where: str = "all") -> dict[str, set[str]]:
    """module -> harness modules it imports: ``where`` "all" (top, functions, TYPE_CHECKING)
    or "lazy" (inside functions only)."""
    graph: dict[str, set[str]] = {}
    for f in PKG.rglob("*.py"):
        mod = _modname(f)
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        deps: set[str] = set()
        for node, in_func in _walk(ast.parse(f.read_text())):
            if where == "lazy" and not in_func:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("harness"):
                    subs = [m for m in (f"{target}.{a.name}" for a in node.names) if _exists(m)]
                    deps |= set(subs)
                    if len(subs) < len(node.names):     # names of the module itself
                        deps.add(target)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("harness")}
        graph[mod] = {d for d in deps if d != mod and d != "harness"}
    return graph


def _walk(tree: ast.AST):
    """(node, inside a function) for every node, ``if TYPE_CHECKING:`` blocks included."""
    todo = [(tree, False)]
    while todo:
        node, in_func = todo.pop()
        yield node, in_func
        inner = in_func or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        todo.extend((c, inner) for c in ast.iter_child_nodes(node))


def _rank(mod: str) -> int | None:
    for i, (_, prefixes) in enumerate(RANKS):
        if any(mod == p or mod.startswith(p + ".") for p in prefixes):
            return i
    return None


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


def test_every_module_has_a_layer():
    missing = [m for m in _imports() if m != "harness" and _rank(m) is None]
    assert not missing, f"add these to RANKS: {missing}"


def test_imports_go_only_leftward():
    bad = []
    for mod, deps in _imports().items():
        if mod == "harness":        # the public names, loaded on first use
            continue
        r = _rank(mod)
        for d in sorted(deps):
            if _rank(d) is not None and _rank(d) > r:
                bad.append(f"{mod} ({RANKS[r][0]}) imports {d} ({RANKS[_rank(d)][0]})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_anywhere_type_checking_included():
    g = _imports()
    assert _cycle(g) is None, " -> ".join(_cycle(g) or [])


def test_ground_imports_nothing_of_the_package_but_ground():
    g = _imports()
    for mod in RANKS[0][1]:
        assert all(_rank(d) == 0 for d in g[mod]), (mod, g[mod])


def test_imports_sit_at_the_top_except_where_start_up_time_is_measured():
    lazy = {m: d for m, d in _imports("lazy").items()
            if d and not any(m == p or m.startswith(p + ".") for p in LAZY_OK)}
    assert not lazy, lazy


def test_no_twin_is_built_with_type_of_an_object():
    """``type(m)(...)`` on an object handed in builds an object of a class the module never
    names: a coupling no import shows (the snapshot store built a twin Machine that way).
    ``type(mod.attr)()`` of a third-party module's own object is not such a twin."""
    bad = []
    for f in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Call) \
                    and isinstance(node.func.func, ast.Name) and node.func.func.id == "type" \
                    and node.func.args and isinstance(node.func.args[0], ast.Name):
                bad.append(f"{_modname(f)}:{node.lineno}")
    assert not bad, bad


def test_no_module_takes_another_module_s_private_names():
    bad = []
    for f in PKG.rglob("*.py"):
        mod = _modname(f)
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append(f"{mod} takes {target}.{a.name}")
    assert not bad, bad


def test_the_rank_check_sees_an_upward_import():
    """The checks above can fail: a kernel module importing the machine is caught."""
    g = {"harness.kernel.x": {"harness.vmctl"}}
    r = _rank("harness.kernel.x")
    assert any(_rank(d) > r for d in g["harness.kernel.x"])
    assert _cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_every_long_module_is_named_in_the_internals_with_its_reason():
    """A module past ~800 lines holds one kernel concept or one object, and
    docs/internals.md says which (issue 26)."""
    table = (PKG.parent / "docs" / "internals.md").read_text()
    long = [f.relative_to(PKG).as_posix() for f in PKG.rglob("*.py")
            if len(f.read_text().splitlines()) > 850]
    missing = [m for m in long if f"`{m}`" not in table]
    assert not missing, f"say in docs/internals.md why these are one piece, or split them: {missing}"
