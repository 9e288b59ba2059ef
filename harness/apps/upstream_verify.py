"""``kph upstream verify``: a finding's patch series run as a maintainer would run it: the
series' own kselftest case under the kernel's ``ftracetest`` (``-K``: KTAP), on the kernel
with the bug and on the same source with the series' fix, the KTAP read by the kernel's
own parser (``tools/testing/kunit/kunit.py parse``).

The series is the one ``kph upstream export`` made, as committed in
``probes/patches/upstream/FINDING/SERIES/``: ``0001-*.patch`` the fix, ``0002-*.patch`` the
selftest. The selftest directory (``tools/testing/selftests/ftrace``) is taken from
Debian's unpacked source of the series, the selftest patch applied to a copy of it with
``patch -p1``, and copied into each guest; there ``./ftracetest -K TEST.tc`` runs it, on:

- ``stock``: Debian's binary kernel of the series (the default image of the series);
- ``source``: Debian's source of it, built small (``tree:SERIES``);
- ``patched``: the same source with the fix, ``0001-*.patch`` as the series has it
  (``tree:SERIES+0001-....patch``).

Expected: the test fails on ``stock`` and ``source`` (it tests for the fix) and passes on
``patched``. Each kernel's image is built when missing (``kph image build --tree``, about
1 to 6 minutes on the project's 2-core machine with the ccache warm or cold).
"""
from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..errors import HarnessError, SetupError
from ..machine.image.build import image_for
from ..vmctl import Machine
from .upstream import SERIES, find_source, finding

Progress = Callable[[str], None]

ROOT = Path(__file__).resolve().parents[2]
KERNELS = ("stock", "source", "patched")
#: where ftracetest and its test.d live in a kernel tree
FTRACE_DIR = "tools/testing/selftests/ftrace"
#: seconds for one ftracetest run in the guest: one test file, and the directories
#: --others runs (93 s for their 44 cases on Debian's 6.12, 2026-11-28, a loaded machine)
RUN_TIMEOUT = 300.0
OTHERS_TIMEOUT = 1200.0
#: the directories of probe tests --others runs whole
OTHER_DIRS = ("test.d/kprobe", "test.d/dynevent")
_NEW_TC = re.compile(r"^\+\+\+ b/" + re.escape(FTRACE_DIR) + r"/(test\.d/\S+\.tc)$", re.M)


@dataclass
class SelftestRun:
    """One kernel's run of the series' selftest."""

    kernel: str             # stock, source or patched
    selector: str           # the image it ran on (kph's kernel selector)
    expected: str           # "fail" (the bug is there) or "pass" (the fix is)
    result: str             # "pass", "fail", "skip" or "error" (kunit.py parse's reading)
    ktap: str               # ftracetest -K's output
    why: str = ""           # an error's reason
    #: every case's status as the kernel's parser read it (name -> PASS, FAIL, ...)
    cases: dict[str, str] = field(default_factory=dict)
    test: str = ""          # the series' case, by its description
    #: ran every other case too (``--others``, on the two kernels :func:`changed` compares)
    others: bool = False

    @property
    def ok(self) -> bool:
        return self.result == self.expected

    @property
    def line(self) -> str:
        """ftracetest's own result line of the series' case (of the first case without
        its description)."""
        results = [ln for ln in self.ktap.splitlines() if ln.startswith(("ok ", "not ok "))]
        return next((ln for ln in results if self.test and self.test in ln),
                    results[0] if results else "")


