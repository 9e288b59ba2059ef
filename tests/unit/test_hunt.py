"""``kph hunt``'s logic without a guest: the phases' budget, one finding per key, the known
findings, the exit status, the selftest items, the scenarios it runs, and bad input (one
line, exit 2, before anything boots)."""
import subprocess
import sys
from types import SimpleNamespace

import pytest

from harness.apps import fuzz, hunt
from harness.errors import SetupError


def _kph(*args):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                          text=True, timeout=60)


def _f(kind="events", pk="kprobe", what="arg:x", lines=("p do_sys_openat2 x=%di",),
       detail="hit #1, field arg:x: host '1' vs events '2'"):
    return hunt.Finding("fuzz", kind, pk, what, tuple(lines), detail, "kph diff ...", "fuzz")


def test_the_budget_is_split_across_the_phases_in_order():
    now = [100.0]
    b = hunt.Budget(600.0, start=100.0, clock=lambda: now[0])
    ends = [b.phase_end(p) - 100.0 for p in hunt.PHASES]
    assert hunt.PHASES == ("selftests", "scenarios", "kprobes", "insns", "writers", "fuzz")
    assert ends == sorted(ends) and ends[-1] == 600.0
    assert ends[0] == pytest.approx(600 * hunt.SHARES[0][1])
    # a phase that ends early leaves its time to the next: the deadlines are cumulative
    now[0] = 100.0 + ends[0] + 1
    assert b.over("selftests") and not b.over("scenarios")
    assert b.left("fuzz") == pytest.approx(600 - ends[0] - 1)
    now[0] = 701.0
    assert all(b.over(p) for p in hunt.PHASES) and b.left("fuzz") == 0


@pytest.mark.parametrize("seconds", [0, -60])
def test_a_budget_of_nothing_is_refused(seconds):
    with pytest.raises(SetupError, match="runs nothing"):
        hunt.Budget(seconds)


def test_findings_are_kept_once_per_kind_probe_kind_and_field():
    fs = hunt.Findings()
    assert fs.add(_f())
    assert not fs.add(_f(lines=("p vfs_read x=%si",)))          # the same class again
    assert fs.add(_f(pk="kretprobe"))                           # another probe kind
    assert fs.add(_f(what="arg:y"))                             # another field
    assert fs.add(_f(kind="registration", what="registration"))
    assert len(fs.items) == 4 and fs.repeats == 1
    assert fs.items[0].lines == ("p do_sys_openat2 x=%di",)    # the first one seen is kept


def test_the_exit_status_is_the_worst_new_finding():
    assert hunt.Findings().status == 0
    fs = hunt.Findings()
    fs.add(_f())
    assert fs.status == 1
    fs.add(_f(kind="hang", what="HANG"))
    assert fs.status == 6
    fs.add(_f(kind="kernel", what="KERNEL-WARNING"))
    assert fs.status == 5
    # a known finding does not count
    known = hunt.Findings()
    known.add(_f(kind="registration", what="registration", lines=("p:x c_start",),
                 detail="registration: host EINVAL 'The symbol is not unique', events "
                        "EADDRNOTAVAIL 'The symbol is not unique'"))
    assert known.items[0].known and known.new == [] and known.status == 0


