"""Losses of the in-guest sides fail the run with their count, on the booted default
image (issue 36): the ring buffer overwritten under a hot probe (a 4 KiB buffer_size_kb),
a drain cut short, and kph_kprobes.ko's buffer full (its bufsize parameter at 4 KiB). And
the host side's: the plugin engine's ring full while its drain is held back."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from harness.backends import events as events_mod
from harness.backends.events import EventsBackend
from harness.backends.module import ModuleBackend
from harness.cli.common import machine
from harness.cli.main import make_parser
from harness.diff.runner import run_differential
from harness.diff.verdict import compare
from harness.errors import GuestLossError, PluginRecordError
from harness.kernel.grammar import parse
from harness.vmctl import Machine

pytestmark = pytest.mark.vm

def kph(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.cli", *argv], capture_output=True,
                          text=True, timeout=600)


OPEN = "p:kph/hot do_sys_openat2 path=+0(%si):ustring"
# opens from the shell itself (a redirection of a builtin): no fork per open
OPENS = "i=0; while [ $i -lt {n} ]; do : < /proc/version; i=$((i+1)); done"


@pytest.fixture
def streamed(vm, monkeypatch):
    """The sizes of the machine's data-port reads (``Machine.read_stream``) in the test."""
    sizes: list[int] = []
    real = vm.read_stream

    def spy(cmd, size, **kw):
        sizes.append(size)
        return real(cmd, size, **kw)

    monkeypatch.setattr(vm, "read_stream", spy)
    return sizes


def test_a_ring_buffer_that_overflowed_fails_the_differential_run(vm, monkeypatch):
    monkeypatch.setattr(events_mod, "BUFFER_KB", 4)
    with pytest.raises(GuestLossError) as ei:
        run_differential(vm, [parse(OPEN)], OPENS.format(n=1000), guest="events")
    e = ei.value
    assert e.side == "events" and e.count > 0
    assert "per_cpu/cpu" in str(e) and "overrun" in str(e) and "buffer_size_kb 4" in str(e)
    print(f"measured: {e}")
    left = vm.run("cat /sys/kernel/tracing/kprobe_events").stdout
    assert left == ""


def test_a_drain_cut_short_fails_the_run(vm):
    be = EventsBackend(vm)
    try:
        be.register([parse(OPEN)])
        be.max_pages = 1
        be.enable()
        vm.run(OPENS.format(n=300), timeout=120)
        be.disable()
        with pytest.raises(GuestLossError, match=r"stopped at 1 page\(s\) per CPU") as ei:
            be.collect()
        assert ei.value.count > 0
        print(f"measured: {ei.value}")
    finally:
        be.close()


@pytest.mark.parametrize("reader", [True, False], ids=["kph-reader", "agent and data port"])
def test_a_big_buffer_comes_whole(vm, streamed, monkeypatch, reader):
    """With the image's kph-reader a CPU's pages come in one request of it (a page a
    read, raw bytes: ``Machine.read_pieces``); without it, the pages past the first
    window go through the machine's data port (``dd``, raw bytes), as many as
    ``per_cpu/cpuN/stats`` says are surely there, the rest through the agent. Either way
    every hit comes back, as the guest counted them, and a drain's page limit still
    holds."""
    pieces: list[int] = []
    real = vm.read_pieces

    def spy(path, max_pieces, **kw):
        got = None if not reader else real(path, max_pieces, **kw)
        if got is not None:
            pieces.append(len(got[0]))
        return got
    monkeypatch.setattr(vm, "read_pieces", spy)
    spec = parse("p:kph/hot do_sys_openat2 path=+0(%si):ustring")
    for max_pages in (None, 24):
        be = EventsBackend(vm)
        try:
            be.register([spec])
            if max_pages:
                be.max_pages = max_pages
            be.enable()
            vm.run("taskset 1 sh -c '" + OPENS.format(n=5000) + "'", timeout=300)
            be.disable()
            if max_pages:
                with pytest.raises(GuestLossError, match=r"stopped at 24 page\(s\) per CPU"):
                    be.collect()
                if reader:
                    assert pieces[-1] == 24, pieces
                else:
                    assert streamed[-1] == 20 * 4096
                continue
            hits = be.collect()
        finally:
            be.close()
        if reader:
            assert streamed == [] and pieces and pieces[0] >= 20, (streamed, pieces)
        else:
            assert streamed and streamed[0] >= 16 * 4096 and pieces == [], streamed
        # each of the loop's opens once, in order of time (a page lost or read twice shows)
        mine = [h for h in hits if dict(h.args).get("path") == '"/proc/version"']
        assert len(mine) == 5000 and len({h.pid for h in mine}) == 1, len(mine)
        print(f"measured: {len(hits)} hits, " + (f"{pieces[0]} pages through kph-reader"
                                                  if reader else
                                                  f"{streamed[0] // 4096} pages through the "
                                                  "data port"))


