"""kph fuzz's pure parts: strategies, classes of findings, regression files."""
import pytest

from harness.apps import fuzz, fuzzdraw


def test_listing_is_deterministic_and_mostly_well_formed():
    pool = ["vfs_read", "do_sys_openat2", "kernel_clone"]
    a = fuzzdraw.list_examples(pool, examples=60, seed=11)
    assert a == fuzzdraw.list_examples(pool, examples=60, seed=11)
    assert a != fuzzdraw.list_examples(pool, examples=60, seed=12)
    from harness.errors import ProbeSpecError
    from harness.kernel.grammar import parse
    parsed = 0
    for ex in a:
        try:
            for ln in ex:
                parse(ln)
            parsed += 1
        except ProbeSpecError:
            pass
    assert parsed >= len(a) // 2, parsed


def test_signatures_blur_values_and_known_differences_are_listed():
    assert fuzz._shape("'0xffffff8134aa4a00' at 21") == "'S' at N"
    import re
    assert fuzz.KNOWN == ()   # below-sp reads, once known, are (unknown) host-side now


def test_regressions_round_trip(tmp_path):
    f = fuzz.Finding(("p vfs_read +u0($retval)",), "parse", "carets differ", "parse:x")
    p = fuzz.write_regression(f, tmp_path)
    assert fuzz.read_regressions(tmp_path) == [(p.name, ("p vfs_read +u0($retval)",))]


def test_each_kernel_s_grammar_is_drawn_from_its_own_rules():
    from harness.apps import fuzz
    from harness.kernel.rules import SERIES

    pool = ["vfs_read", "do_sys_openat2"]
    # several seeds: Hypothesis leans each run toward some choices, so one seed's 400
    # examples can hold no this_cpu_() at all (the draws are the same for a seed: 100 each
    # keep the test within its timeout beside a loaded suite)
    text = {k: " ".join(" ".join(ex) for seed in range(5, 15)
                        for ex in fuzzdraw.list_examples(pool, examples=100, seed=seed, rules=r))
            for k, r in SERIES.items()}
    assert "$current" in text["7.3"] and "this_cpu_" in text["7.3"]
    assert any(t in text["6.12"] for t in ("$arg*", "file->f_pos", "$arg1->f_flags"))
    # where a kernel lacks a construct it is drawn only as a defect, so far less often
    assert text["6.12"].count("$current") < text["7.3"].count("$current")
    assert text["6.1"].count("->") < text["6.12"].count("->")


def test_a_case_found_on_another_kernel_names_it(tmp_path):
    f = fuzz.Finding(("r do_sys_openat2 $retval:ustring",), "parse", "refused", "parse:y")
    p = fuzz.write_regression(f, tmp_path, kernel="6.12")
    q = fuzz.write_regression(fuzz.Finding(("p vfs_read",), "parse", "x", "parse:z"), tmp_path)
    assert fuzz.regression_kernel(p.name, tmp_path) == "6.12"
    assert fuzz.regression_kernel(q.name, tmp_path) is None


def test_the_same_seed_draws_the_same_examples_whatever_was_imported():
    """Hypothesis mixes the literals of every local module imported so far into its draws;
    the fuzzer's must not depend on them (importing harness.backends.module once changed
    what seed 5 drew, so a `kph fuzz --list` could differ from the run)."""
    import subprocess
    import sys

    code = ("import sys, json\n"
            "for m in sys.argv[1:]: __import__(m)\n"
            "from harness.apps import fuzzdraw\n"
            "print(json.dumps(fuzzdraw.list_examples(['vfs_read'], examples=150, seed=5)))\n")
    runs = [subprocess.run([sys.executable, "-c", code, *mods], capture_output=True,
                           text=True, check=True, timeout=120).stdout
            for mods in ((), ("harness.cli", "harness.backends.module", "harness.engines.plugin_engine"))]
    import json
    assert len(json.loads(runs[0])) == 150 and runs[0] == runs[1]


def test_examples_not_mirrored_are_counted_by_reason():
    """A count of examples the oracle could not judge comes with its reasons (a 6.12
    run once counted three it could not explain): a mutated head letter drawing 6.12's
    synthetic-event kind is one."""
    from types import SimpleNamespace

    from harness.apps.fuzz import FuzzStats, Oracle
    from harness.cli.fuzz import not_mirrored_why
    from harness.errors import NotMirroredError
    from harness.kernel.grammar import parse
    from harness.kernel.grammar.common import KernelView
    from harness.kernel.rules import rules_for

    holder = SimpleNamespace(stats=FuzzStats())
    for line in ("s:syn u64 x", "s:other kernel_clone"):
        with pytest.raises(NotMirroredError) as e:
            parse(line, kernel=KernelView(rules_for("6.12")))
        Oracle._not_mirrored(holder, e.value)
    Oracle._not_mirrored(holder, NotMirroredError("not mirrored by the plugin engine: btf"))
    st = holder.stats
    assert st.not_mirrored == 3
    assert st.not_mirrored_why == {
        "not mirrored host-side: synthetic events (s:) on 6.12": 2,
        "not mirrored by the plugin engine: btf": 1}
    assert not_mirrored_why([{"not_mirrored_why": st.not_mirrored_why},
                             {"not_mirrored_why": {"not mirrored by the plugin engine: btf": 2}}]) \
        == ("not mirrored by the plugin engine: btf: 3; "
            "not mirrored host-side: synthetic events (s:) on 6.12: 2")


