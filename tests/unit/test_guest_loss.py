"""Losses of the in-guest sides fail a run with their count (issue 36): the ring buffer's
own accounting (per_cpu/cpuN/stats, the page header's missed-events flag and stored count,
kernel/trace/ring_buffer.c: ring_buffer_read_page(); trace.c: tracing_stats_read()), a
drain that stopped before the buffer was empty, and the module's dropped counter."""
import pickle
import struct
import types

import pytest

from harness.backends.events import EventsBackend
from harness.backends.module import ModuleBackend, ModuleError, buffer_stats
from harness.errors import GuestLossError, PluginRecordError, needed_mib, ring_mib
from harness.kernel.ringbuf import page_missed, parse_page, parse_stats, ring_loss

# per_cpu/cpu1/stats as 6.1 prints it after a run that overflowed a 4 KiB buffer
STATS = """entries: 0
overrun: 1187
commit overrun: 0
bytes: 0
oldest event ts:   163.413357
now ts:   165.260581
dropped events: 0
read events: 203
"""


def page(body=b"", flags=0, stored=None):
    commit = len(body) | flags
    data = body + (struct.pack("<Q", stored) if stored is not None else b"")
    return (struct.pack("<QQ", 1000, commit) + data).ljust(4096, b"\0")


def test_stats_lines():
    st = parse_stats(STATS)
    assert st["overrun"] == 1187 and st["commit overrun"] == 0 and st["dropped events"] == 0
    assert st["entries"] == 0 and st["read events"] == 203 and "now ts" not in st


def test_the_page_header_says_what_was_missed():
    assert page_missed(page(b"\0" * 8)) is None
    assert page_missed(page(b"\0" * 8, flags=1 << 31)) == 0              # no room stored
    assert page_missed(page(b"\0" * 8, flags=3 << 30, stored=42)) == 42  # data[commit]
    # the flag bits do not leak into the records' length
    recs, missed = parse_page(page(b"", flags=3 << 30, stored=7), cpu=0)
    assert recs == [] and missed is True


def test_ring_loss_takes_the_larger_of_the_two_sources():
    st = parse_stats(STATS)
    loss = ring_loss(1, st, [page(flags=3 << 30, stored=5), page()])
    assert loss.count == 1187 and loss.flagged_pages == 1 and loss.stored == 5
    assert "per_cpu/cpu1/stats overrun 1187" in loss.describe()
    assert "RB_MISSED_EVENTS" in loss.describe()
    # a page flagged without a stored count is one event at least, stats or not
    assert ring_loss(0, {}, [page(flags=1 << 31)]).count == 1
    assert ring_loss(0, parse_stats(STATS.replace("1187", "0")), [page()]).count == 0


def _events():
    be = object.__new__(EventsBackend)
    be.side, be.buffer_kb, be.max_pages = "events", 4, 3
    return be


def test_events_losses_fail_the_run_with_the_count():
    be = _events()
    be.check_losses([ring_loss(0, {"overrun": 0}, [page()])], {})      # nothing lost
    with pytest.raises(GuestLossError) as ei:
        be.check_losses([ring_loss(0, {}, [page()]),
                         ring_loss(1, parse_stats(STATS), [page()])], {})
    e = ei.value
    assert (e.side, e.count) == ("events", 1187)
    assert "lost 1187 event(s)" in str(e) and "cpu1/stats overrun 1187" in str(e)
    assert "buffer_size_kb 4" in str(e) and "\n" not in str(e)