def test_the_known_findings_are_matched_by_what_they_look_like():
    kretprobe = _f(lines=("r:a do_sys_openat2", "r:b do_sys_openat2"), what="ret_ip",
                   detail="hit #1, field ret_ip: host '[unknown/kretprobe'd]' vs events "
                          "'__x64_sys_openat+0x55/0xa0'")
    btf = _f(kind="registration", what="registration", lines=("r vfs_read $retval:ustring",),
             detail="registration: host EINVAL 'This type does not fit for string.', "
                    "events accepted")
    for f, n in ((kretprobe, "#3"), (btf, "#1")):
        assert hunt.known_of(f).endswith(f"(docs/upstream.md{n})"), f
    # a kernel that accepts a symbol matching several is another bug than #2's errno
    # (both refuse there): the host's refusal text alone does not make it #2
    for accepted in (_f(kind="parse", what="host-refuses", lines=("p:u name_show",),
                        detail="host refuses ('The symbol is not unique' at 10), the guest "
                               "accepts"),
                     _f(kind="registration", what="registration", lines=("p:u name_show",),
                        detail="registration: host EINVAL 'The symbol is not unique', "
                               "events accepted")):
        assert hunt.known_of(accepted) == "", accepted
    # the same kinds of text elsewhere are new
    assert hunt.known_of(_f(detail="hit #1, field arg:x: host '(fault)' vs events '0x0'")) == ""
    # a string the kernel could not read where the host reads one is not #1 either
    assert hunt.known_of(_f(lines=("e:e syscalls/sys_enter_chdir f=+0($filename):ustring",),
                            detail="hit #1, field arg:f: host '\"/\"' vs events '(fault)'")) == ""
    assert hunt.known_of(_f(kind="parse", what="error_log", detail="guest 'Invalid type' at 9, "
                            "host 'Invalid type' at 10")) == ""
    # the table names no entry of probes/bugs/: it is the three of docs/upstream.md
    assert [k.where for k in hunt.KNOWN] == [f"docs/upstream.md#{i}" for i in (1, 2, 3)]


def test_probe_kinds_and_fields_of_findings():
    assert hunt.probe_kind(["p:a do_sys_openat2"]) == "kprobe"
    assert hunt.probe_kind(["p vfs_read%return"]) == "kretprobe"
    assert hunt.probe_kind(["r4 vfs_read $retval"]) == "kretprobe"
    assert hunt.probe_kind(["p /usr/bin/kph-loop:0x1710 %ax"]) == "uprobe"
    assert hunt.probe_kind(["r /usr/bin/kph-loop:0x1710"]) == "uretprobe"
    assert hunt.probe_kind(["-:kph/e", "f:kph/e vfs_read"]) == "fprobe"
    assert hunt.probe_kind(["t sched_process_fork"]) == "tprobe"
    assert hunt.probe_kind(["e:x sched.sched_process_exec"]) == "eprobe"
    assert hunt.probe_kind(["-:kph/e"]) == "dynevent"
    f = fuzz.Finding(("p a",), "events", "", "events:arg:+N(%di):u32:0xN|0xN")
    assert hunt.what_of(f) == "arg:u32"
    assert hunt.what_of(fuzz.Finding(("p a",), "kernel", "", "kernel:KERNEL-WARNING:x")) == \
        "KERNEL-WARNING"
    assert hunt.what_of(fuzz.Finding(("p a",), "parse", "", "parse:Bad|Bad|False")) == "error_log"
    assert hunt.what_of(fuzz.Finding(("p a",), "registration", "",
                                     "registration:registration:N|N")) == "registration"


def test_shrinking_drops_every_line_the_finding_does_not_need():
    lines = ("p:a vfs_read", "p:b kernel_clone x=%di", "p:c do_exit", "r:d vfs_read")
    same = lambda cand: "p:b kernel_clone x=%di" in cand         # noqa: E731
    assert hunt.shrink_lines(lines, same, deadline=float("inf")) == ("p:b kernel_clone x=%di",)
    # out of time: what it has
    assert hunt.shrink_lines(lines, same, deadline=0.0) == lines


def test_selftest_items_are_the_series_own_cases_and_refusals():
    from harness.apps import selftests, selftests_newer

    old = hunt.selftest_items("6.1")
    assert len(old) == len(selftests.CASES) + len(selftests.PARSE)
    assert old[1][2] == "true" and "^" not in old[1][1][0]      # a parse refusal, caret out
    for s in ("6.12", "7.3"):
        items = hunt.selftest_items(s)
        srcs = {src for src, *_ in items}
        assert any("fprobe" in x for x in srcs) and any("eprobe" in x for x in srcs), s
        assert len(items) == sum(len(getattr(selftests_newer, n)[s]) for n in (
            "CASES", "FPROBE_CASES", "EPROBE_CASES", "PARSE", "FPARSE", "EPARSE"))


def test_scenarios_are_the_generic_ones():
    h = hunt.Hunt.__new__(hunt.Hunt)
    h.scenarios = hunt.SCENARIOS
    names = [p.name for p in h.scenario_files()]
    assert names and all("upstream" not in str(p) for p in h.scenario_files())
    assert "blacklisted.toml" in names


