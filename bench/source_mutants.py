#!/usr/bin/env python3
"""Source mutants of the host engines' Python (harness/backends, harness/engines), made by
cosmic-ray (the ``test`` extra), each judged by real ``kph diff`` runs on a booted kernel.

Scope: cosmic-ray enumerates every mutation of the chosen files (``TARGETS``); its own
line filter (``cr-filter-lines``) then keeps only the lines of the chosen functions, which
are the ones the judging runs execute on every hit (the fetch context, the hit's record,
collect and the counters); the rest of each file is skipped, so the score is over code the
runs reach. The functions are found by name in the current source (``ast``), so the ranges
follow edits; a function no longer there is an error.

cosmic-ray mutates files in place: it runs in a copy of the tree (``harness``, ``bench``,
``probes``, ``images``) under a temporary directory, never in the working tree. Its test
command is ``python bench/source_mutants.py --judge ENGINE`` in that copy: the judging
probe sets (``JUDGE``), one ``kph diff --host ENGINE`` each, in order; the mutant is killed
at the first that does not exit 0 (diverged, an error, the VM lost, nothing measured), or
when the run passes cosmic-ray's timeout. It survives when every set is equivalent.

    python bench/source_mutants.py [--engine gdbstub|plugin|both] [--keep DIR]
    python bench/source_mutants.py --one ENGINE   # the suite's case: one mutant, judged

``bench/oracle_mutants.py --kind source`` runs the same and prints the score with the
others'.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

VENV_BIN = Path(sys.executable).parent

#: engine -> file -> the functions mutated (``Class.method`` or ``function``)
TARGETS: dict[str, dict[str, tuple[str, ...]]] = {
    "gdbstub": {
        "harness/backends/host.py": (
            "_Ctx.reg", "_Ctx.read", "_Ctx.task", "_Ctx.comm", "_Ctx.pid", "_Ctx.retval",
            "HostBackend._record_hit", "HostBackend.collect", "HostBackend.counters"),
    },
    "plugin": {
        "harness/backends/plugin.py": (
            "_RecordCtx.reg", "_RecordCtx.read", "_RecordCtx.comm", "_RecordCtx.retval",
            "PluginBackend._hit", "PluginBackend.collect", "PluginBackend.counters"),
    },
}

#: cosmic-ray's operators left out (``cr-filter-operators``): of the replacements of one
#: comparison only its negation, of one binary operator only its inverse, so that one site
#: gives one mutant, not eleven variants of the same change
EXCLUDE = (r"core/ReplaceComparisonOperator_(?!Eq_NotEq|NotEq_Eq|Lt_GtE|GtE_Lt|Gt_LtE|"
           r"LtE_Gt|Is_IsNot|IsNot_Is|In_NotIn|NotIn_In)",
           r"core/ReplaceBinaryOperator_(?!Add_Sub|Sub_Add|Mul_Div|Div_Mul|FloorDiv_Mul|"
           r"Mod_FloorDiv|BitAnd_BitOr|BitOr_BitAnd|LShift_RShift|RShift_LShift|BitXor_BitOr)")

#: the probe sets (bench/oracle_mutants.py PROBE_SETS) that judge a source mutant
JUDGE = ("reads", "opens", "stacked", "missed", "threads",
         # added to kill survivors of the first full run (docs/diff.md); a set an engine
         # does not run is passed over
         "flags", "stackn", "irq",
         # added 2026-11-28 for the survivors of code no 6.1 run reaches: fprobes, $argN
         # at returns and event probes (6.12, 7.3), an event of two lines, a call made
         # inside a guest kprobe handler
         "newer", "newest", "multi", "nested",
         # contracts checked through the Python API, not probe sets: the fetch hook's hit
         # numbers (gdbstub, _hook_contract), a hit whose task the plugin could not read
         # (plugin, _task_unread_contract), the stacked set's three worlds (both engines:
         # the host-vs-plugin leg sees the printed return addresses the guest cannot)
         "hook", "task-unread", "both")
#: cosmic-ray's timeout per mutant (s): a mutant that hangs a run is killed by it
TIMEOUT = 150.0
#: the one mutant the suite runs (tests/vm/test_oracle_mutants.py): a file, an operator
#: and the text of the line it must apply to (found in the session, so line numbers and
#: occurrences may move)
ONE = {"gdbstub": ("harness/backends/host.py", "core/ReplaceComparisonOperator_Eq_NotEq",
                   'if name == "ip":'),
       "plugin": ("harness/backends/plugin.py", "core/ReplaceComparisonOperator_Eq_NotEq",
                  "elif rec.type == REC_RET:")}


def function_lines(path: Path, names: tuple[str, ...]) -> list[str]:
    """``START-END`` line ranges of the named functions in ``path``.

    :raise ValueError: a name that is not defined there."""
    tree = ast.parse(path.read_text())
    found: dict[str, tuple[int, int]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for n in node.body:
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[f"{node.name}.{n.name}"] = (n.lineno, n.end_lineno or n.lineno)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found[node.name] = (node.lineno, node.end_lineno or node.lineno)
    missing = [n for n in names if n not in found]
    if missing:
        raise ValueError(f"{path}: no function {', '.join(missing)}")
    # the body only: a mutation of the def line's defaults would hit every caller
    return [f"{found[n][0] + 1}-{found[n][1]}" for n in names]


def covered(engine: str, work: Path) -> dict[str, set[int]]:
    """The lines of ``engine``'s target files that the judging runs execute, unmutated,
    in the copy ``work`` (``--judge ENGINE --trace``: a line tracer on those files only)."""
    out = work / f"covered-{engine}.json"
    run = subprocess.run([str(VENV_BIN / "python"), "bench/source_mutants.py", "--judge",
                          engine, "--trace", str(out)], cwd=work, capture_output=True,
                         text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"the judge fails unmutated on {engine}: "
                           f"{(run.stdout + run.stderr).strip()[-300:]}")
    return {k: set(v) for k, v in json.loads(out.read_text()).items()}


def _trace_lines(files: list[str], into: dict[str, set[int]]) -> None:
    """Record the lines executed in ``files`` (paths relative to the tree) into ``into``."""
    want = {str((ROOT / f).resolve()): f for f in files}

    def local(frame, event, arg):               # noqa: ANN001
        if event == "line":
            into[want[frame.f_code.co_filename]].add(frame.f_lineno)
        return local

    def glob(frame, event, arg):                # noqa: ANN001
        return local if frame.f_code.co_filename in want else None

    for f in files:
        into.setdefault(f, set())
    sys.settrace(glob)
    import threading
    threading.settrace(glob)


def make_copy(dest: Path) -> None:
    """The tree cosmic-ray mutates: the package and what its caches are keyed by."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
    for d in ("harness", "bench", "probes", "images"):
        shutil.copytree(ROOT / d, dest / d, ignore=ignore, symlinks=True)


