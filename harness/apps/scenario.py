"""Repro scenario files (TOML): what to boot, which probes, the trigger, what to expect.

Pure: text in, a frozen ``Scenario`` out, every key checked, and a bad file answered with
``ScenarioError`` naming the key at fault (``probe[2].side``). See
``probes/scenarios/README.md`` for the commented format.
"""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ProbeSpecError, ScenarioError
from ..kernel.grammar import KernelView, parse
from ..kernel.rules import rules_for

SIDES = ("host", "events", "module")
OUTCOMES = ("ok", "panic", "oops", "hang", "refused")
BUGS = ("null-deref",)
COUNTER_FIELDS = ("nhit", "nmissed", "hits")
_OPERAND = r"(?:-?\d+|(?:host|events|module):[\w.-]+/[\w.-]+\.(?:nhit|nmissed|hits))"
COUNTER_RE = re.compile(rf"^\s*({_OPERAND})\s*(==|!=|>=|<=|>|<)\s*({_OPERAND})\s*$")


@dataclass(frozen=True)
class ProbeDecl:
    """One probe: a kprobe_events ``spec`` on a ``side``, or host-side Python handlers."""

    side: str
    spec: str | None = None
    symbol: str | None = None
    offset: int = 0
    kind: str = "p"                      # p or r, for handler-based host probes
    pre_handler: str | None = None       # "file.py:function" or "package.module:function"
    post_handler: str | None = None
    handler: str | None = None           # kretprobe return handler
    entry_handler: str | None = None
    maxactive: int = 0
    bug: str | None = None               # module side: "null-deref"


@dataclass(frozen=True)
class Expectation:
    outcome: str = "ok"
    console: str | None = None           # regex that must appear on the console
    output: str | None = None            # regex on the trigger's stdout + stderr
    stack: str | None = None             # regex on the symbolized stack
    counters: tuple[str, ...] = ()
    equivalent: bool | None = None       # host vs in-guest records of same-named probes
    errno: str | None = None             # with outcome "refused"


@dataclass(frozen=True)
class Scenario:
    path: Path
    name: str
    description: str
    machine: dict[str, Any]
    setup: tuple[str, ...]
    trigger: str
    probes: tuple[ProbeDecl, ...]
    expect: Expectation
    timeouts: dict[str, float] = field(default_factory=dict)
    text: str = ""
    #: ``[kernels]``: the kernels ``kph repro --kernels`` names (``kernel_selectors``)
    kernels: dict[str, Any] = field(default_factory=dict)

    def kernel_selectors(self, series: str | None = None) -> dict[str, str]:
        """The named kernels of ``[kernels]``, as image selectors: ``stock`` is Debian's
        binary kernel of ``series`` (default: the table's own), ``source`` a build of
        Debian's source of it (the same release), ``patched`` that build with the fix for
        that series applied: ``patch`` for the table's series, ``patches.SERIES`` for each
        other one (a fix whose code moved between series is not the same patch)."""
        k = self.kernels
        if not k:
            return {}
        s = series or k["series"]
        out = {"stock": s, "source": f"tree:{s}"}
        fix = k.get("patch") if s == k["series"] else k.get("patches", {}).get(s)
        if fix:
            out["patched"] = f"tree:{s}+{(self.path.parent / fix).resolve()}"
        return out

    def kernel_series(self) -> list[str]:
        """Each series ``[kernels]`` names a fix for: its own first, then ``patches``'."""
        k = self.kernels
        return [k["series"], *k.get("patches", {})] if k else []


def _get(d: dict[str, Any], key: str, typ: type | tuple[type, ...], where: str, path: str,
         default: Any = None, required: bool = False) -> Any:
    if key not in d:
        if required:
            raise ScenarioError(path, f"{where}{key}", "is required")
        return default
    v = d[key]
    if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
        names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ScenarioError(path, f"{where}{key}", f"must be a {names}, not {type(v).__name__}")
    return v