def test_an_image_without_kprobe_events_is_refused(tmp_path):
    (tmp_path / "config").write_text("CONFIG_KPROBES=y\n# CONFIG_KPROBE_EVENTS is not set\n"
                                     "CONFIG_FTRACE=y\n")
    with pytest.raises(SetupError, match="CONFIG_KPROBE_EVENTS is not set"):
        hunt.check_image(SimpleNamespace(dir=tmp_path, version="x"))
    (tmp_path / "config").write_text("CONFIG_KPROBES=y\nCONFIG_KPROBE_EVENTS=y\nCONFIG_FTRACE=y\n")
    hunt.check_image(SimpleNamespace(dir=tmp_path, version="x"))


@pytest.mark.parametrize("args,word", [
    (("--minutes", "0"), "--minutes 0"),
    (("--minutes", "-2"), "--minutes -2"),
    (("--minutes", "1", "--image", "9.9"), "'9.9'"),
    (("--minutes", "1", "--max-cases", "0"), "--max-cases 0"),
])
def test_bad_input_is_one_line_exit_2(args, word):
    r = _kph("hunt", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0], r.stderr


def test_every_phase_runs_one_case_at_least_and_no_more_than_max_cases():
    h = hunt.Hunt.__new__(hunt.Hunt)
    now = [0.0]
    h.budget = hunt.Budget(60.0, start=0.0, clock=lambda: now[0])
    h.max_cases = None
    now[0] = 59.0                                    # the earlier phases overran
    assert h._room("scenarios", 0) and not h._room("scenarios", 1)
    assert h._room("fuzz", 5)
    h.max_cases = 2
    assert h._room("fuzz", 1) and not h._room("fuzz", 2)


def test_a_selftest_finding_is_shrunk_reported_once_with_its_command():
    """The selftest phase's path with a scripted oracle: a case of three lines whose
    second alone diverges is kept at that line, with the kph diff line for it; the same
    class again is not reported twice."""
    h = hunt.Hunt.__new__(hunt.Hunt)
    h.budget = hunt.Budget(60.0)
    h.image_arg, h.findings, h.say = "6.12", hunt.Findings(), lambda s: None
    h.counts = {p: {"run": 0, "agreed": 0, "findings": 0, "not_run": 0} for p in hunt.PHASES}
    bad = "p:b kernel_clone x=+0(%di):u32"

    class Oracle:
        judged = []
        post_handler = raw_kprobes = False

        def judge(self, lines):
            self.judged.append(lines)
            if bad in lines:
                return fuzz.Finding(lines, "events", "hit #1, field arg:x: host '1' vs "
                                    "events '2'", "events:arg:+N(%di):u32:N|N")
            return None

    lines = ("p:a vfs_read", bad, "r:c do_exit")
    got = Oracle().judge(lines)
    h._judged(got, lines, "ls /", "events", "kprobe/x.tc", Oracle(), "selftests")
    (f,) = h.findings.items
    assert f.lines == (bad,) and f.key == ("events", "kprobe", "arg:u32") and not f.known
    assert f.reproduce.startswith("kph diff --image 6.12 --run 'ls /' -- ") and bad in f.reproduce
    assert h.findings.status == 1
    h._judged(got, lines, "ls /", "events", "kprobe/y.tc", Oracle(), "selftests")
    assert len(h.findings.items) == 1 and h.findings.repeats == 1
    text = "\n".join(hunt.report_lines(hunt.HuntResult("d", "6.12.x", 1.0, h.findings,
                                                      h.counts)))
    assert "1 new finding(s), 0 known" in text and "[NEW] events / kprobe / arg:u32" in text


