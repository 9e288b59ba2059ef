"""``f`` lines (fprobe events) as 6.12's and 7.3's ``kernel/trace/trace_fprobe.c`` parse
them: the parser alone, no guest (tests/vm/test_selftests_newer.py runs the same kinds of
line against each booted kernel's own error_log)."""
from __future__ import annotations

import errno

import pytest

from harness.backends.tracelayer import FGRAPH_INSTANCES, fprobe_matches, fprobe_pool
from harness.errors import ProbeSpecError
from harness.kernel.dynevent import EventTable
from harness.kernel.grammar import KernelView, format, guest_line, kernel_format, parse
from harness.kernel.grammar.fprobe import fprobe_event_name
from harness.kernel.rules import rules_for

NEWER = ("6.12", "7.3")


def _parse(line: str, series: str):
    return parse(line, kernel=KernelView(rules_for(series)))


def _refusal(line: str, series: str) -> tuple[str, int, int]:
    with pytest.raises(ProbeSpecError) as exc:
        _parse(line, series)
    return str(exc.value), exc.value.column, exc.value.errno


@pytest.mark.parametrize("series", NEWER)
@pytest.mark.parametrize("line,shown", [
    ("f:myevent1 kernel_clone", "f:fprobes/myevent1 kernel_clone"),
    ("f:myevent2 kernel_clone%return", "f:fprobes/myevent2 kernel_clone%return"),
    # $retval makes it an exit probe, and the kernel shows %return
    ("f kernel_clone $retval", "f:fprobes/kernel_clone__exit kernel_clone%return arg1=$retval"),
    ("f vfs_rea*", "f:fprobes/vfs_rea___entry vfs_rea*"),
    ("f:tests/myevent2 vfs_open%return arg=$arg1",
     "f:tests/myevent2 vfs_open%return arg=$arg1"),
    ("f:z kernel_clone $stack0 $comm", "f:fprobes/z kernel_clone arg1=$stack0 arg2=$comm"),
])
def test_accepted_lines_show_as_dynamic_events_does(series, line, shown):
    spec = _parse(line, series)
    assert spec.is_fprobe and kernel_format(spec) == shown
    assert spec.is_return == ("%return" in shown)
    assert format(spec) == line                 # written back as written


@pytest.mark.parametrize("series", NEWER)
def test_the_guest_gets_the_event_name_the_harness_expects(series):
    spec = _parse("f kernel_clone $arg1", series)
    assert guest_line(spec) == "f:fprobes/kernel_clone__entry kernel_clone $arg1"
    # a name the kernel makes but would refuse if written: the line goes as written
    spec = _parse("f vfs_read+10", series)
    assert spec.event == "vfs_read+10__entry" and guest_line(spec) == "f vfs_read+10"


def test_event_names_are_sanitized_as_the_kernel_does():
    """sanitize_event_name() (kernel/trace/trace.h): ':', '.' and '*' after the first."""
    assert fprobe_event_name("vfs_rea*", False) == "vfs_rea___entry"
    assert fprobe_event_name("foo.isra.0", True) == "foo_isra_0__exit"
    assert len(fprobe_event_name("x" * 80, False)) == 63


def test_maxactive_is_6_12s_alone():
    """6.12 keeps a rethook pool for exits (f[N]); 7.3's function-graph exits have none."""
    assert _parse("f3:x kernel_clone%return", "6.12").maxactive == 3
    assert kernel_format(_parse("f3:x kernel_clone%return", "6.12")) == \
        "f3:fprobes/x kernel_clone%return"
    assert _refusal("f3:y kernel_clone", "6.12") == \
        ("Maxactive is only for function exit", 1, errno.EINVAL)
    assert _refusal("f^1a111 vfs_read".replace("^", ""), "6.12")[:2] == \
        ("Invalid maxactive number", 1)
    assert _refusal("f100000 vfs_read%return", "6.12")[:2] == ("Maxactive is too big", 1)
    assert _refusal("f3:x kernel_clone%return", "7.3")[:2] == ("Invalid maxactive number", 1)
    # 6.12 ignores what stands between 'f' and ':' unless it is a digit; 7.3 does not
    assert _parse("fx:w kernel_clone", "6.12").event == "w"
    assert _refusal("fx:w kernel_clone", "7.3")[:2] == ("Invalid maxactive number", 1)