def series_patches(name: str, series: str) -> tuple[Path, Path]:
    """The series' fix and selftest patches, as committed (``kph upstream export``).

    :raise SetupError: no such series, or not the two patches it should be."""
    f = finding(name)
    if series not in SERIES:
        raise SetupError(f"--tree {series}: the series are made for {', '.join(SERIES)}",
                         "pass --tree 6.12 or --tree 7.3")
    d = ROOT / "probes" / "patches" / "upstream" / f.name / series
    pats = sorted(d.glob("*.patch"))
    if len(pats) != 2 or not pats[0].name.startswith("0001-") or \
            not pats[1].name.startswith("0002-"):
        raise SetupError(f"{d}: expected 0001-*.patch (the fix) and 0002-*.patch (the "
                         f"selftest), found {', '.join(p.name for p in pats) or 'nothing'}",
                         f"kph upstream export {f.name} --tree {series} --out {d}")
    return pats[0], pats[1]


def new_test(test_patch: Path) -> str:
    """The selftest file the patch adds, relative to the ftrace selftest directory."""
    m = _NEW_TC.search(test_patch.read_text())
    if m is None:
        raise SetupError(f"{test_patch.name} adds no {FTRACE_DIR}/test.d/*.tc",
                         "regenerate the series with kph upstream export")
    return m.group(1)


def selftests_tarball(src: Path, test_patch: Path) -> bytes:
    """``tools/testing/selftests/ftrace`` of the tree ``src`` with the selftest patch
    applied (``patch -p1`` in a copy), as a gzipped tar whose top directory is
    ``ftrace``."""
    with tempfile.TemporaryDirectory(prefix="kph-ftracetest-") as d:
        top = Path(d)
        shutil.copytree(src / FTRACE_DIR, top / FTRACE_DIR, symlinks=True)
        p = subprocess.run(["patch", "-p1", "--batch", "--forward", "-s", "-i",
                            str(test_patch)], cwd=top, capture_output=True, text=True)
        if p.returncode:
            raise SetupError(f"{test_patch.name} does not apply to {src.name}'s "
                             f"{FTRACE_DIR}: {(p.stdout + p.stderr).strip()[-300:]}",
                             "regenerate the series with kph upstream export")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as t:
            t.add(top / FTRACE_DIR, arcname="ftrace")
        return buf.getvalue()


def read_ktap(src: Path, ktap: str) -> dict[str, str]:
    """The kernel's own reading of ftracetest's KTAP (``kunit.py parse --json``): each
    case's name (its ``# description:``) and status, PASS, FAIL, SKIP or ERROR
    (kunit_json.py; ftracetest's UNRESOLVED and UNTESTED come out as ERROR, its
    UNSUPPORTED as SKIP); empty when it found no case."""
    parser = src / "tools" / "testing" / "kunit" / "kunit.py"
    with tempfile.TemporaryDirectory(prefix="kph-ktap-") as d:
        inp, out = Path(d) / "ktap", Path(d) / "out.json"
        inp.write_text(ktap)
        subprocess.run([sys.executable, str(parser), "parse", f"--json={out}", str(inp)],
                       capture_output=True, text=True, timeout=60)
        try:
            doc = json.loads(out.read_text())
        except (OSError, ValueError):
            return {}
    cases = doc.get("test_cases", []) + [c for g in doc.get("sub_groups", [])
                                         for c in g.get("test_cases", [])]
    return {str(c.get("name", "")): str(c.get("status", "")) for c in cases}


def verdict(statuses: Sequence[str]) -> str:
    """One verdict of some cases' statuses: "fail" when one failed, "pass" when every one
    passed, "skip" when one was skipped (unsupported: nothing measured, neither outcome),
    "error" when one could not run or there is none."""
    got = set(statuses)
    if "FAIL" in got:
        return "fail"
    if not got or got - {"PASS", "SKIP"}:
        return "error"
    return "pass" if got == {"PASS"} else "skip"


def description(tarball: bytes, tc: str) -> str:
    """A test file's ``# description:``, which ftracetest names its case by."""
    with tarfile.open(fileobj=io.BytesIO(tarball)) as t:
        f = t.extractfile(f"ftrace/{tc}")
        text = f.read().decode("utf-8", "replace") if f is not None else ""
    m = re.search(r"^# description: (.*)$", text, re.M)
    if m is None:
        raise SetupError(f"{tc} has no '# description:' line", "regenerate the series")
    return m.group(1).strip()