def test_a_comparison_that_does_not_repeat_is_listed_not_counted_and_stops_nothing():
    """7.3's hunt: ``f up_read +0($stack5)`` read current's thread flags, which a timer
    tick changed between the host's read and the guest's; run again, the sides agreed.
    Listed as not repeated, not a new finding: no reproducer shows it. A kernel report
    counts however often it repeats."""
    h = hunt.Hunt.__new__(hunt.Hunt)
    h.budget, h.max_cases, h.stop_at_first = hunt.Budget(60.0), None, True
    h.image_arg, h.findings, h.said = "7.3", hunt.Findings(), []
    h.say = h.said.append
    h.counts = {p: {"run": 0, "agreed": 0, "findings": 0, "not_run": 0} for p in hunt.PHASES}
    line = "f up_read +0($stack5)"

    class Oracle:
        post_handler = raw_kprobes = False
        answers = [fuzz.Finding((line,), "events", "hit #7, field arg:arg1: host '0x80001' "
                                "vs events '0x80021'", "events:arg:+N($stackN):xN:N|N"), None]

        def judge(self, lines):
            return self.answers.pop(0) if self.answers else None

    o = Oracle()
    h._judged(o.answers.pop(0), (line,), "true", "events", "fuzz", o, "selftests")
    (f,) = h.findings.items
    assert f.flaky and f.unconfirmed and not h.findings.new and h.findings.status == 0
    assert not h.stopped and "did not repeat: not counted" in h.said[-1]
    assert f.as_dict()["new"] is False
    text = "\n".join(hunt.report_lines(hunt.HuntResult("d", "7.3.x", 1.0, h.findings,
                                                      h.counts)))
    assert "0 new finding(s), 0 known, 1 that did not repeat (not counted)" in text
    # the same comparison repeating is a finding
    h2 = hunt.Hunt.__new__(hunt.Hunt)
    h2.__dict__.update(h.__dict__, findings=hunt.Findings(), stopped=False)
    o2 = Oracle()
    o2.answers = [o.answers[0] if o.answers else None]
    first = fuzz.Finding((line,), "events", "x", "events:arg:+N($stackN):xN:N|N")
    o2.answers = [first]
    h2._judged(first, (line,), "true", "events", "fuzz", o2, "selftests")
    assert h2.findings.new and not h2.findings.items[0].flaky and h2.stopped
    # a kernel report is counted even when flaky
    k = hunt.Finding("fuzz", "kernel", "kprobe", "WARNING", ("p:a x",), "", "kph diff",
                     flaky=True)
    assert not k.unconfirmed


def test_stop_at_first_ends_every_phase_at_the_first_new_finding_not_a_known_one():
    h = hunt.Hunt.__new__(hunt.Hunt)
    h.budget, h.max_cases, h.stop_at_first = hunt.Budget(600.0), None, True
    h.findings, h.said = hunt.Findings(), []
    h.say = h.said.append
    h.counts = {p: {"run": 0, "agreed": 0, "findings": 0, "not_run": 0} for p in hunt.PHASES}
    known = hunt.Finding("selftests", "registration", "kprobe", "error_log", ("p:a x",),
                         "", "kph diff")
    known.known = "docs/upstream.md #9"            # a known finding does not stop the hunt
    h._add(known)
    assert h._room("selftests", 3) and not h.stopped
    h._add(hunt.Finding("selftests", "events", "kprobe", "arg:u32", ("p:b y",), "", "kph diff"))
    assert h.stopped and not any(h._room(p, 0) for p in hunt.PHASES)
    assert "stopping at the first new finding" in h.said[-1]
    text = "\n".join(hunt.report_lines(hunt.HuntResult("d", "6.12.x", 1.0, h.findings,
                                                      h.counts, stopped_early=True)))
    assert "stopped at the first new finding" in text.splitlines()[0]