@pytest.mark.parametrize("series,msg", [("6.12", "Invalid fetch argument"),
                                        ("7.3", "Invalid $-variable specified")])
def test_registers_are_refused(series, msg):
    """parse_probe_arg(): "eprobe and fprobe do not handle registers"; 6.12 logs
    BAD_VAR then BAD_FETCH_ARG (the last entry is the one shown), 7.3 BAD_VAR."""
    assert _refusal("f vfs_read %ax", series) == (msg, 11, errno.EINVAL)


@pytest.mark.parametrize("series", NEWER)
def test_other_refusals(series):
    assert _refusal("f vfs_read%hoge", series)[:2] == ("Invalid probed address suffix", 10)
    assert _refusal("f:foo/bar.1 vfs_read", series)[1] == 6


def test_entry_arguments_must_fit_the_fprobe_data():
    """7.3's trace_fprobe_create_internal(): the entry data of a return fprobe (8 bytes per
    distinct argument saved at entry) over MAX_FPROBE_DATA_SIZE (15 words) is
    TOO_MANY_EARGS at the first argument, E2BIG; 6.12's rethook takes any size."""
    args = lambda n: " ".join(f"$arg{i}" for i in range(1, n + 1))  # noqa: E731
    line = "f:g/e vfs_read%return "
    assert len(_parse(line + args(15), "7.3").args) == 15
    assert _refusal(line + args(16), "7.3") == \
        ("Too many entry arguments specified", len(line), errno.E2BIG)
    assert len(_parse(line + args(16), "6.12").args) == 16
    # the same argument is saved once
    assert len(_parse(line + " ".join(f"$arg{i % 3 + 1}" for i in range(40)), "7.3").args) == 40
    # an entry probe saves nothing
    assert len(_parse("f:g/e vfs_read " + args(16), "7.3").args) == 16


def test_6_1_has_no_fprobe_events():
    with pytest.raises(ProbeSpecError, match="Unknown probe type"):
        parse("f:x kernel_clone")


@pytest.mark.parametrize("series", NEWER)
def test_event_probes_parse_and_6_1_keeps_them_unmirrored(series):
    assert _parse("e:x syscalls/sys_enter_openat", series).is_eprobe
    with pytest.raises(ProbeSpecError):     # 6.1 has no fprobe/eprobe grammar host-side
        _parse("e:x syscalls/sys_enter_openat", "6.1")


def test_filters_match_as_ftrace_does():
    funcs = [(0x10, "vfs_read"), (0x20, "vfs_readv"), (0x30, "do_sys_open"),
             (0x40, "vfs_read"), (0x50, "vfs_readlink")]
    assert fprobe_matches("vfs_read", funcs) == [(0x10, "vfs_read"), (0x40, "vfs_read")]
    assert [a for a, _ in fprobe_matches("vfs_rea*", funcs)] == [0x10, 0x20, 0x40, 0x50]
    assert [a for a, _ in fprobe_matches("*open", funcs)] == [0x30]
    assert fprobe_matches("vfs_read+10", funcs) == []
    assert fprobe_matches("vmlinux:vfs_read", funcs) == []


def test_exit_pools():
    """fprobe_init_rethook() (6.12): N of f[N], else 2 * possible CPUs per location;
    7.3 has no pool."""
    r612, r73 = rules_for("6.12"), rules_for("7.3")
    assert fprobe_pool(r612, _parse("f kernel_clone", "6.12"), 1, 1) == 0
    assert fprobe_pool(r612, _parse("f vfs_rea*%return", "6.12"), 4, 2) == 16
    assert fprobe_pool(r612, _parse("f7:x vfs_read%return", "6.12"), 4, 2) == 7
    assert fprobe_pool(r73, _parse("f vfs_read%return", "7.3"), 1, 1) == FGRAPH_INSTANCES