def test_a_loss_error_gives_the_buffer_that_would_hold_the_run():
    """The size is the lossy CPU's buffer scaled by what it lost over what it kept, a
    quarter more, in whole MiB (kph diff --guest-buffer's unit); no size without a count
    of what was kept."""
    be = _events()
    be.buffer_kb = 16384
    losses = [ring_loss(0, {}, [page()]), ring_loss(1, parse_stats(STATS), [page()])]
    with pytest.raises(GuestLossError) as ei:
        be.check_losses(losses, {}, {0: 50, 1: 1187})
    # cpu1: 16 MiB held 1,187, lost 1,187: 32 MiB, and a quarter: 40
    assert ei.value.needed_mib == 40
    assert str(ei.value).endswith("the run is not compared; a guest buffer of 40 MiB would "
                                  "hold it (kph diff --guest-buffer 40)")
    with pytest.raises(GuestLossError) as ei:
        be.check_losses(losses, {})
    assert ei.value.needed_mib == 0 and "--guest-buffer" not in str(ei.value)
    assert pickle.loads(pickle.dumps(ei.value)).args == ei.value.args


@pytest.mark.parametrize("size,dropped,rec,mib", [
    (1 << 20, 11_608, 240, 8), (16 << 20, 1, 240, 64), (4 << 20, 0, 240, 8),
    (1 << 20, 1, 240, 4), (512 << 20, 1, 240, 0), (256 << 20, 10, 240, 1024)])
def test_the_suggested_plugin_ring_holds_the_dropped_records_twice_over(size, dropped, rec,
                                                                          mib):
    """The ring that held ``size`` bytes, and the dropped records beside them, twice, as
    a power of two of MiB (the plugin takes no other); 0 past the plugin's 1 GiB."""
    assert ring_mib(size, dropped, rec) == mib


def test_a_plugin_record_error_names_the_ring_only_with_one_to_name():
    e = PluginRecordError("the plugin engine's records are incomplete: 5 dropped (ring "
                          "full); the run is not compared", {"dropped (ring full)": 5}, 8)
    assert str(e).endswith("; a ring of 8 MiB per vCPU would have held them (kph diff "
                           "--host-buffer 8)")
    back = pickle.loads(pickle.dumps(e))
    assert str(back) == str(e) and back.counts == e.counts and back.ring_mib == 8
    assert "--host-buffer" not in str(PluginRecordError("1 truncated", {"truncated": 1}))
    past = PluginRecordError("9 dropped", {"dropped (ring full)": 9}, 0)
    assert str(past).endswith("; no ring the plugin takes (1024 MiB per vCPU at most) would "
                              "have held them: fewer hits (a narrower probe or workload)")


@pytest.mark.parametrize("size,kept,lost,mib", [
    (4 << 20, 50_000, 50_000, 10), (1 << 20, 1000, 1, 2), (4096, 40, 260, 1),
    (16 << 20, 100, 0, 20), (4 << 20, 0, 5, 0), (0, 5, 5, 0)])
def test_the_suggested_buffer_scales_what_held_the_kept_records(size, kept, lost, mib):
    assert needed_mib(size, kept, lost) == mib


def test_a_drain_cut_short_fails_the_run():
    be = _events()
    with pytest.raises(GuestLossError, match=r"stopped at 3 page\(s\) per CPU with 12 event"):
        be.check_losses([ring_loss(0, {}, [page()])], {0: 12})


def test_collect_counts_a_truncated_drain(monkeypatch):
    """collect(): the drain stops at max_pages; the stats' entries name what is left."""
    be = _events()
    be._formats = {1: None}
    be._cpus = [0]
    be._stack_fmt = None
    be._raw_pages = lambda cpu: ([page()] * 3, False)
    be._read_after = lambda cpus: {"stats0": b"entries: 40\noverrun: 0\n"}
    with pytest.raises(GuestLossError) as ei:
        be.collect()
    assert ei.value.count == 40


MSTATS = ("recording 0\nbuffer size 4096 used 3960 records 33 dropped {d} seq 120\n"
          "error -\nprobe 1 p nhit 300 nmissed 0 nentry 0 npost 0 mode ftrace\n")


