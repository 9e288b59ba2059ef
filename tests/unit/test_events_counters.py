"""harness.backends.events: nhit and nmissed over the recording window, from the words
read at its two edges (probes_profile_seq_show(): nhit the per-cpu sum, nmissed
rp.kp.nmissed plus rp.nmissed for a return probe), the profile's otherwise."""
from __future__ import annotations

import pytest

from harness.backends.events import EventsBackend
from harness.kernel.grammar import parse

PROFILE = """p:kprobes/kf kfree
r16:kprobes/kfr kfree
p:kprobes/old vfs_read
@k
  kf                                                          40              7
  kfr                                                         30              9
  old                                                         11              4
@u
"""


def _backend(ptrs, marks):
    be = object.__new__(EventsBackend)
    be.specs = {"kprobes/kf": parse("p:kf kfree"), "kprobes/kfr": parse("r16:kfr kfree"),
                "kprobes/old": parse("p:old vfs_read")}
    be._nhit_ptrs, be._nhit_marks = ptrs, []
    be._sh = lambda *a, **k: PROFILE
    for m in marks:
        be.add_nhit_mark(m)
    return be


def test_nhit_and_nmissed_are_the_window_s_where_their_words_were_read():
    ptrs = [("kprobes/kf", "nhit", 0x10), ("kprobes/kf", "nhit", 0x18),
            ("kprobes/kf", "nmissed", 0x20),
            ("kprobes/kfr", "nhit", 0x30), ("kprobes/kfr", "nmissed", 0x38),
            ("kprobes/kfr", "nmissed", 0x40)]
    be = _backend(ptrs, [[10, 20, 3, 5, 1, 0], [15, 22, 3, 9, 2, 4]])
    c = be.counters(window=True)
    assert (c["kprobes/kf"].nhit, c["kprobes/kf"].nmissed, c["kprobes/kf"].window) == (7, 0, True)
    assert (c["kprobes/kfr"].nhit, c["kprobes/kfr"].nmissed) == (4, 5)   # both misses summed
    # an event none of whose words were read keeps the profile's counts, not windowed
    assert (c["kprobes/old"].nhit, c["kprobes/old"].nmissed, c["kprobes/old"].window) == \
        (11, 4, False)
    # not asked for the window: the profile's, from the enabling
    c = be.counters()
    assert (c["kprobes/kf"].nhit, c["kprobes/kf"].nmissed, c["kprobes/kf"].window) == (40, 7, False)


def test_without_its_nmissed_words_an_event_keeps_the_profile_s_nmissed():
    """A kernel whose BTF lacks the nmissed members: nhit over the window, nmissed as
    kprobe_profile prints it (never a windowed 0 that was not measured)."""
    be = _backend([("kprobes/kf", "nhit", 0x10)], [[10], [12]])
    c = be.counters(window=True)["kprobes/kf"]
    assert (c.nhit, c.nmissed, c.window) == (2, 7, True)
    # an edge not read: nothing is windowed
    be = _backend([("kprobes/kf", "nhit", 0x10)], [[10], None])
    c = be.counters(window=True)["kprobes/kf"]
    assert (c.nhit, c.nmissed, c.window) == (40, 7, False)


def test_the_run_s_end_is_read_without_a_guest_process():
    """collect() reads the stats, saved_cmdlines, dynamic_events, both profiles and the
    preemption model through the agent's file API (issue 39: no fork and exec each);
    counters() and the comm lookup use them. A file the kernel may lack is left out; any
    other failed read fails the run."""
    import pytest
    from types import SimpleNamespace
    from harness.errors import GuestAgentError
    dyn, rest = PROFILE.split("@k\n")
    files = {"/sys/kernel/tracing/per_cpu/cpu0/stats": b"entries: 3\noverrun: 0\n",
             "/sys/kernel/tracing/saved_cmdlines": b"12 sh\n77 x y\n",
             "/sys/kernel/tracing/dynamic_events": dyn.encode(),
             "/sys/kernel/tracing/kprobe_profile": rest.split("@u\n")[0].encode()}
    def pull_many(paths, **kw):
        return [files[p] if p in files else
                GuestAgentError("guest-file-open: No such file or directory") for p in paths]
    be = _backend([], [])
    be.vm = SimpleNamespace(pull_many=pull_many, run=None)     # no guest command at all
    be._sh = None
    be._after = be._read_after([0])
    assert be._stats([0]) == {0: {"entries": 3, "overrun": 0}}
    assert be._cmdlines() == {12: "sh", 77: "x y"}
    c = be.counters()
    assert (c["kprobes/kf"].nhit, c["kprobes/kfr"].nmissed) == (40, 9)
    assert be.after_text("preempt") is None and be.after_text("uprobe_profile") is None
    del files["/sys/kernel/tracing/kprobe_profile"]
    with pytest.raises(GuestAgentError):
        be._read_after([0])