def test_an_fprobe_joins_only_an_fprobe_event():
    """find_trace_fprobe(): a kprobe event of the same name is EVENT_EXIST, another
    fprobe of it appends (or is refused as the kernel's append_trace_fprobe() says)."""
    t = EventTable()
    t.add(_parse("p:fprobes/ev kernel_clone", "6.12"))
    assert t.check(_parse("f:fprobes/ev kernel_clone", "6.12")).message.startswith(
        "Given group/event name is already used")
    t = EventTable()
    t.add(_parse("f:fprobes/ev kernel_clone", "6.12"))
    assert t.check(_parse("f:fprobes/ev do_exit", "6.12")) is None
    assert t.check(_parse("f:fprobes/ev do_exit%return", "6.12")).message == \
        "Probe type is different from existing probe"
    assert t.check(_parse("f:fprobes/ev kernel_clone", "6.12")).message == \
        "There is already the exact same probe event"


# ---------------------------------------------------------------- tracepoint probes (t:)

@pytest.mark.parametrize("series", NEWER)
@pytest.mark.parametrize("line,shown", [
    ("t:myevent1 kfree", "t:tracepoints/myevent1 kfree"),
    ("t kfree $arg1 $stack0", "t:tracepoints/kfree kfree arg1=$arg1 arg2=$stack0"),
    ("t 3tp", "t:tracepoints/_3tp 3tp"),
])
def test_tracepoint_probes_show_as_dynamic_events_does(series, line, shown):
    spec = _parse(line, series)
    assert spec.is_tprobe and spec.is_fprobe and not spec.is_return
    assert kernel_format(spec) == shown and format(spec) == line


@pytest.mark.parametrize("series", NEWER)
def test_a_tracepoint_probes_first_argument_is_its_stubs_second(series):
    """The stub is ``__probestub_TP(void *__data, proto)``: ``$arg1`` reads the second
    register (TPARG_FL_TPOINT: ``code->param++``)."""
    spec = _parse("t kfree $arg1 $arg2", series)
    assert [a.code[0] for a in spec.args] == [("arg", 1), ("arg", 2)]
    assert [a.code[0] for a in _parse("f kfree $arg1", series).args] == [("arg", 0)]


@pytest.mark.parametrize("series", NEWER)
@pytest.mark.parametrize("line,msg,col", [
    ("t kmem/kfree", "Invalid character in tracepoint name", 6),
    ("t kfree $retval", "$retval is not available on probe", 8),
    ("t kfree%return", "Invalid probed address suffix", 7),
])
def test_tracepoint_probe_refusals(series, line, msg, col):
    assert _refusal(line, series) == (msg, col, errno.EINVAL)


def test_maxactive_on_a_tracepoint_probe():
    assert _refusal("t3:x kfree", "6.12")[:2] == ("Maxactive is only for function exit", 1)
    assert _refusal("t3:x kfree", "7.3")[:2] == ("Invalid maxactive number", 1)


def test_a_tracepoint_probe_is_another_type_for_an_fprobe_event():
    t = EventTable()
    t.add(_parse("t:tracepoints/ev kfree", "6.12"))
    assert t.check(_parse("f:tracepoints/ev kfree", "6.12")).message == \
        "Probe type is different from existing probe"