def test_module_buffer_stats():
    assert buffer_stats(MSTATS.format(d=7)) == {"size": 4096, "used": 3960, "records": 33,
                                                "dropped": 7, "seq": 120}
    with pytest.raises(ModuleError):
        buffer_stats("recording 0\n")


def test_module_drops_since_the_window_opened_fail_the_run():
    from types import SimpleNamespace
    be = object.__new__(ModuleBackend)
    be.side, be.timeout = "module", 10
    dropped = [5]
    be.vm = SimpleNamespace(pull=lambda path, **kw: MSTATS.format(d=dropped[0]).encode())
    be._dropped0 = 5
    be.check_dropped()                      # drops before the window are not the run's
    dropped[0] = 272
    with pytest.raises(GuestLossError) as ei:
        be.check_dropped()
    assert (ei.value.side, ei.value.count) == ("module", 267)
    assert "dropped 267 record(s)" in str(ei.value) and "4096 bytes" in str(ei.value)


# --------------------------------------------------------------- counters per GROUP/EVENT

from harness.backends.events import profile_counters  # noqa: E402

DYN = """p:g1/x do_sys_openat2
p:g2/x vfs_read
r16:g1/ret do_sys_openat2
f:fp/f kernel_clone
p:uprobes/u /bin/sh:0x0000000000001234
p:g1/x do_sys_openat2+5
"""
KPROF = """  x                                           12               1
  x                                           30               0
  ret                                          7               2
  x                                            3               0
"""
UPROF = "  /bin/sh u                                            4\n"


def test_profile_lines_are_keyed_by_group_through_dynamic_events():
    """kprobe_profile names the event only (probes_profile_seq_show(): trace_probe_name());
    dynamic_events lists the same dyn_event_list in the same order, with the group."""
    sums, unclear = profile_counters(DYN, KPROF, UPROF)
    assert sums == {"g1/x": [15, 1], "g2/x": [30, 0], "g1/ret": [7, 2], "uprobes/u": [4, 0]}
    assert unclear == {}
    assert "fp/f" not in sums            # an fprobe has no profile line: no counter


def test_a_shared_event_name_is_not_guessed_when_the_lists_differ():
    # the profile lost a line (an event freed between the reads): by name where one
    # group holds the name, not at all where two do
    sums, unclear = profile_counters(DYN, KPROF.splitlines(True)[0] + KPROF.splitlines(True)[2],
                                     UPROF)
    assert sums == {"g1/ret": [7, 2], "uprobes/u": [4, 0]}
    assert set(unclear) == {"g1/x", "g2/x"} and "share the event name" in unclear["g1/x"]


def test_module_counters_count_from_the_window_not_the_registration():
    """The module's kprobe counts nmissed from its registration; a miss while the harness
    set the run up (before enable()) is not the run's: counters() are the stats' counts
    less those read at enable()."""
    from harness.backends.module import _Placed
    from harness.records import Counters
    be = object.__new__(ModuleBackend)
    be.side = "module"
    text = [MSTATS.format(d=0).replace("nhit 300 nmissed 0", "nhit 40 nmissed 3")]
    be._read = lambda path: text[0]
    be.timeout = 30
    be.vm = types.SimpleNamespace(pull_many=lambda paths, **kw: [b"", text[0].encode()])
    be.hits, be.post_records, be._placed = [], [], {1: _Placed(1, "kprobes/k", None, 0, "p")}
    be._counts0 = {}
    assert be.counters()["kprobes/k"] == Counters("kprobes/k", 40, 3)      # no window yet
    be._recording_at = 1
    be.enable(recording=False)
    text[0] = MSTATS.format(d=0).replace("nhit 300 nmissed 0", "nhit 140 nmissed 3")
    c = be.counters()["kprobes/k"]
    assert (c.nhit, c.nmissed) == (100, 0)
    text[0] = MSTATS.format(d=0).replace("nhit 300 nmissed 0", "nhit 141 nmissed 5")
    assert be.counters()["kprobes/k"].nmissed == 2