def test_a_format_read_that_failed_is_raised_not_taken_for_an_event_gone(vm, monkeypatch):
    """register() reads the events' formats through the agent's file API: only a format
    that is not there means the event is not (freed by a later ``-:`` line); any other
    failed read (qemu-ga out of descriptors) is raised, never a probe left out of the
    comparison."""
    from harness.errors import GuestAgentError

    real = vm.pull_many

    def failing(paths, **kw):
        return [GuestAgentError(f"guest-file-open: failed to open file '{p}' (mode: 'r'): "
                                "Too many open files") if p.endswith("/format") else g
                for p, g in zip(paths, real(paths, **kw))]

    be = EventsBackend(vm)
    try:
        monkeypatch.setattr(vm, "pull_many", failing)
        with pytest.raises(GuestAgentError, match="Too many open files"):
            be.register([parse(OPEN)])
    finally:
        monkeypatch.undo()
        be.close()
    # the event the failed registration added is the backend's, and went with it
    assert vm.run("cat /sys/kernel/tracing/kprobe_events").stdout == ""
    be = EventsBackend(vm)
    try:
        out = be.register([parse("p:kph/gone do_sys_openat2"), parse("-:kph/gone")])
        assert [o.accepted for o in out] == [True, True] and "kph/gone" not in be.specs
    finally:
        be.close()


def test_a_full_module_buffer_fails_the_run(vm):
    vm.run("rmmod kph_kprobes 2>/dev/null; true")
    be = ModuleBackend(vm, bufsize=4096)
    try:
        be.register([parse(OPEN)])
        be.enable()
        vm.run(OPENS.format(n=300), timeout=120)
        be.disable()
        with pytest.raises(GuestLossError, match=r"dropped \d+ record\(s\): its buffer "
                                                 r"\(4096 bytes\) was full") as ei:
            be.collect()
        assert ei.value.side == "module" and ei.value.count > 0
        print(f"measured: {ei.value}")
    finally:
        be.close()


@pytest.mark.parametrize("guest", ["module", "events"])
def test_kph_diff_past_its_guest_buffer_names_the_size_that_then_holds_the_run(guest):
    """``kph diff --guest-buffer 1`` under 40,000 vfs_read hits of two arguments (~4 MB of
    the module's records, 104 bytes each; ~1.4 MB of the events side's ring buffer, 36
    bytes each): not compared, exit 2, one line naming the size; the same run with that
    size is compared, equivalent."""
    argv = ("diff", "--guest", guest, "--host", "plugin", "-q",
            "p:kph/rd vfs_read count=%dx:u64 buf=%si:x64",
            "--run", "dd if=/dev/zero of=/dev/null bs=1 count=40000 2>/dev/null")
    small = kph(*argv, "--guest-buffer", "1")
    assert small.returncode == 2, small.stdout[-2000:] + small.stderr[-2000:]
    line = small.stderr.strip().splitlines()[-1]
    m = re.search(r"the run is not compared; a guest buffer of (\d+) MiB would hold it "
                  r"\(kph diff --guest-buffer (\d+)\)$", line)
    assert m and m[1] == m[2] and int(m[1]) > 1, small.stderr
    print(f"measured: {line}")
    big = kph(*argv, "--guest-buffer", m[1])
    assert big.returncode == 0, big.stdout[-2000:] + big.stderr[-2000:]


def test_a_big_module_drain_comes_whole_in_one_reader_request(vm, monkeypatch):
    """The module's drain of 3,000 opens (``records``: its buffer's bytes, ~100 a record)
    comes raw through kph-reader with the stats after it, one request: every one of the
    loop's opens, once."""
    asked: list[list[str]] = []
    real = vm._reader_files

    def spy(paths, timeout):
        asked.append(list(paths))
        return real(paths, timeout)

    monkeypatch.setattr(vm, "_reader_files", spy)
    vm.run("rmmod kph_kprobes 2>/dev/null; true")
    be = ModuleBackend(vm)
    try:
        be.register([parse(OPEN)])
        be.enable()
        vm.run("taskset 1 sh -c '" + OPENS.format(n=3000) + "'", timeout=300)
        be.disable()
        asked.clear()
        hits = be.collect()
        drained = list(asked)
    finally:
        be.close()
    assert drained == [["/sys/kernel/debug/kph/records", "/sys/kernel/debug/kph/stats"]], drained
    mine = [h for h in hits if dict(h.args).get("path") == '"/proc/version"']
    assert len(mine) == 3000 and len({h.pid for h in mine}) == 1, len(mine)
    print(f"measured: {len(hits)} hits in one drain")