def config(engine: str, file: str, ranges: list[str]) -> str:
    cmd = f"{VENV_BIN / 'python'} bench/source_mutants.py --judge {engine}"
    lines = ", ".join(json.dumps(r) for r in ranges)
    return (f'[cosmic-ray]\nmodule-path = "{file}"\ntimeout = {TIMEOUT}\n'
            f'excluded-modules = []\ntest-command = "{cmd}"\n\n'
            '[cosmic-ray.distributor]\nname = "local"\n\n'
            f'[cosmic-ray.filters.line-filter]\nlines = {{ "{file}" = [{lines}] }}\n\n'
            '[cosmic-ray.filters.operators-filter]\nexclude-operators = ['
            + ", ".join(json.dumps(e) for e in EXCLUDE) + ']\n')


def _cr(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(VENV_BIN / args[0]), *args[1:]], cwd=cwd, capture_output=True,
                          text=True, check=False)


def session(engine: str, work: Path, file: str, lines: set[int] | None = None,
            tag: str = "") -> Path:
    """A cosmic-ray session of ``file``'s mutants, filtered to the chosen functions'
    bodies and, given ``lines``, to the lines of them that the judging runs execute."""
    ranges = function_lines(work / file, TARGETS[engine][file])
    if lines is not None:
        inside = [(int(a), int(b)) for a, b in (r.split("-") for r in ranges)]
        ranges = [f"{n}-{n}" for n in sorted(lines) if any(a <= n <= b for a, b in inside)]
    cfg = work / f"cr-{engine}-{Path(file).stem}{tag}.toml"
    cfg.write_text(config(engine, file, ranges))
    db = cfg.with_suffix(".sqlite")
    db.unlink(missing_ok=True)      # cosmic-ray init refuses an existing session
    for step in (("cosmic-ray", "init", str(cfg), str(db)),
                 ("cr-filter-lines", "--config", str(cfg), str(db)),
                 ("cr-filter-operators", str(db), str(cfg))):
        out = _cr(*step, cwd=work)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(step[:2])} failed: {out.stderr.strip()[-300:]}")
    return db


_COLS = ("m.job_id", "m.operator_name", "m.start_pos_row", "m.occurrence", "m.module_path")