def _only(d: dict[str, Any], allowed: set[str], where: str, path: str) -> None:
    for k in d:
        if k not in allowed:
            raise ScenarioError(path, f"{where}{k}", f"unknown key (allowed: {', '.join(sorted(allowed))})")


def load(path: str | Path) -> Scenario:
    """Read and validate a scenario file.

    :raise ScenarioError: the file is missing, not TOML, or a key is wrong (named).
    """
    p = Path(path)
    ps = str(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ScenarioError(ps, "", f"cannot read: {exc.strerror}") from exc
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(ps, "", f"not valid TOML: {exc}") from exc
    _only(doc, {"name", "description", "machine", "setup", "trigger", "probe", "expect",
                "timeouts", "kernels"}, "", ps)
    name = _get(doc, "name", str, "", ps, required=True)
    machine = _get(doc, "machine", dict, "", ps, {})
    _only(machine, {"image", "kernel", "initrd", "vmlinux", "smp", "memory", "append"},
          "machine.", ps)
    for k in ("image", "kernel", "initrd", "vmlinux", "memory", "append"):
        _get(machine, k, str, "machine.", ps)
    _get(machine, "smp", int, "machine.", ps)
    kern = machine.get("kernel")
    if kern is not None and re.fullmatch(r"\d+\.\d+(?:[.\-+][\w.+-]*)?", kern) \
            and not (p.parent / kern).exists() and not Path(kern).exists():
        # kernel = "6.12" (or a full ABI) names a kernel of the matrix: its image.
        if "image" in machine:
            raise ScenarioError(ps, "machine.kernel", "give either a kernel series (its image) "
                                "or machine.image, not both")
        machine["image"] = machine.pop("kernel")
    setup = _get(doc, "setup", list, "", ps, [])
    for i, c in enumerate(setup):
        if not isinstance(c, str):
            raise ScenarioError(ps, f"setup[{i}]", "must be a shell command string")
    trigger = _get(doc, "trigger", str, "", ps, required=True)
    # a spec is checked with the grammar of the scenario's kernel when it names its series
    kernels = doc.get("kernels") if isinstance(doc.get("kernels"), dict) else {}
    series = next((str(v) for v in (kernels.get("series"), machine.get("image"))
                   if isinstance(v, str) and re.match(r"\d+\.\d+", v)), None)
    view = KernelView(rules_for(series)) if series else None
    probes = tuple(_probe(d, i, ps, view)
                   for i, d in enumerate(_get(doc, "probe", list, "", ps, [])))
    exp = _get(doc, "expect", dict, "", ps, required=True)
    _only(exp, {"outcome", "console", "output", "stack", "counters", "equivalent", "errno"},
          "expect.", ps)
    outcome = _get(exp, "outcome", str, "expect.", ps, "ok")
    if outcome not in OUTCOMES:
        raise ScenarioError(ps, "expect.outcome", f"{outcome!r} is not one of {', '.join(OUTCOMES)}")
    for k in ("console", "output", "stack"):
        rx = _get(exp, k, str, "expect.", ps)
        if rx is not None:
            try:
                re.compile(rx)
            except re.error as e:
                raise ScenarioError(ps, f"expect.{k}", f"bad regular expression: {e}") from None
    counters = _get(exp, "counters", list, "expect.", ps, [])
    for i, c in enumerate(counters):
        if not isinstance(c, str) or not COUNTER_RE.match(c):
            raise ScenarioError(ps, f"expect.counters[{i}]",
                                f"{c!r} is not 'SIDE:GROUP/EVENT.FIELD OP VALUE' "
                                f"(fields {', '.join(COUNTER_FIELDS)}; OP == != > >= < <=)")
    expect = Expectation(outcome, exp.get("console"), exp.get("output"), exp.get("stack"),
                         tuple(counters), _get(exp, "equivalent", bool, "expect.", ps),
                         _get(exp, "errno", str, "expect.", ps))
    tmo = _get(doc, "timeouts", dict, "", ps, {})
    _only(tmo, {"boot", "trigger", "hang"}, "timeouts.", ps)
    timeouts = {"boot": 60.0, "trigger": 60.0, "hang": 20.0}
    for k in list(tmo):
        v = _get(tmo, k, (int, float), "timeouts.", ps)
        if v <= 0:
            raise ScenarioError(ps, f"timeouts.{k}", "must be positive")
        timeouts[k] = float(v)
    kernels = _get(doc, "kernels", dict, "", ps, {})
    _only(kernels, {"series", "patch", "patches"}, "kernels.", ps)
    if kernels:
        series = _get(kernels, "series", str, "kernels.", ps, required=True)
        if not re.fullmatch(r"\d+\.\d+", series):
            raise ScenarioError(ps, "kernels.series", f"{series!r} is not a series such as 6.12")
        patch = _get(kernels, "patch", str, "kernels.", ps)
        if patch is not None and not (p.parent / patch).is_file():
            raise ScenarioError(ps, "kernels.patch", f"no file {p.parent / patch}")
        for other, fix in _get(kernels, "patches", dict, "kernels.", ps, {}).items():
            where = f'kernels.patches."{other}"'
            if not re.fullmatch(r"\d+\.\d+", other) or other == series:
                raise ScenarioError(ps, where, f"{other!r} is not another series such as 7.3 "
                                    f"(the fix for {series} is kernels.patch)")
            if not isinstance(fix, str) or not (p.parent / fix).is_file():
                raise ScenarioError(ps, where, f"no file {p.parent / str(fix)}")
    return Scenario(p, name, _get(doc, "description", str, "", ps, ""), dict(machine),
                    tuple(setup), trigger, probes, expect, timeouts, text, dict(kernels))


def _probe(d: Any, i: int, ps: str, view: KernelView | None = None) -> ProbeDecl:
    where = f"probe[{i}]."
    if not isinstance(d, dict):
        raise ScenarioError(ps, f"probe[{i}]", "must be a table ([[probe]])")
    _only(d, {"side", "spec", "symbol", "offset", "kind", "pre_handler", "post_handler",
              "handler", "entry_handler", "maxactive", "bug"}, where, ps)
    side = _get(d, "side", str, where, ps, required=True)
    if side not in SIDES:
        raise ScenarioError(ps, f"{where}side", f"{side!r} is not one of {', '.join(SIDES)}")
    spec = _get(d, "spec", str, where, ps)
    if spec is not None:
        try:
            parse(spec, kernel=view) if view is not None else parse(spec)
        except ProbeSpecError as exc:
            raise ScenarioError(ps, f"{where}spec", f"{exc} at column {exc.column}") from None
    handlers = [k for k in ("pre_handler", "post_handler", "handler", "entry_handler") if k in d]
    for k in handlers:
        v = _get(d, k, str, where, ps)
        if ":" not in v:
            raise ScenarioError(ps, f"{where}{k}", f"{v!r} must be 'file.py:function' or 'module:function'")
    if spec is None and not handlers:
        raise ScenarioError(ps, f"probe[{i}]", "needs a spec, or handlers with a symbol")
    if handlers and side != "host":
        raise ScenarioError(ps, f"{where}{handlers[0]}", "Python handlers run host-side only (side = \"host\")")
    if handlers and spec is None:
        _get(d, "symbol", str, where, ps, required=True)
    kind = _get(d, "kind", str, where, ps, "p")
    if kind not in ("p", "r"):
        raise ScenarioError(ps, f"{where}kind", "must be p or r")
    bug = _get(d, "bug", str, where, ps)
    if bug is not None and (bug not in BUGS or side != "module"):
        raise ScenarioError(ps, f"{where}bug", f"only {', '.join(BUGS)} on side = \"module\"")
    return ProbeDecl(side, spec, d.get("symbol"), _get(d, "offset", int, where, ps, 0), kind,
                     d.get("pre_handler"), d.get("post_handler"), d.get("handler"),
                     d.get("entry_handler"), _get(d, "maxactive", int, where, ps, 0), bug)