def test_counters_of_two_groups_sharing_an_event_name_stay_apart(vm):
    """kprobe_profile prints ``x`` twice; the counters are g1/x's and g2/x's (through
    dynamic_events' order), not one sum under a bare name."""
    be = EventsBackend(vm)
    try:
        be.register([parse("p:g1/x do_sys_openat2"), parse("p:g2/x do_sys_openat2+5"),
                     parse("p:g2/y do_sys_openat2")])
        be.enable()
        vm.run(OPENS.format(n=5), timeout=60)
        be.disable()
        hits = be.collect()
        c = be.counters()
    finally:
        be.close()
    assert set(c) == {"g1/x", "g2/x", "g2/y"}, c
    for name in c:
        mine = [h for h in hits if h.probe == name]
        assert c[name].nhit >= len(mine) >= 5, (name, c[name], len(mine))


HOT = "dd if=/dev/zero of=/dev/null bs=1 count=40000 2>/dev/null"


def _held_drain(vm: Machine, seconds: float) -> list[float]:
    """Hold the plugin's drain back once, for ``seconds``, as soon as its ring (vCPU 0)
    holds 64 KiB: both the drain thread and the decoding's takes wait on the link's
    record lock, as they would behind a host too busy to run them. The list gets the
    hold's start."""
    link, held = vm.host.link, []
    real = link.drain

    def drain() -> None:
        ring = link.ring
        if not held and ring._heads[0].value - ring._tails[0].value > 64 << 10:
            held.append(time.monotonic())
            with link._rec_lock:
                time.sleep(seconds)
        real()
    link.drain = drain
    return held


def test_a_plugin_ring_outrun_while_its_drain_is_held_names_the_ring_that_holds_the_run(
        default_image):
    """40,000 vfs_read hits with the plugin's drain held back for 0.5 s: a ring of 1 MiB
    per vCPU fills, the records that found it full are dropped and the run is not compared
    (PluginRecordError, its count and the ring that would have held them); the same run
    with that ring, the drain held back alike, is compared: equivalent."""
    spec = parse("p:kph/rd vfs_read count=%dx:u64")
    with Machine.boot(default_image, host="plugin") as vm:
        vm.plugin_ring_mib = 1
        assert vm.host.link.ring.size == 1 << 20
        held = _held_drain(vm, 0.5)
        with pytest.raises(PluginRecordError) as err:
            run_differential(vm, [spec], HOT, guest="events", timeout=300)
    assert held, "the ring never held 64 KiB"
    exc = err.value
    print(f"measured: {exc}")
    assert exc.counts.get("dropped (ring full)", 0) > 0, exc.counts
    assert exc.ring_mib > 1 and str(exc).endswith(
        f"a ring of {exc.ring_mib} MiB per vCPU would have held them "
        f"(kph diff --host-buffer {exc.ring_mib})"), exc
    with Machine.boot(default_image, host="plugin") as vm:
        vm.plugin_ring_mib = exc.ring_mib
        held = _held_drain(vm, 0.5)
        runs = run_differential(vm, [spec], HOT, guest="events", timeout=300)
    assert held
    res = compare(*runs)
    assert res.equivalent and len(runs[0].hits) >= 40000, res.verdict_word


def test_kph_diff_host_buffer_sizes_the_plugin_engine_s_ring(default_image):
    """``--host-buffer 2`` as kph diff parses it: the machine the verb boots gives its
    plugin engine a ring of 2 MiB per vCPU; without it, the default 16 MiB."""
    for argv, mib in ((["--host-buffer", "2"], 2), ([], 16)):
        args = make_parser().parse_args(["diff", "--host", "plugin", *argv, "p:a vfs_read",
                                         "--run", "true"])
        with machine(args) as vm:
            assert vm.host.link.ring.size == mib << 20, (argv, vm.host.link.ring.size)
