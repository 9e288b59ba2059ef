"""The checks of the kernels' own ftrace selftest cases. The cases themselves (the probe
definitions, workloads, what each kernel answers, :func:`fill`) live in
:mod:`harness.apps.selftests` (6.1's) and :mod:`harness.apps.selftests_newer` (6.12's and
7.3's), which ``kph hunt`` runs too; the names are re-exported here. Shared by
``test_selftests.py`` and ``test_selftests_newer.py``; not collected.
"""
from __future__ import annotations

import contextlib
import errno

from harness.apps.selftests import (  # noqa: F401 - re-exported for the test modules
    ACCEPT, ANY, EEXIST_ARG, EEXIST_EVENT, EEXIST_SAME, EEXIST_TYPE, EXEC, FORK, FTRACE,
    MKEVENT, MKINST, OPEN, PROBEFUNC, PVPANIC, READ, SH, STAND_IN, SYMLINK, C, Case, case_id,
    fill, guest_errors, ids)


@contextlib.contextmanager
def series_machine(request, series: str):
    """A fresh machine of ``series`` (its image built first when there is none), booted
    with the run's options."""
    from harness.apps.pytest_plugin import _boot_opts, boot_machine
    from harness.errors import HarnessError
    from harness.machine.image.build import build_image
    from harness.machine.image.store import default_image

    try:
        img = default_image(series)
    except HarnessError:
        img = build_image(kernel=series, progress=lambda s: None)
    with boot_machine(img, **_boot_opts(request.config)) as vm:
        assert vm.facts.series == series
        yield vm


def check_case(probe_diff, case: Case, series: str):
    """Run ``case`` host-side and in the guest on one execution; both sides must agree,
    and each line must get what ``case.expected(series)`` says."""
    vm = probe_diff.vm
    specs = [fill(s, vm) for s in case.specs]
    workload = fill(case.workload, vm)
    res = probe_diff(specs, workload, guest=case.guest)
    expected = case.expected(series)
    # a case with no line expected to hit may arm nothing (refused, pending; "ok" is
    # either): each line's outcome is checked below
    res.assert_equivalent(min_events=0, refusals_ok="hit" not in expected)
    host, guest = res.runs
    assert [o.index for o in host.outcomes] == list(range(len(specs)))
    assert [o.index for o in guest.outcomes] == list(range(len(specs)))
    for i, want in enumerate(expected):
        h, g = host.outcomes[i], guest.outcomes[i]
        where = f"line {i + 1} {specs[i]!r}: host {h}, {case.guest} {g}"
        if want in ("hit", "ok", "pending"):
            assert h.accepted and g.accepted, where
            if want != "ok":    # ok: accepted, registered or kept unregistered
                assert bool(h.pending) == (want == "pending"), where
            if want == "hit":
                from harness.diff import report
                assert res.matched.get(h.probe, 0) >= 1, \
                    f"{where}: no hit\n{report.text(res.result)}"
        else:
            name, _, msg = want.partition(": ")
            assert not h.accepted and not g.accepted, where
            assert h.errno == g.errno == getattr(errno, name), where
            if msg:
                assert h.message == msg and g.message == msg, where
    return res


