"""``kph bisect``: the first commit of a kernel tree's history on which a ``kph repro``
scenario is MET, as the ``Fixes:`` line of the fix.

``git bisect run`` drives the search; each step (this module run as a program,
``python -m harness.apps.bisect --step ...``) builds the checked-out commit into the tree's
one build directory (``O=``, incremental: ``harness.machine.image.kbuild.build``), makes its
image (``build_image.build_tree_image``: the kernel's own kph_kprobes.ko, facts, a ready
snapshot), boots it once and runs the scenario (``harness.apps.repro.run``):

- MET (the bug shows): the commit is **bad**, exit 1;
- NOT MET, the trigger run through (outcome ``ok`` or ``refused``): **good**, exit 0;
- the kernel does not build, or its run ended in a crash, hang or loss the scenario does
  not describe (:func:`step_verdict`): **skip**, exit 125 (``git bisect skip``: a commit
  in the middle of a series may not build, or may fail in another way; the step's cause
  names it);
- anything else (a setup error; a run whose hits or counters could not be read, which
  ``repro.run`` raises rather than call NOT MET): exit 255, which makes ``git bisect run``
  stop; the error line is in the step's log and is the run's error.

Before the search the two ends are run the same way (unless ``check_ends=False``): the
``bad`` revision must be MET and the ``good`` one NOT MET, or the search would name a
commit that proves nothing. The work tree is left at the commit it had (``git bisect
reset``) on every path, an interrupt included. Every step is one JSON line in
``OUT/steps.jsonl`` with its repro bundle under ``OUT/step-N-COMMIT/``; ``git bisect
log`` is kept in ``OUT/bisect.log``.

:func:`plant_history` makes the history the tests and ``bench/kernel_bisect.py`` search: on the
git copy of Debian's tree (``harness.apps.upstream.base_tree``), a finding's fix, then a
few commits of which one undoes it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import HarnessError, SetupError
from ..machine.image import kbuild
from ..machine.image.build import build_tree_image
from ..procs import stop_process
from . import repro, upstream
from . import scenario as scenario_mod

Progress = Callable[[str], None]

#: ``git bisect run``'s meaning of a step's exit status (git-bisect(1)).
GOOD, BAD, SKIP, ABORT = 0, 1, 125, 255
#: How long one step (build, image, boot, scenario) may take before the bisect stops.
STEP_TIMEOUT = 3600.0
STEPS_FILE = "steps.jsonl"


@dataclass
class Step:
    """One commit built and judged."""
    role: str                   # "bad end", "good end", "step 1", ...
    commit: str
    subject: str
    verdict: str                # "good", "bad", "skip" or "error"
    cause: str                  # the scenario's cause, the build error, or the error line
    build_s: float = 0.0        # building the kernel and its image
    run_s: float = 0.0          # booting and running the scenario
    kernel: str = ""            # the built kernel's release
    bundle: str = ""            # the repro bundle

    def line(self) -> str:
        t = f"build {self.build_s:.0f} s, run {self.run_s:.0f} s"
        return f"{self.role:9s} {self.commit[:12]} {self.verdict.upper():5s} ({t}) {self.subject}"


@dataclass
class BisectResult:
    first_bad: str
    subject: str
    steps: list[Step] = field(default_factory=list)
    out: Path = Path(".")

    @property
    def fixes_line(self) -> str:
        return f'Fixes: {self.first_bad[:12]} ("{self.subject}")'


# ---------------------------------------------------------------- git

def _git(tree: Path, *args: str, check: bool = True, timeout: float = 600.0) -> str:
    p = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    if check and p.returncode:
        raise SetupError(f"`git {' '.join(args[:3])}` in {tree} failed: "
                         f"{(p.stderr.strip() or p.stdout.strip())[-300:]}",
                         "see the git error above")
    return p.stdout


def check_tree(tree: str | os.PathLike[str]) -> Path:
    """``tree`` as a kernel work tree git can bisect: a checkout with history, clean, not
    bisecting already.

    :raise SetupError: each case in one line (Debian's linux-source has no history)."""
    t = kbuild.check_tree(Path(tree))
    p = subprocess.run(["git", "-C", str(t), "rev-parse", "--show-toplevel"],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if p.returncode != 0 or Path(p.stdout.strip()).resolve() != t:
        raise SetupError(f"{t} is not a git work tree: kph bisect needs the tree's history "
                         "(Debian's linux-source has none)",
                         "pass a git checkout of the kernel, e.g. a clone of stable or mainline")
    if _git(t, "rev-list", "--max-count=2", "HEAD", check=False).count("\n") < 2:
        raise SetupError(f"{t} has one commit and no history to bisect",
                         "pass a checkout with the commits between --good and --bad")
    gd = Path(_git(t, "rev-parse", "--absolute-git-dir").strip())
    if (gd / "BISECT_START").exists():
        raise SetupError(f"a git bisect is in progress in {t}",
                         f"end it first: git -C {t} bisect reset")
    dirty = _git(t, "status", "--porcelain", "-uno", timeout=600).strip()
    if dirty:
        raise SetupError(f"{t} has uncommitted changes ({dirty.splitlines()[0].strip()} ...): "
                         "a bisect checks out other commits",
                         "commit or stash them first")
    return t


def resolve(tree: Path, rev: str, what: str) -> str:
    """The full commit id of ``rev`` in ``tree``, or one line naming it."""
    if rev.startswith("-"):
        raise SetupError(f"{what} {rev!r} is not a revision", "give a commit, tag or branch")
    out = _git(tree, "rev-parse", "-q", "--verify", f"{rev}^{{commit}}", check=False).strip()
    if not out:
        raise SetupError(f"{what} {rev!r}: no such commit in {tree}",
                         f"see `git -C {tree} log --oneline`")
    return out


def subject(tree: Path, commit: str) -> str:
    return _git(tree, "log", "-1", "--format=%s", commit).strip()


# ---------------------------------------------------------------- one step

def judge(scenario: str | os.PathLike[str], tree: Path, out: Path, role: str, *,
          qemu: str | None = None, progress: Progress | None = None) -> Step:
    """Build the commit ``tree`` has checked out, boot it, run the scenario: one
    :class:`Step`, appended to ``out/steps.jsonl``. A build error is a ``skip``; any
    other harness error an ``error`` (re-raised after it is logged)."""
    say = progress or (lambda s: None)
    commit = _git(tree, "rev-parse", "HEAD").strip()
    st = Step(role, commit, subject(tree, commit), "error", "")
    scn = scenario_mod.load(scenario)
    t0 = time.monotonic()
    try:
        say(f"bisect: {role}: building {commit[:12]} ({st.subject})")
        try:
            img = build_tree_image(tree, progress=say)
        except SetupError as exc:
            if str(exc).startswith("the kernel build failed"):
                st.verdict, st.cause = "skip", str(exc)
                return st
            raise
        st.build_s = time.monotonic() - t0
        st.kernel = img.version
        t1 = time.monotonic()
        say(f"bisect: {role}: running {Path(scenario).name} on {img.version}")
        res = repro.run(scn, out_dir=out / f"{role.replace(' ', '-')}-{commit[:12]}",
                        qemu=qemu, progress=say, image=img)
        st.run_s = time.monotonic() - t1
        st.verdict = step_verdict(res.met, res.observed.outcome)
        st.cause, st.bundle = res.cause, str(res.bundle)
        if st.verdict == "skip":
            st.cause = (f"the run ended in {res.observed.outcome}, which the scenario does not "
                        f"expect, so the commit cannot be judged: {res.cause}")
        return st
    except HarnessError as exc:
        st.cause = str(exc)
        raise
    finally:
        if not st.build_s:
            st.build_s = time.monotonic() - t0
        with open(out / STEPS_FILE, "a") as f:
            f.write(json.dumps(asdict(st)) + "\n")


#: The outcomes of a run that went through: a kernel without the bug gives one of them.
JUDGED_OUTCOMES = frozenset({"ok", "refused"})


def step_verdict(met: bool, outcome: str) -> str:
    """A commit's verdict from its scenario run: ``bad`` when MET; ``good`` when NOT MET
    and the kernel ran the trigger through (the outcome ``ok`` or ``refused``); else
    ``skip``, git bisect's "this commit cannot be tested": a kernel that oopsed, panicked,
    hung or was lost in a way the scenario does not describe shows another failure, not
    the absence of this one."""
    if met:
        return "bad"
    return "good" if outcome in JUDGED_OUTCOMES else "skip"


def read_steps(out: Path) -> list[Step]:
    p = out / STEPS_FILE
    if not p.is_file():
        return []
    return [Step(**json.loads(ln)) for ln in p.read_text().splitlines() if ln.strip()]


def _step_main(argv: list[str]) -> int:
    """``python -m harness.apps.bisect --step SCENARIO TREE OUT [QEMU]``: what ``git
    bisect run`` runs for each commit; its exit status is the commit's verdict."""
    ap = argparse.ArgumentParser(prog="kph-bisect-step")
    ap.add_argument("--step", required=True)
    ap.add_argument("--tree", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--qemu")
    a = ap.parse_args(argv)
    out = Path(a.out)
    n = len([s for s in read_steps(out) if s.role.startswith("step")]) + 1
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(ABORT))

    def say(s: str) -> None:
        print(s, file=sys.stderr, flush=True)
    try:
        st = judge(a.step, Path(a.tree), out, f"step {n}", qemu=a.qemu, progress=say)
    except HarnessError as exc:
        say(f"bisect: step {n}: error: {exc}")
        return ABORT
    except BaseException as exc:  # noqa: BLE001 - git bisect run must stop, not go on
        say(f"bisect: step {n}: internal error: {type(exc).__name__}: {exc}")
        return ABORT
    say(f"bisect: {st.line()}")
    return {"good": GOOD, "bad": BAD, "skip": SKIP}[st.verdict]


# ---------------------------------------------------------------- the search

def run(scenario: str | os.PathLike[str], tree: str | os.PathLike[str], good: str, bad: str, *,
        out: str | os.PathLike[str] | None = None, check_ends: bool = True,
        qemu: str | None = None, progress: Progress | None = None,
        step_timeout: float = STEP_TIMEOUT) -> BisectResult:
    """Search ``good..bad`` of ``tree`` for the first commit on which ``scenario`` is MET.

    :raise SetupError: bad input (each case in one line), an end that is not what it is
        said to be, or a search that could not name one commit (only skipped commits left).
    """
    say = progress or (lambda s: None)
    scn = scenario_mod.load(scenario)             # a bad scenario: one line, before any build
    t = check_tree(tree)
    g, b = resolve(t, good, "--good"), resolve(t, bad, "--bad")
    if g == b:
        raise SetupError("--good and --bad name the same commit", "give two commits")
    if subprocess.run(["git", "-C", str(t), "merge-base", "--is-ancestor", g, b],
                      stdin=subprocess.DEVNULL, timeout=600).returncode != 0:
        raise SetupError(f"--good {good} is not an ancestor of --bad {bad}",
                         "give the older, good commit as --good")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    o = Path(out) if out else Path("kph-runs") / f"bisect-{re.sub(r'[^A-Za-z0-9_.-]+', '-', Path(scenario).stem)}-{stamp}"
    o.mkdir(parents=True, exist_ok=True)
    (o / STEPS_FILE).unlink(missing_ok=True)
    o = o.resolve()
    head = _git(t, "symbolic-ref", "-q", "--short", "HEAD", check=False).strip() or \
        _git(t, "rev-parse", "HEAD").strip()
    n = len(_git(t, "rev-list", "--ancestry-path", f"{g}..{b}").split())
    say(f"bisect: {n} commit(s) after --good up to --bad; {scn.name}")
    try:
        if check_ends:
            for rev, role, want in ((b, "bad end", "bad"), (g, "good end", "good")):
                _git(t, "checkout", "-q", "--detach", rev)
                st = judge(scenario, t, o, role, qemu=qemu, progress=say)
                say(f"bisect: {st.line()}")
                if st.verdict != want:
                    what = {"good": "NOT MET", "bad": "MET",
                            "skip": "not judged (no build, or another failure)"}[st.verdict]
                    raise SetupError(f"the {role} ({rev[:12]}) is {what}: {st.cause}",
                                     "give a --bad on which the scenario is MET and a --good "
                                     "on which it is NOT MET (or check the scenario)")
        _git(t, "bisect", "start", b, g)
        first = _bisect_run(t, scenario, o, qemu, say, step_timeout * (n.bit_length() + 3))
    finally:
        blog = _git(t, "bisect", "log", check=False)
        if blog:
            (o / "bisect.log").write_text(blog)
        _git(t, "bisect", "reset", check=False)    # (it takes no -q)
        _git(t, "checkout", "-q", head, check=False)
    return BisectResult(first, subject(t, first), read_steps(o), o)


def _bisect_run(t: Path, scenario: str | os.PathLike[str], o: Path, qemu: str | None,
                say: Progress, deadline: float) -> str:
    """``git bisect run`` of this module's step; the first bad commit's id. The whole run
    is stopped (SIGTERM to its process group) after ``deadline`` seconds."""
    cmd = ["git", "-C", str(t), "bisect", "run", sys.executable, "-m", "harness.apps.bisect",
           "--step", str(Path(scenario).resolve()), "--tree", str(t), "--out", str(o)]
    if qemu:
        cmd += ["--qemu", qemu]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2])] + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    with open(o / "git-bisect-run.log", "w") as log:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        timer = _Timer(deadline, lambda: os.killpg(p.pid, signal.SIGTERM))
        try:
            assert p.stdout is not None
            for line in p.stdout:
                log.write(line)
                log.flush()
                if line.strip():        # the steps' progress and git's "Bisecting: ..."
                    say(line.rstrip("\n"))
            p.wait(timeout=30)
        except BaseException:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            stop_process(p, [(None, 20.0), (signal.SIGKILL, 5.0)])
            raise
        finally:
            timer.cancel()
    text = (o / "git-bisect-run.log").read_text()
    if timer.fired:
        raise SetupError(f"the bisect took over {deadline:.0f} s and was stopped",
                         f"see {o / 'git-bisect-run.log'}")
    m = re.search(r"^([0-9a-f]{40}) is the first bad commit", text, re.M)
    if m:
        return m[1]
    errors = [ln[len("bisect: "):] for ln in text.splitlines() if ": error: " in ln]
    if errors:
        raise SetupError(f"the bisect stopped: {errors[-1]}", f"see {o / 'git-bisect-run.log'}")
    if "only skipped commits left" in text:
        raise SetupError("the bisect could not name one commit: the commits left could not "
                         "be judged (no build, or another failure)",
                         f"see {o / STEPS_FILE} for each one's cause")
    raise SetupError(f"git bisect run ended without a first bad commit (exit {p.returncode})",
                     f"see {o / 'git-bisect-run.log'}")


