"""EventsBackend.register() writes its lines two ways: kph-reader's ``w`` request (plain
syscalls in the guest's reader daemon, no process: probes/progs/reader.c) or the guest
shell's script through the agent. On each booted kernel, the lines of every kind of
tests/vm/test_refusal_words.py and a few more (an enable that fails, removals, a probe
type that differs) give the same outcome both ways: accepted or not, errno, the
``error_log`` words and caret, why, mode; and the reader's way is the one taken."""
from __future__ import annotations

import pytest
from selftests import series_machine
from test_refusal_words import LINES, _spec, register_both

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

MORE = [
    "p:kph/u3 /bin/busybox:0x7fffffff",     # accepted, then uprobe_register() refuses it
    "r:kph/d vfs_read",                     # kph/d exists as a p probe: EEXIST, logged
    "-:kph/d",
    "-:kph/never",                          # ENOENT, nothing logged
    "p:kph/twice vfs_read",
    "-:kph/twice",
]


@pytest.fixture(params=["6.1", "6.12", "7.3"])
def machine(request):
    with series_machine(request, request.param) as vm:
        yield vm


def test_the_readers_writes_and_the_shells_give_the_same_outcomes(machine, monkeypatch):
    from harness.backends.events import EventsBackend
    from harness.kernel.grammar import KernelView

    view = KernelView(machine.facts.rules)
    # 6.1 has no f, t or e lines (fprobe events came with 6.4, eprobes' grammar later)
    older = machine.facts.series == "6.1"
    specs = [_spec(line, view) for line in [ln for ln, _ in LINES] + MORE
             if not (older and line[0] in "fte")]
    asked: list[int] = []
    real = machine.reader_writes

    def spy(ops, **kw):
        got = real(ops, **kw)
        asked.append(got is not None)
        return got
    monkeypatch.setattr(machine, "reader_writes", spy)

    def outcomes(shell: bool):
        be = EventsBackend(machine)
        be.shell_writes = shell
        try:
            out = be.register(specs)
            cpus = be._cpus
        finally:
            be.close()
        return [(o.probe, o.accepted, o.errno, o.message, o.subsystem, o.column, o.reason,
                 o.mode) for o in out], cpus

    shell, reader = outcomes(True), outcomes(False)
    assert asked == [True], "the reader's way was not taken"
    assert len(shell[0]) == len(specs)
    differ = [f"{s.text}: shell {a}, reader {b}"
              for s, a, b in zip(specs, shell[0], reader[0]) if a != b]
    assert not differ, "\n".join(differ)
    assert shell[1] == reader[1] and reader[1]
    # the lines meant to be refused or accepted were (not both ways failing alike)
    by = {s.text: o for s, o in zip(specs, reader[0])}
    assert by["p:kph/d do_sys_openat2 a=%di"][1] and by["-:kph/d"][1]
    assert not by["-:kph/never"][1] and by["-:kph/never"][3] == "No such file or directory"
    assert not by["p:kph/u3 /bin/busybox:0x7fffffff"][1]
    assert by["p:kph/u3 /bin/busybox:0x7fffffff"][6] == "enabling it failed"
    assert by["p:kph/k1 do_sys_openat2 x=%zz"][4] == "trace_kprobe"
    assert machine.pull("/sys/kernel/tracing/dynamic_events") == b""


def test_a_removal_naming_a_uprobes_path_goes_to_uprobe_events(machine):
    """A ``-:`` line whose arguments name a path removes a uprobe event: written to
    uprobe_events (kprobe_events removes kprobes only, and would answer ENOENT), where
    the kernel matches its first argument against ``PATH:0x%016lx`` of the probe
    (kernel/trace/trace_uprobe.c: trace_uprobe_match_command_head()): the offset as the
    probe was written (``0x1139``) does not match, nor does another offset. A group of
    both kinds is removed through dynamic_events. The host backend predicts each
    outcome."""
    import errno

    from harness.diff.runner import resolve_uprobes
    from harness.kernel.grammar import KernelView, parse

    view = KernelView(machine.facts.rules)
    off = resolve_uprobes(machine, [parse("p:kph/u4 /usr/bin/kph-loop:kph_add",
                                          kernel=view)])[0].offset
    at, padded = f"/usr/bin/kph-loop:{off:#x}", f"/usr/bin/kph-loop:{off:#018x}"
    lines = [f"p:kph/u4 {at} a=%di", f"-:kph/u4 /usr/bin/kph-loop:{off + 1:#018x}",
             f"-:kph/u4 {at}", f"-:kph/u4 {padded} a=%si", f"-:kph/u4 {padded} a=%di",
             f"-:kph/u4 {padded}", f"p:kph/u5 {at}", f"-:kph/ {padded}", f"-:kph/u5",
             # a group of both kinds: dynamic_events frees every kind
             "p:kph2/k vfs_read", f"p:kph2/u {at}", "-:kph2/", "-:kph2/k"]
    specs = [_spec(line, view) for line in lines]
    h_out, g_out = register_both(machine, specs)
    nope = (False, errno.ENOENT)
    assert [(o.accepted, o.errno) for o in g_out] == [
        (True, 0), nope, nope, nope, (True, 0), nope, (True, 0), (True, 0), nope,
        (True, 0), (True, 0), (True, 0), nope], g_out
    assert [(o.accepted, o.errno) for o in h_out] == [(o.accepted, o.errno) for o in g_out], \
        [(s.text, o.accepted, o.errno, o.reason) for s, o in zip(specs, h_out)]
    for f in ("uprobe_events", "kprobe_events", "dynamic_events"):
        assert machine.pull(f"/sys/kernel/tracing/{f}") == b"", f