def _rows(db: Path, sql: str, *cols: str) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(f"SELECT {', '.join(_COLS + cols)} FROM mutation_specs m " + sql
                           ).fetchall()
    finally:
        con.close()


def _spec(r: tuple) -> dict:
    return dict(job=r[0], op=r[1], line=r[2], occ=r[3], file=r[4])


def pending(db: Path) -> list[dict]:
    """The session's mutants left after the filters: job id, operator, line, occurrence."""
    return [_spec(r) for r in _rows(db, "LEFT JOIN work_results r ON r.job_id = m.job_id "
                                        "WHERE r.job_id IS NULL")]


def results(db: Path) -> list[dict]:
    """The session's results (cosmic-ray stores its enums by name: lower-cased here to
    their values, ``skipped``, ``normal``, ``survived``, ``killed``)."""
    return [dict(_spec(r), worker=(r[5] or "").lower(), test=(r[6] or "").lower(),
                 output=r[7] or "")
            for r in _rows(db, "JOIN work_results r ON r.job_id = m.job_id",
                           "r.worker_outcome", "r.test_outcome", "r.output")]


def mutant_name(r: dict) -> str:
    return f"{Path(r['file']).name}:{r['line']}:{r['op'].split('/')[-1]}#{r['occ']}"


def run_engine(engine: str, keep: Path | None = None, only_job: str | None = None):
    """Run every mutant of ``engine``'s targets; the oracle_mutants Outcome of each."""
    import oracle_mutants as om

    outs: list = []
    with tempfile.TemporaryDirectory(prefix=f"kph-srcmut-{engine}-") as d:
        work = keep or Path(d)
        if keep is None or not (work / "harness").exists():
            make_copy(work)
        # the test command on the unmutated copy must pass, or every kill is a lie; the
        # same run says which lines the judging runs execute
        cov = covered(engine, work)
        for file in TARGETS[engine]:
            db = session(engine, work, file, cov.get(file, set()))
            if only_job is not None:
                _skip_all_but(db, only_job)
            t0 = time.monotonic()
            ex = _cr("cosmic-ray", "exec", str(db.with_suffix(".toml")), str(db), cwd=work)
            took = time.monotonic() - t0
            if ex.returncode != 0:
                raise RuntimeError(f"cosmic-ray exec failed: {ex.stderr.strip()[-300:]}")
            rs = [r for r in results(db) if r["worker"] != "skipped"]
            for r in rs:
                line = _src_line(work / r["file"], r["line"])
                err = "" if r["worker"] in ("normal", "abnormal") else f"worker {r['worker']}"
                # killed: the test command failed (or timed out); survived: it passed
                code = 0 if r["test"] == "survived" else 1
                outs.append(om.Outcome(mutant_name(r) + f" [{line}]", engine, code,
                                       (r["output"].strip().splitlines() or [""])[-1],
                                       took / max(1, len(rs)), kind="source", error=err))
    return outs


def _src_line(path: Path, n: int) -> str:
    try:
        return path.read_text().splitlines()[n - 1].strip()[:70]
    except IndexError:
        return ""


def _skip_all_but(db: Path, job: str) -> None:
    others = [p["job"] for p in pending(db) if p["job"] != job]
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkResult, WorkerOutcome
    with use_db(str(db)) as wdb:
        wdb.set_multiple_results(others, WorkResult(output="not the suite's one",
                                                    worker_outcome=WorkerOutcome.SKIPPED))


def find_one(engine: str, work: Path) -> tuple[Path, str]:
    """The suite's mutant (``ONE``) in a fresh session: its session and job id.

    :raise LookupError: no mutation of that operator on a line with that text."""
    file, op, text = ONE[engine]
    db = session(engine, work, file)
    src = (work / file).read_text().splitlines()
    for p in pending(db):
        if p["op"] == op and text in src[p["line"] - 1]:
            return db, p["job"]
    raise LookupError(f"no {op} mutation on a line with {text!r} in {file}")


def rerun(engine: str, work: Path, lines: set[int], sets: tuple[str, ...]) -> list[dict]:
    """The mutants of ``lines`` (of ``engine``'s first target file) again, in the copy
    ``work`` of an earlier run, judged by the probe sets ``sets`` only (sets added to
    kill that run's survivors): their results."""
    file = next(iter(TARGETS[engine]))
    db = session(engine, work, file, lines, tag="-rerun")
    ex = subprocess.run([str(VENV_BIN / "cosmic-ray"), "exec", str(db.with_suffix(".toml")),
                         str(db)], cwd=work, capture_output=True, text=True, check=False,
                        env={**os.environ, "KPH_JUDGE": ",".join(sets)})
    if ex.returncode != 0:
        raise RuntimeError(f"cosmic-ray exec failed: {ex.stderr.strip()[-300:]}")
    return [r for r in results(db) if r["worker"] != "skipped"]