def check_parse_refusals(vm, items, *, carets: bool = True) -> tuple[int, int, int]:
    """Every ``(source, line with ^ at the selftest's caret)`` of ``items``: the harness
    refuses it as the booted kernel parses it (its rules and BTF), and the guest's
    ``error_log`` says the same at the same column (or, where the kernel logs nothing,
    the errno agrees); or both accept it (a line another kernel's selftest lists).
    ``carets``: the selftest's caret must be the kernel's too (its own kernel's list).
    Returns (logged, silent, accepted) counts."""
    from harness.errors import ProbeSpecError
    from harness.kernel.grammar import parse

    from harness.backends.tracelayer import TraceLayer

    view = TraceLayer(vm).view()        # the booted kernel: rules, BTF, symbols, events
    bad, logged, silent, accepted = [], 0, 0, 0
    filled = [(source, fill(raw, vm)) for source, raw in items]
    lines = [(source, raw.replace("^", "", 1), raw.index("^") if "^" in raw else None)
             for source, raw in filled]
    # each line alone in the guest, all in one request (accepted ones removed at once)
    gots = guest_errors(vm, [line for _, line, _ in lines])
    for (source, line, caret), got in zip(lines, gots, strict=True):
        try:
            parse(line, kernel=view)
        except ProbeSpecError as exc:
            ours = (str(exc), exc.column, exc.errno, exc.logged)
        else:
            ours = None
        if got is None or ours is None:
            if got is not None or ours is not None:
                bad.append(f"{source}: {line!r}: the " + (
                    f"harness accepts it, the guest refuses it: {got}" if ours is None else
                    f"guest accepts it, the harness refuses it: {ours[0]!r}"))
            else:
                accepted += 1
            continue
        code, msg, col = got
        if msg is None:             # the kernel refuses without a log entry
            silent += 1
            if ours[3] or code != ours[2]:
                bad.append(f"{source}: {line!r}: guest {errno.errorcode[code]}, no "
                           f"error_log; harness {errno.errorcode[ours[2]]} {ours[0]!r}"
                           + (" (logged)" if ours[3] else ""))
            continue
        logged += 1
        if (msg, col) != ours[:2] or not ours[3] or code != ours[2] or \
                (carets and caret is not None and caret != col):
            bad.append(f"{source}: {line!r}: guest {msg!r} at {col} "
                       f"({errno.errorcode[code]}), harness {ours[0]!r} at {ours[1]} "
                       f"({errno.errorcode[ours[2]]})"
                       + (f", selftest caret {caret}" if caret is not None else ""))
    assert not bad, "\n".join(bad)
    assert vm.run("cat /sys/kernel/tracing/dynamic_events").stdout == ""
    return logged, silent, accepted


def check_registration(vm, lines: list[str]) -> list:
    """Register ``lines`` on both sides without arming anything; every line must be
    accepted or refused alike (errno and message). Returns the guest's outcomes."""
    from harness.backends.events import EventsBackend
    from harness.backends.host import HostBackend
    from harness.kernel.grammar import KernelView, parse

    view = KernelView(vm.facts.rules)
    specs = [parse(ln, kernel=view) for ln in lines]
    host, guest = HostBackend(vm, armed=False), EventsBackend(vm)
    try:
        h_out, g_out = host.register(specs), guest.register(specs)
    finally:
        host.close()
        guest.close()
    # a side that returned fewer outcomes than lines (nothing, at worst) must not pass
    assert len(h_out) == len(g_out) == len(specs), (len(specs), h_out, g_out)
    differ = [f"{specs[i].text}: host {h.errno} {h.message!r}, guest {g.errno} {g.message!r}"
              for i, (h, g) in enumerate(zip(h_out, g_out, strict=True))
              if (h.accepted, h.errno, h.message) != (g.accepted, g.errno, g.message)]
    assert not differ, "\n".join(differ)
    return g_out


def check_lines(vm, lines: list[str]) -> list[str]:
    """Each line parsed as the booted kernel parses it (its rules, BTF, symbols) and
    written to its ``kprobe_events``/``uprobe_events``: both accept it, or both refuse it
    with the same ``error_log`` text, caret and errno. Returns what differs."""
    from harness.errors import ProbeSpecError
    from harness.machine.image.facts import kernel_view
    from harness.kernel.grammar import parse

    view = kernel_view(vm.facts, vm.symbols, read=lambda a, n: vm.host.read(a, n))
    bad = []
    filled = [fill(raw, vm) for raw in lines]
    for line, got in zip(filled, guest_errors(vm, filled), strict=True):
        try:
            parse(line, kernel=view)
            ours = None
        except ProbeSpecError as exc:
            ours = (errno.errorcode[exc.errno], str(exc) if exc.logged else None,
                    exc.column if exc.logged else None)
        theirs = None if got is None else (errno.errorcode[got[0]], got[1], got[2])
        if ours is None and theirs is not None:
            # refused at registration, not while parsing: the host side's trace layer and
            # register_kprobe() rules say it (no caret: the outcome has none)
            from harness.backends.host import HostBackend
            from harness.kernel.grammar import KernelView
            host = HostBackend(vm, armed=False)
            try:
                (o,) = host.register([parse(line, kernel=KernelView(vm.facts.rules))])
            finally:
                host.close()
            if not o.accepted:
                ours = (errno.errorcode[o.errno], o.message, theirs[2])
        if ours != theirs:
            bad.append(f"{line!r}: harness {ours or 'accepts'}, guest {theirs or 'accepts'}")
    return bad