def test_each_kind_is_drawn_with_what_only_other_kinds_take_and_uprobe_file_offsets():
    """The cross-kind constructs (fuzzdraw.FOREIGN: registers and stack slots on an event
    probe, registers on an fprobe, kernel symbols on a uprobe) and a uprobe's @+FOFFS are
    drawn, so a kernel accepting one where its parser must refuse is met by the fuzzer."""
    from harness.kernel.rules import SERIES

    pool = ["vfs_read", "do_sys_openat2"]
    exs = [ex for seed in range(4) for ex in
           fuzzdraw.list_examples(pool, examples=250, seed=seed, rules=SERIES["6.12"])]
    lines = [ln for ex in exs for ln in ex]
    eprobe = " ".join(ln for ln in lines if ln.startswith("e"))
    uprobe = " ".join(ln for ln in lines if "kph-loop" in ln)
    fprobe = " ".join(ln for ln in lines if ln.startswith("f"))
    import re
    assert re.search(r"\$stack|%(ax|di|sp)\b", eprobe)
    assert "@+0x" in uprobe and re.search(r"@(linux_proc_banner|jiffies)|\$arg1", uprobe)
    assert re.search(r"%(ax|di|sp)\b", fprobe)
    assert re.search(r"\$(filename|comm|parent_comm|child_comm):ustring", eprobe)


def test_a_refusal_s_reproducer_asks_the_guest():
    """A parse finding (the host refuses the line) replays with kph diff --refusals: plain
    kph diff would stop at the host's refusal with exit 2 on every kernel."""
    line = fuzz.repro_line(fuzz.Finding(("t sched:kfree",), "parse", "x", "parse:x"),
                           image="tree:6.12")
    assert line.startswith("kph diff --image tree:6.12 --refusals --run ")
    assert "--refusals" not in fuzz.repro_line(fuzz.Finding(("p vfs_read",), "events", "x", "e"))


def test_the_entry_argument_limit_is_drawn_on_functions_without_a_prototype():
    """7.3's fprobe keeps 15 entry words; with a BTF prototype an $argN past the
    function's parameters is BAD_VAR first, so the limit is met only on a function BTF
    does not describe (iput.part.0): the lines that draw 14 to 17 saved $argN use those."""
    from harness.kernel.rules import SERIES

    exs = fuzzdraw.list_examples(["vfs_read", "do_sys_openat2"], examples=400, seed=3,
                                 rules=SERIES["7.3"], mix="defects",
                                 unbounded=["iput.part.0"])
    saved = [ln for (ln,) in exs if "$arg14" in ln]
    assert saved and all(" iput.part.0" in ln for ln in saved), saved[:3]
    assert any(ln.startswith("f") and "%return" in ln and "$arg16" in ln for ln in saved)


def test_every_entry_a_line_logs_alone_is_its_own_under_concurrent_writers():
    """7.3's eprobe parser logs two entries for one bad attach name (BAD_EVENT_NAME from
    traceprobe_parse_event_name(), then NO_EVENT_INFO): both are that line's own, and the
    stock 7.3 build's writers run of them is no finding (a false alarm of 2026-11-29's
    recall run). An entry of one line's message against another's command still is."""
    import types

    eline, kline = "e:vs8/f syscalls.sys_ent%r_openat @+0x40", "p:_ foo a0=%di"
    e1 = ("[    1.1] event_probe: error: Event name must follow the same rules as C "
          f"identifiers\n  Command: {eline}\n                            ^\n")
    e2 = ("[    1.1] event_probe: error: This requires both group and event name to attach\n"
          f"  Command: {eline}\n                   ^\n")
    k1 = f"[    1.2] trace_kprobe: error: Too many arguments are specified\n  Command: {kline}\n          ^\n"
    crossed = ("[    1.3] trace_kprobe: error: Too many arguments are specified\n"
               f"  Command: {eline}\n          ^\n")

    class VM:
        def __init__(self, together):
            self.together = together

        def run(self, cmd, timeout=0):
            if "wait;" in cmd:
                out = self.together
            else:
                out = e1 + e2 if "sys_ent" in cmd else k1
            return types.SimpleNamespace(stdout=out, status=0)

    assert fuzz.concurrent_refusals(VM(k1 + e1 + e2 + e2 + e1), (kline, eline), writers=4,
                                    rounds=2, writes=2) is None
    f = fuzz.concurrent_refusals(VM(k1 + crossed + e1), (kline, eline), writers=4, rounds=2,
                                 writes=2)
    assert f is not None and f.kind == "error_log" and f.lines == (kline, eline)
    assert "1 of 3 error_log entries are no line's own" in f.detail


def test_a_stopping_engine_draws_on_no_function_the_workload_calls_too_often(monkeypatch):
    """gdbstub: every hit a stop (ms each), so a function the tracer pass saw called more
    than MAX_STOP_CALLS times is left out; the plugin engine keeps the whole pool; a pool
    of hot functions only stays whole rather than empty."""
    calls = {"vfs_read": 40, "PageHeadHuge": 2043, "kfree": fuzz.MAX_STOP_CALLS,
             "__rcu_read_unlock": fuzz.MAX_STOP_CALLS + 1}
    monkeypatch.setattr(fuzz, "symbol_pool", lambda vm, w: sorted(calls))
    monkeypatch.setattr(fuzz, "symbol_calls", lambda vm, w: calls)
    assert fuzz.drawing_pool(None, "w", "gdbstub") == ["kfree", "vfs_read"]
    assert fuzz.drawing_pool(None, "w", "plugin") == sorted(calls)
    monkeypatch.setattr(fuzz, "symbol_calls", lambda vm, w: {n: 10**6 for n in calls})
    assert fuzz.drawing_pool(None, "w", "gdbstub") == sorted(calls)