def run_all(engines: tuple[str, ...], only: set[str] = frozenset()) -> list:
    outs: list = []
    for e in engines:
        outs += run_engine(e)
    return [o for o in outs if not only or o.mutant in only]


def one(engine: str):
    """The suite's one source mutant of ``engine``, made by cosmic-ray and judged."""
    import oracle_mutants as om

    with tempfile.TemporaryDirectory(prefix=f"kph-srcmut1-{engine}-") as d:
        work = Path(d)
        make_copy(work)
        db, job = find_one(engine, work)
        _skip_all_but(db, job)
        ex = _cr("cosmic-ray", "exec", str(db.with_suffix(".toml")), str(db), cwd=work)
        if ex.returncode != 0:
            raise RuntimeError(f"cosmic-ray exec failed: {ex.stderr.strip()[-300:]}")
        rs = [r for r in results(db) if r["worker"] != "skipped"]
        assert len(rs) == 1, rs
        r = rs[0]
        return om.Outcome(mutant_name(r), engine, 0 if r["test"] == "survived" else 1,
                          (r["output"].strip().splitlines() or [""])[-1], 0.0, kind="source",
                          error="" if r["worker"] in ("normal", "abnormal") else r["worker"])


def judge(engine: str, trace: Path | None = None) -> int:
    """cosmic-ray's test command: 0 (the mutant survives) when every judging set is
    equivalent on ``engine``, 1 at the first that is not. ``trace``: write the lines of
    the engine's target files that ran there (JSON: file -> lines)."""
    lines: dict[str, set[int]] = {}
    if trace is not None:
        _trace_lines(list(TARGETS[engine]), lines)
    try:
        return _judge(engine)
    finally:
        if trace is not None:
            sys.settrace(None)
            trace.write_text(json.dumps({k: sorted(v) for k, v in lines.items()}))


def _judge(engine: str) -> int:
    import oracle_mutants as om

    for probes in os.environ.get("KPH_JUDGE", "").split(",") if os.environ.get("KPH_JUDGE") \
            else JUDGE:
        if probes not in om.PROBE_SETS or engine not in om.PROBE_SETS[probes].engines:
            continue
        try:
            code, line = om.kph_diff(engine, probes)
        except Exception as exc:            # a mutant may raise anything: a kill
            print(f"{probes}: {type(exc).__name__}: {exc}")
            return 1
        print(f"{probes}: exit {code} {line}")
        if code != 0:
            return 1
    judged = os.environ.get("KPH_JUDGE", "").split(",") if os.environ.get("KPH_JUDGE") \
        else JUDGE
    for step, eng, check in (("hook", "gdbstub", _hook_contract),
                             ("task-unread", "plugin", _task_unread_contract),
                             ("both", engine, _three_worlds_stacked)):
        if engine != eng or step not in judged:
            continue
        try:
            ok, line = check()
        except Exception as exc:            # a mutant may raise anything: a kill
            print(f"{step}: {type(exc).__name__}: {exc}")
            return 1
        print(f"{step}: {line}")
        if not ok:
            return 1
    return 0


def _three_worlds_stacked() -> tuple[bool, str]:
    """The ``stacked`` set under ``kph diff --host both``: its host-vs-plugin leg compares
    the two engines' printed return addresses, which the guest cannot check (it records
    the host's trampoline there: the trampoline blind spot). (True, the verdict) when
    every leg agrees."""
    import contextlib
    import io

    import oracle_mutants as om
    from harness import cli

    ps = om.PROBE_SETS["stacked"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["-q", "diff", *ps.specs, "--run", ps.run, "--host", "both",
                         *ps.extra])
    said = [ln for ln in err.getvalue().splitlines() if ln.strip()] or [""]
    return code == 0, f"exit {code} {said[-1]}"