class _Timer:
    def __init__(self, seconds: float, action: Callable[[], None]) -> None:
        import threading

        self.fired = False

        def fire() -> None:
            self.fired = True
            try:
                action()
            except ProcessLookupError:
                pass
        self._t = threading.Timer(seconds, fire)
        self._t.daemon = True
        self._t.start()

    def cancel(self) -> None:
        self._t.cancel()


# ---------------------------------------------------------------- a history to search

@dataclass(frozen=True)
class Planted:
    tree: Path
    good: str           # the finding's fix
    bad: str            # the last commit
    planted: str        # the commit that undoes the fix
    commits: tuple[str, ...]
    title: str = ""     # the planted commit's subject


def planted_title(fix_subject: str) -> str:
    """The planted commit's subject for a fix's: the fix's subsystem prefix, then the
    fix taken back ("tracing/kprobes: Take back \"Fix the errno ...\"")."""
    prefix, _, rest = fix_subject.rpartition(": ")
    return f'{prefix}: Take back "{rest}"' if prefix else f'Take back "{fix_subject}"'


def plant_history(dest: str | os.PathLike[str], *, finding: str = "non-unique-symbol-errno",
                  series: str = "6.12", after: int = 1,
                  progress: Progress | None = None) -> Planted:
    """A small history to bisect, checked out at ``dest`` (a ``git clone --shared`` of the
    git copy of Debian's ``series`` tree): Debian's tree, the finding's fix
    (``harness.apps.upstream``: the good end), a commit that changes a comment in
    kernel/trace/trace_kprobe.c, the commit that undoes the fix (planted), then ``after``
    more comment changes (the last is the bad end). Every commit is built by a step: the
    comments make the builds incremental ones that recompile something."""
    say = progress or (lambda s: None)
    t = upstream.base_tree(series, progress)
    f = upstream.finding(finding)
    fix = dataclasses.replace(f.build(t)[0], notes="")     # no git notes: the export's own
    c_fix = upstream._apply(t, t.base, fix)
    commits = [c_fix]

    def comment(parent: str, n: int) -> str:
        anchor = '#include "trace_probe.h"\n'
        return upstream._apply(t, parent, upstream.Patch(
            f"tracing/kprobes: Unrelated change {n}", "A comment, to make the build an "
            "incremental one that recompiles a file.",
            (upstream.Edit("kernel/trace/trace_kprobe.c", anchor,
                           anchor + f"/* kph bisect: an unrelated change ({n}) */\n"),)))
    commits.append(comment(commits[-1], 1))
    title = planted_title(fix.subject)
    undo = upstream.Patch(title, "The planted regression: the fix is taken out again.",
                          tuple(upstream.Edit(e.path, e.new, e.old) for e in fix.edits))
    commits.append(upstream._apply(t, commits[-1], undo))
    planted = commits[-1]
    for i in range(after):
        commits.append(comment(commits[-1], i + 2))
    branch = f"kph/bisect/{finding}/{series}"
    upstream.git(t.repo, "update-ref", f"refs/heads/{branch}", commits[-1])
    d = Path(dest).resolve()
    if d.exists() and any(d.iterdir()):
        raise SetupError(f"{d} exists and is not empty", "give a new directory")
    say(f"bisect: checking out the planted history in {d} (about 1 min)")
    upstream.git(None, "clone", "-q", "--shared", "--branch", branch, str(t.repo), str(d))
    return Planted(d, c_fix, commits[-1], planted, tuple(commits), title)


if __name__ == "__main__":
    sys.exit(_step_main(sys.argv[1:]))
