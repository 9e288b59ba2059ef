"""Mutants of the plugin's C (probes/plugin), compiled and loaded: each one a textual
patch of a copy of the current sources, built into a directory of its own with the flags
kph builds the plugin with (``harness.machine.pluginlink.CFLAGS``), and loaded for one
real ``kph diff --host plugin`` (``harness.vmctl``'s ``build_plugin`` answers the mutant's
``.so`` for that run). The real sources are never touched.

A pattern is a regular expression on stable code that must match exactly once in the
plugin's C files taken together (a function may move to another file): when it matches
zero or several times (the sources changed under it) the mutant is
an *error*, never counted killed. A build that fails is an error too.

Used by ``bench/oracle_mutants.py --kind c`` and tests/vm/test_oracle_mutants.py.
"""
from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from harness import vmctl
from harness.machine import pluginlink

import oracle_mutants as om


@dataclass(frozen=True)
class CMutant:
    name: str
    cls: str            # boundary, drop, register, recycle, field, block, window
    what: str
    file: str           # where it was written (the pattern is searched in every C file)
    pattern: str        # a regular expression that must match exactly once
    replacement: str    # re.sub's replacement
    probes: str         # a key of oracle_mutants.PROBE_SETS


MUTANTS: tuple[CMutant, ...] = (
    CMutant("c-pool-empty-boundary", "boundary",
            "kret_entry() counts a miss when one instance is left, not none (== 0 -> <= 1)",
            "kph_plugin.c",
            r"(pthread_mutex_lock\(&rp_lock\);\s*if \(p->nfree) == 0(\) \{\s*"
            r"pthread_mutex_unlock\(&rp_lock\);\s*count_miss\(p\);)",
            r"\1 <= 1\2", "pool"),
    CMutant("c-pool-size-off-by-one", "boundary",
            "a return probe's pool holds maxactive - 1 free instances",
            "kph_plugin.c",
            r"p->maxactive = p->nfree = maxactive;",
            "p->maxactive = maxactive; p->nfree = maxactive - 1;", "pool"),
    CMutant("c-record-dropped", "drop", "emit() drops every fourth record, uncounted",
            "kph_plugin.c",
            r"(\n\s*)ring_put\(vcpu, v->rec, size\);",
            r"\1if (seq % 4 != 3) ring_put(vcpu, v->rec, size);", "reads"),
    CMutant("c-wrong-register", "register", "read_context() reads %si into the record's %di",
            "kph_plugin.c",
            r"v->regs\[i\] = reg_read\(v, g_reg\[i\]\);",
            "v->regs[i] = reg_read(v, g_reg[i == KREG_DI ? KREG_SI : i]);", "reads"),
    CMutant("c-instance-not-recycled", "recycle",
            "flush_task() unlinks a dead task's return instance but never frees it",
            "kph_plugin.c",
            r"ri->rp->freelist\[ri->rp->nfree\+\+\] = ri;(\s*atomic_fetch_add\(user \? "
            r"&g_uret_freed : &g_kret_flushed, 1\);)",
            r"/* mutant: not recycled */\1", "exits"),
    CMutant("c-pid-is-tgid", "field", "read_context() reads task->tgid as the pid",
            "kph_plugin.c",
            r"pid_off = g_pid_off;",
            "pid_off = g_pid_off ? g_pid_off + 4 : 0;", "threads"),
    CMutant("c-block-lost", "block", "a record's last captured block not counted in its header",
            "kph_plugin.c",
            r"h\.nblocks = cap\.nblocks;",
            "h.nblocks = cap.nblocks ? cap.nblocks - 1 : 0;", "reads"),
    CMutant("c-read-not-captured", "boundary",
            "cap_read() refuses reads of 8 bytes and more (len > sizeof(tmp) made len >= 8)",
            "fetch.c",
            r"if \(len == 0 \|\| len > sizeof\(tmp\)\) \{",
            "if (len == 0 || len >= 8) {", "reads"),
    CMutant("c-window-write-skipped", "window",
            "service_window() flips the plugin's window but never writes the guest's switch",
            "kph_plugin.c",
            r"x = \(x & ~win_w\[i\]\.clear\) \| win_w\[i\]\.set;",
            "x = x; /* mutant: the guest's switch not made */", "reads"),
    CMutant("c-marks-word-skipped", "window",
            "service_window() leaves the first word of the window's reads unread (0): the "
            "guest's nhit at the window's edges short of one event's CPU 0",
            "kph_plugin.c",
            r"for \(i = 0; i < win_nr; i\+\+\) \{",
            "for (i = 1; i < win_nr; i++) {", "reads"),
    CMutant("c-context-unread", "field",
            "read_context() never reads preempt_count(): every hit's context unknown",
            "kph_plugin.c",
            r"if \(g_preempt_off\) \{",
            "if (0) {", "reads"),
)


def c_sources() -> tuple[str, ...]:
    """The C files kph compiles into the plugin (``pluginlink.C_SOURCES`` where the
    module names them, else the ``.c`` files of its ``SOURCES``)."""
    return tuple(getattr(pluginlink, "C_SOURCES", None)
                 or (n for n in pluginlink.SOURCES if n.endswith(".c")))


def patched_sources(m: CMutant, dest: Path) -> str:
    """The plugin's sources (``pluginlink.SOURCES``) copied to ``dest``, ``m`` applied in
    the one C file where its pattern matches; that file's name.

    :raise ValueError: the pattern matches the current sources zero or several times
        (over all the C files together)."""
    for name in pluginlink.SOURCES:
        shutil.copy(pluginlink.PLUGIN_DIR / name, dest / name)
    hits = {name: len(re.findall(m.pattern, (dest / name).read_text())) for name in c_sources()}
    n = sum(hits.values())
    if n != 1:
        raise ValueError(f"pattern matches {n} times in {', '.join(c_sources())} "
                         "(want exactly 1): the sources changed under it")
    name = next(k for k, v in hits.items() if v)
    (dest / name).write_text(re.sub(m.pattern, m.replacement, (dest / name).read_text()))
    return name


def build(m: CMutant, dest: Path) -> Path:
    """The mutant's plugin, built in ``dest`` as kph builds the real one
    (``pluginlink.build_plugin``: its compiler, ``CFLAGS`` and C files)."""
    patched_sources(m, dest)
    so = dest / pluginlink.SO_NAME
    cmd = [pluginlink._compiler(), *pluginlink.CFLAGS, "-I", str(dest), "-o", str(so),
           *(str(dest / n) for n in c_sources())]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    if out.returncode != 0:
        err = [ln for ln in out.stderr.splitlines() if "error" in ln] or [out.stderr.strip()]
        raise ValueError(f"the mutant does not build: {err[0][:200]}")
    return so


def run(m: CMutant) -> om.Outcome:
    """Build ``m`` and judge it by one ``kph diff --host plugin`` of its probe set."""
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"kph-cmut-{m.name}-") as d:
        try:
            so = build(m, Path(d))
        except (ValueError, OSError, subprocess.TimeoutExpired) as exc:
            return om.Outcome(m.name, "plugin", -1, "", time.monotonic() - t0, kind="c",
                              error=str(exc))
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(vmctl, "build_plugin", lambda qemu: so))
            code, line = om.kph_diff("plugin", m.probes)
    return om.Outcome(m.name, "plugin", code, line, time.monotonic() - t0, kind="c")