def test_ftrace_files_are_read_once_per_snapshot_and_set_of_modules():
    """Machines restored from one snapshot have the same ftrace locations: the first
    reads available_filter_functions, the next takes it (a read costs 0.4-0.7 s through
    the agent); other loaded modules, a cold boot or another snapshot read it again."""
    from types import SimpleNamespace

    from harness.backends import tracelayer

    reads, kept = [], {}

    class VM:
        def __init__(self, mode, snap):
            self.start_mode, self.snapshot = mode, SimpleNamespace(dir=snap)

        def pull_many(self, paths, timeout):
            reads.append(paths)
            return [b"vfs_read\ndo_sys_openat2 [kph]\n" for _ in paths]

        def kept(self, kind, state):        # harness.vmctl.Machine.kept, in memory
            return kept.get((self.snapshot.dir, kind, state))

        def keep(self, kind, state, data):
            kept[(self.snapshot.dir, kind, state)] = data

    none, kph = frozenset(), frozenset({"kph"})
    a, b = VM("snapshot", "/c/snap1"), VM("snapshot", "/c/snap1")
    assert tracelayer.filter_functions(a, none) == {"vfs_read", "do_sys_openat2"}
    assert tracelayer.filter_functions(b, none) and len(reads) == 1
    tracelayer.filter_functions(b, kph)                 # a module loaded since
    tracelayer.filter_functions(VM("snapshot", "/c/snap2"), none)
    tracelayer.filter_functions(VM("cold", "/c/snap1"), none)
    assert len(reads) == 4
    # a later process: its in-process cache is empty, what a machine kept is not
    tracelayer._SNAPSHOT_FTRACE_FILES.clear()
    assert tracelayer.filter_functions(VM("snapshot", "/c/snap1"), kph) == \
        {"vfs_read", "do_sys_openat2"}
    assert len(reads) == 4


def test_dentry_offsets_are_worked_out_when_a_line_first_has_pd():
    """A kernel view's %pd/%pD offsets may be a function (BTF's type index is built only
    when a line needs them): not called for a line without one, called for one with it,
    its offsets the ones the expansion uses (traceprobe_expand_dentry_args())."""
    calls = []

    def offsets():
        calls.append(1)
        return (0x30, 0x50)
    view = KernelView(rules_for("6.12"), dentry_offsets=offsets)
    parse("p:a vfs_read x=%di:u64", kernel=view)
    assert calls == []
    spec = parse("p:b vfs_read f=%di:%pD", kernel=view)
    assert calls == [1]
    assert format(spec).endswith("f=+0x0(+0x30(+0x50(%di))):string"), format(spec)


def test_the_filter_function_names_are_made_once_per_list_of_lines(monkeypatch):
    """tracelayer.filter_functions: the names of available_filter_functions made once
    for the lines the machine's cache holds, again when they were read again."""
    from harness.backends import tracelayer

    class Vm:
        pass

    reads = [["vfs_read", "kph_mod_fn [kph_kprobes]"]]
    monkeypatch.setattr(tracelayer, "_ftrace_file", lambda vm, name, modules, fix: reads[-1])
    vm = Vm()
    first = tracelayer.filter_functions(vm, frozenset())
    assert first == {"vfs_read", "kph_mod_fn"}
    assert tracelayer.filter_functions(vm, frozenset()) is first
    reads.append(["vfs_write"])             # read again (modules changed)
    assert tracelayer.filter_functions(vm, frozenset({"m"})) == {"vfs_write"}


def test_an_f_glob_s_sites_are_read_in_clusters_of_near_sites():
    """PluginEngine.prefetch_text's clusters: sites under PREFETCH_GAP apart share one,
    each covers 16 bytes before its first site (the ENDBR of a symbol whose site is at
    +4) to TEXT_READ bytes past its last, and counts its sites."""
    from harness.engines.plugin_engine import PREFETCH_GAP, TEXT_READ, _clusters
    base = 0xffffffff81000000
    sites = [base, base + 0x40, base + PREFETCH_GAP - 1 + 0x40,
             base + 3 * PREFETCH_GAP, base + 3 * PREFETCH_GAP + 8]
    assert list(_clusters(sites)) == [
        (base - 16, base + PREFETCH_GAP - 1 + 0x40 + TEXT_READ, 3),
        (base + 3 * PREFETCH_GAP - 16, base + 3 * PREFETCH_GAP + 8 + TEXT_READ, 2)]
    assert list(_clusters([base])) == [(base - 16, base + TEXT_READ, 1)]
    assert list(_clusters([])) == []
    # exactly PREFETCH_GAP apart: two clusters
    assert [n for _, _, n in _clusters([base, base + PREFETCH_GAP])] == [1, 1]