def test_a_scenario_this_kernel_cannot_run_is_not_a_finding_and_a_hang_is(tmp_path):
    h = hunt.Hunt.__new__(hunt.Hunt)
    h.budget, h.max_cases, h.image_arg = hunt.Budget(600.0), None, None
    h.findings, h.say, h.img, h.out_dir = hunt.Findings(), lambda s: None, None, tmp_path
    h.counts = {p: {"run": 0, "agreed": 0, "findings": 0, "not_run": 0} for p in hunt.PHASES}
    h.scenarios = hunt.SCENARIOS
    files = h.scenario_files()
    answers = iter([{"error": "trace_kprobe: error: This function returns 'void' type"},
                    {"result": "kernel-finding", "verdict": "HANG"},
                    {"met": False, "reasons": ["outcome: expected ok, saw refused (NOT met)"]},
                    {"met": False, "reasons": ["outcome: expected oops, saw panic (met)",
                                               "stack /kph_pre/: NOT found"]}])
    h._repro_run = lambda path, timeout: next(answers, {"met": True, "reasons": []})
    h.scenario_phase()
    c = h.counts["scenarios"]
    # the last: only its stack (evidence the harness reads) was missing: agreed
    assert c["not_run"] == 1 and c["run"] == len(files) - 1 and c["agreed"] == len(files) - 3
    hang, unmet = h.findings.items
    assert (hang.kind, hang.what) == ("hang", "HANG") and hang.reproduce.startswith("kph repro ")
    assert unmet.kind == "scenario" and "expected ok, saw refused" in unmet.detail
    assert h.findings.status == 6


def test_the_fuzz_phase_alternates_the_whole_mix_with_rounds_of_defects(monkeypatch):
    """Every other round draws defects only (fuzzdraw.MIXES), four times as many examples:
    refusals are judged by one write each."""
    h = hunt.Hunt.__new__(hunt.Hunt)
    h.budget, h.max_cases, h.seed, h.stopped = hunt.Budget(600.0), None, 0, False
    h.findings, h.say, h.vm = hunt.Findings(), lambda s: None, object()
    h.counts = {p: {"run": 0, "agreed": 0, "findings": 0, "not_run": 0} for p in hunt.PHASES}
    calls = []

    def run(vm, *, examples, seed, mix, **kw):
        calls.append((mix, examples, seed))
        if len(calls) == 4:
            h.stopped = True                        # end the phase after four rounds
        return fuzz.FuzzStats(examples=examples, agreed_runs=examples, vm=vm)
    monkeypatch.setattr(fuzz, "run", run)
    h.fuzz_phase()
    assert [(m, n) for m, n, _ in calls] == [("all", 25), ("defects", 100), ("all", 25),
                                            ("defects", 100)]
    assert len({s for _, _, s in calls}) == 4 and h.counts["fuzz"]["run"] == 250


def test_the_kprobes_phase_draws_unique_plain_text_symbols_of_vmlinux():
    from harness.kernel.symbols import Symbol

    syms = [Symbol("vfs_read", 1, "T"), Symbol("__pfx_vfs_read", 0, "t"),
            Symbol("twice", 2, "t"), Symbol("twice", 3, "t"), Symbol("jiffies", 4, "D"),
            Symbol("mod_fn", 5, "t", module="ext4"), Symbol("foo.cold", 6, "t"),
            Symbol("bad$name", 7, "t")]
    assert hunt.raw_pool(syms) == ["__pfx_vfs_read", "foo.cold", "vfs_read"]


def test_raw_kprobes_skip_trace_kprobe_s_notrace_check_only():
    from harness.backends.tracelayer import TraceLayer

    layer = object.__new__(TraceLayer)
    layer.raw = True
    assert layer.notrace(object()) is False     # never looked at: register_kprobe() alone


def test_a_run_not_compared_is_not_run_never_agreed():
    """The oracle returns None for an agreement and for a run it could not compare
    (``Oracle.unjudged``: the host's probes slowed the guest past the timeout, a
    construct not mirrored); only the first counts as agreed, and a slowed run is said."""
    h = hunt.Hunt.__new__(hunt.Hunt)
    h.said = []
    h.say = h.said.append
    c = {"run": 3, "agreed": 0, "findings": 0, "not_run": 0}
    o = SimpleNamespace(unjudged=None)
    h._none(o, c, "insns")
    o.unjudged = ("slowed: kph-1: not compared: the host's probes slowed the guest past "
                  "the timeout (...)")
    h._none(o, c, "insns")
    o.unjudged = "not mirrored: $current on 7.3"
    h._none(o, c, "selftests")
    assert (c["agreed"], c["not_run"]) == (1, 2)
    assert len(h.said) == 1 and h.said[0].startswith("hunt: insns: not compared: kph-1")