def _task_unread_contract() -> tuple[bool, str]:
    """The plugin engine's hits when it cannot read the task (``read_context()`` in
    kph_plugin.c: no ``RF_TASK``, so no ``RF_PID`` and no ``RF_COMM``): each carries no pid
    (None, which the verdict's ``pid`` rule needs, not 0) and no comm. The plugin's reads of
    the guest's direct map are made to fail (``fail_reads``, tests only), where the per-cpu
    ``current_task`` and every task_struct live. (True, what was seen) when it holds."""
    from harness.backends.plugin import PluginBackend
    from harness.kernel.grammar import parse
    from harness.machine.image.store import default_image
    from harness.vmctl import Machine

    with Machine.boot(default_image(), host="plugin") as vm:
        h = PluginBackend(vm, comm_rule="at_hit")
        try:
            h.register([parse("p:o do_sys_openat2")])
            h.enable()
            vm.host.fail_reads(0xffff888000000000, 1 << 40)
            try:
                vm.run("cat /proc/version >/dev/null", check=True)
            finally:
                vm.host.fail_reads(0, 0)
            h.disable()
            hits = [x for x in h.collect() if x.probe == "kprobes/o"]
        finally:
            h.close()
    seen = sorted({(x.pid, x.comm) for x in hits}, key=str)
    return bool(hits) and seen == [(None, "")], f"{len(hits)} hits, (pid, comm) {seen}"


def _hook_contract() -> tuple[bool, str]:
    """The gdbstub engine's fetch hook (``run_differential(hook=)``, the pytest plugin's
    ``probe_diff(hook=)``), as documented: called at each recorded hit of a probe with
    its number, 1, 2, 3, ...; a register overridden at hit 2 reaches that hit's record
    alone, so the first divergence is there. (True, what was seen) when it holds."""
    from harness.diff.runner import run_differential, trampoline_text
    from harness.diff.verdict import compare
    from harness.kernel.grammar import parse
    from harness.machine.image.store import default_image
    from harness.vmctl import Machine

    seen: dict[str, list[int]] = {}

    def hook(probe: str, nth: int, overrides: dict[str, int]) -> None:
        seen.setdefault(probe, []).append(nth)
        if probe == "kprobes/o" and nth == 2:
            overrides["di"] = 7
    with Machine.boot(default_image()) as vm:
        a, b = run_differential(vm, [parse("p:o do_sys_openat2 dfd=%di:s32")],
                                "cat /proc/version /proc/cmdline /proc/uptime", hook=hook)
        res = compare(a, b, trampoline=trampoline_text(vm))
    first = res.first
    where = (first.field, first.index, first.a_value) if first is not None else None
    ok = bool(seen) and all(v == list(range(1, len(v) + 1)) for v in seen.values()) and \
        where == ("arg:dfd", 1, "7")
    return ok, f"hit numbers {seen}, first divergence {where}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("gdbstub", "plugin", "both"), default="both")
    ap.add_argument("--judge", choices=("gdbstub", "plugin"), help=argparse.SUPPRESS)
    ap.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--one", choices=("gdbstub", "plugin"),
                    help="run only the suite's one mutant of this engine")
    ap.add_argument("--list", action="store_true", help="count the mutants and exit")
    ap.add_argument("--keep", type=Path, help="work in this directory (kept)")
    ap.add_argument("--rerun", metavar="LINE,...", help="with --keep DIR of an earlier run "
                    "and one --engine: the mutants of these lines again, judged by --sets")
    ap.add_argument("--sets", default="", metavar="SET,...", help="the probe sets of --rerun")
    args = ap.parse_args(argv)
    if args.judge:
        return judge(args.judge, args.trace)
    engines = ("gdbstub", "plugin") if args.engine == "both" else (args.engine,)
    if args.rerun:
        rs = rerun(engines[0], args.keep, {int(n) for n in args.rerun.split(",")},
                   tuple(x for x in args.sets.split(",") if x))
        for r in rs:
            print(f"{r['test']:9s} {mutant_name(r)}  "
                  f"{(r['output'].strip().splitlines() or [''])[-1][:100]}")
        return 0 if all(r["test"] == "killed" for r in rs) else 1
    if args.one:
        o = one(args.one)
        print(f"{o.status} {o.engine} {o.mutant}  {o.line}")
        return 0 if o.killed else 1
    if args.list:
        with tempfile.TemporaryDirectory() as d:
            work = Path(d)
            make_copy(work)
            for e in engines:
                cov = covered(e, work)
                for f in TARGETS[e]:
                    ps = pending(session(e, work, f, cov.get(f, set())))
                    print(f"{e} {f}: {len(ps)} mutants in {', '.join(TARGETS[e][f])}")
                    for p in ps:
                        print(f"  {p['line']:4d} {p['op']}#{p['occ']}")
        return 0
    import oracle_mutants as om
    t0 = time.monotonic()
    outs = []
    for e in engines:
        outs += run_engine(e, args.keep)
    for o in outs:
        print(f"{o.status} {o.engine:8s} {o.mutant}  {(o.error or o.line)[:90]}")
    return om.report(outs, time.monotonic() - t0)


if __name__ == "__main__":
    sys.exit(main())