class _PipeAgent:
    """trace_pipe_raw through qemu-ga: a queue of pages, a read of an empty buffer EAGAIN;
    ``late`` pages arrive after the first empty read (written while the drain ran)."""

    def __init__(self, pages, late=()):
        self.pages, self.late, self.trips, self.closed = list(pages), list(late), 0, False

    def execute(self, cmd, args=None, **kw):
        return self.pipeline([(cmd, args)])[0]

    def pipeline(self, reqs, **kw):
        import base64
        from harness.errors import GuestAgentError
        self.trips += 1
        out = []
        for cmd, args in reqs:
            if cmd == "guest-file-open":
                out.append(8 if args["path"].endswith("/stats") else 7)
                continue
            if cmd == "guest-file-close":
                self.closed |= args["handle"] == 7
                out.append({})
                continue
            assert cmd == "guest-file-read" and args["count"] == 4096
            if args["handle"] == 8:     # what is left, at most BUF_PAGE_SIZE bytes a page
                text = f"entries: {len(self.pages)}\nbytes: {4080 * len(self.pages)}\n"
                out.append({"count": len(text), "buf-b64": base64.b64encode(text.encode()).decode()})
                continue
            if not self.pages:
                out.append(GuestAgentError("guest-file-read: failed to read file: Resource "
                                           "temporarily unavailable"))
                self.pages, self.late = self.late, []
                continue
            p = self.pages.pop(0)
            out.append({"count": len(p), "buf-b64": base64.b64encode(p).decode()})
        return out


class _PortVM:
    """A machine with a data port: ``dd`` of ``count=N`` pages takes them off the agent's
    queue."""

    has_data_port = True

    def __init__(self, agent):
        self.agent, self.streams = agent, []

    def read_stream(self, cmd, size, **kw):
        import re
        n = int(re.search(r"count=(\d+)", cmd)[1])
        assert size == n * 4096 and "trace_pipe_raw" in cmd
        self.streams.append(n)
        taken, self.agent.pages = self.agent.pages[:n], self.agent.pages[n:]
        return b"".join(taken)


@pytest.mark.parametrize("n,streamed", [(4, []), (20, []), (21, [16]), (300, [294])])
def test_past_the_first_window_the_pages_left_come_through_the_data_port(n, streamed):
    pages = [bytes([i % 256]) * 4096 for i in range(n)]
    ag = _PipeAgent(pages)
    be = _backend([], [])
    be.vm, be.max_pages = _PortVM(ag), 1000
    assert be._raw_pages(0) == (pages, True) and ag.closed
    assert be.vm.streams == streamed and ag.pages == []


def test_the_data_port_takes_no_more_than_max_pages():
    pages = [bytes([i]) * 4096 for i in range(100)]
    ag = _PipeAgent(pages)
    be = _backend([], [])
    be.vm, be.max_pages = _PortVM(ag), 30
    assert be._raw_pages(0) == (pages[:30], False)
    assert be.vm.streams == [26] and len(ag.pages) == 70


@pytest.mark.parametrize("n", [0, 1, 4, 5, 131])
def test_the_ring_buffer_drain_reads_every_page_in_order_in_few_round_trips(n):
    from types import SimpleNamespace
    pages = [bytes([i % 256]) * 4096 for i in range(n)]
    ag = _PipeAgent(pages)
    be = _backend([], [])
    be.vm, be.max_pages = SimpleNamespace(agent=ag), 1000
    assert be._raw_pages(0) == (pages, True) and ag.closed
    assert ag.trips <= 2 + 6          # open, close, windows of 4, 8, 16, 32, 64, 64
    assert ag.pages == []


def test_pages_written_after_an_empty_read_of_a_window_are_kept_in_order():
    from types import SimpleNamespace
    first, late = [b"a" * 4096, b"b" * 4096], [b"c" * 4096]
    ag = _PipeAgent(first, late)
    be = _backend([], [])
    be.vm, be.max_pages = SimpleNamespace(agent=ag), 1000
    assert be._raw_pages(0) == (first + late, True)


def test_the_drain_stops_at_max_pages_and_says_the_buffer_was_not_empty():
    from types import SimpleNamespace
    pages = [bytes([i]) * 4096 for i in range(20)]
    ag = _PipeAgent(pages)
    be = _backend([], [])
    be.vm, be.max_pages = SimpleNamespace(agent=ag), 10
    assert be._raw_pages(0) == (pages[:10], False) and ag.closed and len(ag.pages) == 10