def selector(kernel: str, series: str, fix: Path) -> str:
    return {"stock": series, "source": f"tree:{series}",
            "patched": f"tree:{series}+{fix}"}[kernel]


def verify(name: str, series: str = "6.12", kernels: Sequence[str] = KERNELS, *,
           others: bool = False, progress: Progress | None = None) -> list[SelftestRun]:
    """Run the series' selftest under ftracetest on each of ``kernels``; ``others``:
    with every other case of ``test.d/kprobe`` and ``test.d/dynevent`` on the two kernels
    :func:`changed` compares (:func:`compared`: each run's ``cases``); a third kernel runs
    the series' case alone (its other cases would be compared with nothing)."""
    say = progress or (lambda s: None)
    bad = [k for k in kernels if k not in KERNELS]
    if bad or not kernels:
        raise SetupError(f"--kernels {','.join(kernels)}: each is one of {', '.join(KERNELS)}",
                         "e.g. --kernels stock,source,patched")
    fix, test = series_patches(name, series)
    tc = new_test(test)
    src = find_source(series, progress)
    tarball = selftests_tarball(src, test)
    desc = description(tarball, tc)
    whole = compared(kernels) if others else ()
    runs = []
    for k in kernels:
        sel = selector(k, series, fix)
        expected = "pass" if k == "patched" else "fail"
        target = " ".join(OTHER_DIRS) if k in whole else tc
        say(f"{k}: the image of {sel} (built when missing)")
        try:
            img = image_for(sel, progress=say)
            say(f"{k}: ftracetest -K {target}")
            ktap = run_selftest(img, tarball, target,
                                timeout=OTHERS_TIMEOUT if k in whole else RUN_TIMEOUT)
        except HarnessError as exc:
            runs.append(SelftestRun(k, sel, expected, "error", "", why=str(exc)))
            continue
        cases = read_ktap(src, ktap)
        mine = [st for n, st in cases.items() if n == desc]
        runs.append(SelftestRun(k, sel, expected, verdict(mine), ktap, cases=cases,
                                test=desc, others=k in whole))
    return runs


def compared(kernels: Sequence[str]) -> tuple[str, ...]:
    """The kernels ``--others`` runs every other case on, those :func:`changed` compares:
    the one with the bug (``source``, the same tree as the patched one, when it runs; else
    ``stock``) and ``patched``."""
    before = "source" if "source" in kernels else "stock"
    return tuple(k for k in kernels if k in (before, "patched"))


def changed(runs: Sequence[SelftestRun]) -> dict[str, tuple[str, str]]:
    """The other cases whose status differs between the kernel with the bug and the
    patched one (``source`` when it ran, else ``stock``): name -> (before, after). A case
    one of the two lacks counts as changed."""
    by = {r.kernel: r for r in runs if r.others and r.cases}
    before = by.get("source") or by.get("stock")
    after = by.get("patched")
    if before is None or after is None:
        return {}
    names = (set(before.cases) | set(after.cases)) - {after.test}
    return {n: (before.cases.get(n, "-"), after.cases.get(n, "-")) for n in sorted(names)
            if before.cases.get(n) != after.cases.get(n)}


def run_selftest(image, tarball: bytes, target: str, *, timeout: float = RUN_TIMEOUT) -> str:
    """ftracetest's KTAP for ``target`` (test files or directories under the ftrace
    selftest directory), in a fresh guest of ``image``."""
    with Machine.boot(image) as vm:
        vm.write_file("/tmp/kph-ftrace.tgz", tarball)
        vm.run("cd /tmp && tar xzf kph-ftrace.tgz && rm kph-ftrace.tgz", check=True)
        r = vm.run(f"cd /tmp/ftrace && ./ftracetest -K {target}", timeout=timeout)
        return r.stdout
