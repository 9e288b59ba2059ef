"""Linux 6.12's and 7.3's own probe definitions, each on its own kernel, host-side and in
the guest.

Sources (Debian's linux-source-6.12, 6.12.117, and linux-source-7.3, 7.3.4):
tools/testing/selftests/ftrace/test.d/kprobe/*.tc and the test.d/dynevent/*.tc that write
kprobe or uprobe definitions. As ``test_selftests.py`` does for 6.1, every such definition
is here once (``$FUNCTION_FORK`` = ``kernel_clone``), in one of:

- ``CASES[series]``: accepted lines, or lines refused at registration, run host-side and
  in-guest on one execution of a workload that hits them: they must agree hit for hit,
  value for value (BTF-typed ``$retval``, BTF argument names, ``char``, ``%pd``, entry
  arguments of return probes, 7.3's casts and ``$current``), or refuse alike;
- ``PARSE[series]``: lines that kernel refuses while parsing them, compared with its
  ``error_log`` (message, caret, errno);
- ``REGISTRATION``: many-probe selftests, compared line by line;
- ``FPROBE_CASES[series]`` and ``FPARSE[series]``: the dynevent selftests' ``f:`` and
  ``t:`` lines (fprobe events, tracepoint probes), run on both sides as ``CASES`` and
  ``PARSE`` are;
- ``EPROBE_CASES[series]`` and ``EPARSE[series]``: the ``e:`` lines (event probes) of the
  dynevent selftests and refused filters, run on both sides as ``CASES`` and ``PARSE``;
- ``SKIPPED[series]``: what cannot run here, each with the reason.

Each kernel's image is built on first use; every test boots a fresh machine of its own
from that image's ready snapshot, except the cases compared through ``diff``, which share
their worker's machine of that kernel under ``--kph-machine-per worker`` (pyproject.toml)
while they pass and leave no probe behind.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness.apps.selftests_newer import (CASES, EPARSE, EPROBE_CASES, FPARSE, FPROBE_CASES,
                                          NEWER, PARSE, REGISTRATION, SKIPPED)
from selftests import (FORK, OPEN, READ, C, case_id, check_case, check_parse_refusals,
                       check_registration, ids)

pytestmark = [pytest.mark.vm, pytest.mark.timeout(240)]


# ---------------------------------------------------------------- machines

@pytest.fixture(scope="session")
def newer_image(request):
    """The image of a series, built on first use (one build per image across workers).
    ``--kph-image`` of that series (a kernel tree's image, for example a build patched
    with a fix: docs/upstream.md) replaces Debian's kernel of it."""
    from harness.errors import HarnessError
    from harness.machine.image.build import build_image
    from harness.machine.image.store import default_image

    made: dict[str, object] = {}
    given = request.config.getoption("--kph-image")
    if given:
        img = default_image(given)
        made[img.series] = img

    def get(series):
        if series not in made:
            try:
                made[series] = default_image(series)
            except HarnessError:
                made[series] = build_image(kernel=series, progress=lambda s: None)
        return made[series]
    return get


@pytest.fixture
def machine(request, newer_image):
    """A fresh machine of the test's ``series``, from that image's ready snapshot."""
    from harness.apps.pytest_plugin import _boot_opts, boot_machine

    series = request.node.callspec.params["series"]
    vm = boot_machine(newer_image(series), **_boot_opts(request.config))
    with vm:
        assert vm.facts.series == series
        yield vm


@pytest.fixture
def diff(request, newer_image, kph_reused):
    """probe_diff on the test's ``series``: a fresh machine, or with
    ``--kph-machine-per worker`` the worker's machine of that series (kept while tests
    pass and leave no probe behind)."""
    from harness.apps.pytest_plugin import DiffHelper

    if kph_reused is None:
        vm = request.getfixturevalue("machine")
    else:
        series = request.node.callspec.params["series"]
        vm = kph_reused.get(newer_image(series))
        assert vm.facts.series == series
    helper = DiffHelper(vm, "events")
    yield helper
    if kph_reused is not None:
        kph_reused.after(request, vm, "dynamic_events")
        return
    left = vm.run("cat /sys/kernel/tracing/dynamic_events").stdout
    assert left == "", f"in-guest probes left behind: {left}"


# ---------------------------------------------------------------- tests

_CASE_PARAMS = [(s, c) for s in NEWER for c in CASES[s]]


@pytest.mark.parametrize("series,case", _CASE_PARAMS,
                         ids=ids(_CASE_PARAMS, lambda p: f"{p[0]} {case_id(p[1])}"))
def test_own_selftest_case(series, case, diff):
    check_case(diff, case, series)


def _kprobe_only(c) -> bool:
    return c.guest == "events" and not any(
        s.startswith("-") or "/" in (s.split() + ["", ""])[1] for s in c.specs)


#: The same cases with the harness's module as the in-guest side (its register_kprobe()
#: and the trace layer's per-kernel parse); uprobe and -: lines have no module side.
_MODULE_PARAMS = [(s, dataclasses.replace(c, guest="module")) for s, c in _CASE_PARAMS
                  if _kprobe_only(c)]


@pytest.mark.parametrize("series,case", _MODULE_PARAMS,
                         ids=ids(_MODULE_PARAMS, lambda p: f"{p[0]} {case_id(p[1])}"))
def test_own_selftest_case_with_the_module(series, case, diff):
    check_case(diff, case, series)


@pytest.mark.parametrize("series", NEWER)
def test_own_parse_refusals(series, machine):
    logged, silent, accepted = check_parse_refusals(machine, PARSE[series])
    # a:... is -ECANCELED (made -EINVAL) with no error_log entry; nothing else is silent
    assert (silent, accepted) == (1, 0) and logged == len(PARSE[series]) - 1


@pytest.mark.parametrize("series", NEWER)
def test_kretprobe_entry_arg_equals_the_entry_probes(series, diff):
    """kretprobe_entry_arg.tc: ``$arg1`` of ``r vfs_open`` is what ``p vfs_open`` saw."""
    res = diff(["p:myevent1 vfs_open arg=$arg1", "r:myevent2 vfs_open arg=$arg1"], OPEN)
    res.assert_equivalent()
    for run in res.runs:
        ent = [h.arg("arg") for h in run.hits if h.probe == "kprobes/myevent1"]
        ret = [h.arg("arg") for h in run.hits if h.probe == "kprobes/myevent2"]
        assert ent and ent[0] == ret[0], (run.side, ent, ret)


@pytest.mark.slow
@pytest.mark.parametrize("series", NEWER)
def test_multiple_kprobes_registration(series, machine):
    """multiple_kprobes.tc: ``p SYM+5`` on text symbols without a dot until 256 register;
    every line on both sides alike (registered disabled host-side: no breakpoints)."""
    syms = [s for s in machine.symbols
            if s.type in "tT" and s.module is None and "." not in s.name]
    accepted, start = 0, 0
    while accepted < 256 and start < len(syms):
        # 512 lines a batch (kph-reader writes them in one request; ~95% are refused on
        # these kernels, +5 being inside the entry's call to __fentry__ after endbr64)
        lines = [f"p {s.name}+5" for s in syms[start:start + 512]]
        out = check_registration(machine, lines)
        accepted += sum(o.accepted for o in out)
        start += 512
    assert accepted >= 256


@pytest.mark.parametrize("series", NEWER)
def test_insn_boundary_registration(series, machine):
    """kprobe_insn_boundary.tc: ``p kernel_clone+N`` for N in 0..255, alike on both sides
    (IBT: +0 and +4 are both the entry; the rest instruction boundaries or EILSEQ)."""
    out = check_registration(machine, [f"p kernel_clone+{i}" for i in range(256)])
    assert sum(o.accepted for o in out) > 10


@pytest.mark.parametrize("series", NEWER)
def test_opt_types(series, diff):
    """kprobe_opt_types.tc: the first ``kernel_clone+N`` the guest jump-optimizes; both
    sides agree on a fork through it, and the guest reports it optimized."""
    vm = diff.vm
    r = vm.run("cd /sys/kernel/tracing; echo 1 > /proc/sys/debug/kprobes-optimization; "
               "for i in $(seq 0 255); do echo \"p:testprobe kernel_clone+$i\" > kprobe_events "
               "2>/dev/null || continue; echo 1 > events/kprobes/enable; ls / >/dev/null; "
               "P=$(grep kernel_clone /sys/kernel/debug/kprobes/list); "
               "echo 0 > events/kprobes/enable; echo > kprobe_events; "
               "case $P in *OPTIMIZED*) echo @$i; break;; esac; done", timeout=180)
    n = int(r.stdout.split("@", 1)[1].split()[0])
    # the optimizer runs a few jiffies after registration (OPTIMIZE_DELAY): the workload
    # forks, waits, reads the kprobes list, forks again
    res = diff([f"p:testprobe kernel_clone+{n}"],
               f"{FORK}; sleep 0.3; grep 'kernel_clone+' /sys/kernel/debug/kprobes/list; {FORK}")
    res.assert_equivalent()
    assert "[OPTIMIZED]" in res.runs[1].workload_output, res.runs[1].workload_output


_FPROBE_PARAMS = [(s, c) for s in NEWER for c in FPROBE_CASES[s]]


@pytest.mark.parametrize("series,case", _FPROBE_PARAMS,
                         ids=ids(_FPROBE_PARAMS, lambda p: f"{p[0]} {case_id(p[1])}"))
def test_own_fprobe_case(series, case, diff):
    """fprobe events (``f:``) host-side (ftrace_ops callbacks at each matched function's
    ftrace location, exits as that kernel takes them) against the guest's own."""
    check_case(diff, case, series)


@pytest.mark.parametrize("series", NEWER)
def test_own_fprobe_parse_refusals(series, machine):
    """fprobe_syntax_errors.tc: every line refused alike, message, caret and errno."""
    logged, silent, accepted = check_parse_refusals(machine, FPARSE[series])
    assert (logged, silent, accepted) == (len(FPARSE[series]), 0, 0)


def _plugin_mirrors(c) -> bool:
    """The plugin engine takes every f: line (a return one's $argN and 7.3's ``$current``
    included), but kfree's (and the other functions and tracepoints the idle task hits:
    kmem_cache_*, sched_switch, sched_wakeup), whose hits at the window's edges the plugin
    cannot take in the guest's halt (it has no settled halt: docs/plugin.md)."""
    return not any(any(f" {hot}" in s for hot in ("kfree", "kmem_cache_", "sched_switch",
                                                  "sched_wakeup")) for s in c.specs)


_FPROBE_PLUGIN = [(s, c) for s, c in _FPROBE_PARAMS if _plugin_mirrors(c)]
#: kprobe cases with what the plugin's programs took last: $current, this_cpu_*(), a
#: return line's $argN (fetch.c: KOP_CURRENT, KOP_CPU_PTR, KOP_EDATA)
_KPROBE_PLUGIN = [(s, c) for s, c in _CASE_PARAMS if _plugin_mirrors(c) and any(
    "$current" in x or "this_cpu" in x or (x[:1] == "r" or "%return" in x) and "$arg" in x
    for x in c.specs)] + [
    # per-cpu reads (7.3's this_cpu_read()/this_cpu_ptr()), and an exit's $argN past the
    # registers (kernel_clone has one argument: $arg7 reads the stack at the entry)
    ("7.3", C("kprobe/kprobe_args_syntax.tc",
              "p:pc vfs_read off=this_cpu_read(@this_cpu_off):x64 "
              "cur=this_cpu_read(@current_task):x64 at=this_cpu_ptr(@this_cpu_off):x64", READ)),
    *[(s, C("dynevent/fprobe_entry_arg.tc", ["f:x kernel_clone%return a=$arg1 s=$arg7",
                                             "r:r kernel_clone a=$arg1"], FORK))
      for s in NEWER]]


@pytest.mark.parametrize("series,case", _FPROBE_PLUGIN,
                         ids=ids(_FPROBE_PLUGIN, lambda p: f"{p[0]} {case_id(p[1])}"))
def test_own_fprobe_case_with_the_plugin_engine(series, case, newer_image):
    from harness import Machine
    from harness.apps.pytest_plugin import DiffHelper

    with Machine.boot(newer_image(series), host="plugin") as vm:
        check_case(DiffHelper(vm, "events"), case, series)


@pytest.mark.parametrize("series,case", _KPROBE_PLUGIN,
                         ids=ids(_KPROBE_PLUGIN, lambda p: f"{p[0]} {case_id(p[1])}"))
def test_own_case_with_the_plugin_engine(series, case, newer_image):
    from harness import Machine
    from harness.apps.pytest_plugin import DiffHelper

    with Machine.boot(newer_image(series), host="plugin") as vm:
        check_case(DiffHelper(vm, "events"), case, series)


@pytest.mark.parametrize("series", NEWER)
def test_ftrace_ops_order_is_the_kernels(series, machine):
    """harness.backends.tracelayer.FprobeOps says in which order the guest runs the ftrace
    callbacks of one function: walk the guest's ``ftrace_ops_list`` after creating and
    enabling an entry fprobe, a kprobe and an exit fprobe on kernel_clone, in that order."""
    t = "/sys/kernel/tracing"
    lines = [("fprobes", "e", "f:e kernel_clone"), ("kprobes", "k", "p:k kernel_clone"),
             ("fprobes", "x", "f:x kernel_clone%return")]
    script = [f"cd {t}"] + [f"echo '{ln}' >> dynamic_events" for _, _, ln in lines]
    script += [f"echo 1 > events/{g}/{e}/enable" for g, e, _ in lines]
    machine.run("\n".join(script))
    try:
        head = machine.symbols.lookup("ftrace_ops_list").addr
        end = machine.symbols.lookup("ftrace_list_end").addr
        p, names = int.from_bytes(machine.host.read(head, 8), "little"), []
        while p and p != end and len(names) < 16:
            hit = machine.symbols.symbolize(p)
            names.append(hit[0].name if hit and hit[1] == 0 else "(an fprobe's own ops)")
            p = int.from_bytes(machine.host.read(p + 8, 8), "little")   # ftrace_ops.next
    finally:
        machine.run(f"cd {t}; echo 0 > events/enable; echo > dynamic_events")
    if series == "6.12":    # the kprobes' ops (armed at enable) before both fprobes' own
        assert names == ["kprobe_ftrace_ops"] + ["(an fprobe's own ops)"] * 2, names
    else:                   # the group enabled last first: exits, kprobes, entries
        assert names == ["graph_ops", "kprobe_ftrace_ops", "fprobe_ftrace_ops"], names


@pytest.mark.parametrize("series", NEWER)
def test_fprobe_handlers_order_on_one_function(series, diff):
    """Where several fprobes share a function, the entry ones read the return slot as the
    kernel's own order leaves it: 6.12 runs each fprobe's ftrace_ops newest first, and an
    exit one hooks the slot (``arch_rethook_trampoline``) for those after it; 7.3 runs the
    group whose ops came last first (the function graph's for exits: ``return_to_handler``)."""
    res = diff(["f:e1 kernel_clone $stack0", "f:x kernel_clone%return",
                "f:e2 kernel_clone $stack0"], FORK)
    res.assert_equivalent()
    host = res.runs[0]
    tramp = "return_to_handler" if series == "7.3" else "arch_rethook_trampoline"
    addr = f"0x{diff.vm.symbols.lookup(tramp).addr:x}"
    e1 = [h.arg("arg1") for h in host.hits if h.probe == "fprobes/e1"]
    e2 = [h.arg("arg1") for h in host.hits if h.probe == "fprobes/e2"]
    assert e1 and e2
    if series == "6.12":    # e2 (newest) before x: the real address; e1 after x: hooked
        assert addr not in e2 and set(e1) == {addr}, (e1, e2, addr)
    else:                   # the exit group came after the entry group: it runs first
        assert set(e1) == set(e2) == {addr}, (e1, e2, addr)


_EPROBE_PARAMS = [(s, c) for s in NEWER for c in EPROBE_CASES[s]]


@pytest.mark.parametrize("series,case", _EPROBE_PARAMS,
                         ids=ids(_EPROBE_PARAMS, lambda p: f"{p[0]} {case_id(p[1])}"))
def test_own_eprobe_case(series, case, diff):
    """Event probes (``e:``) host-side (at ``trace_event_buffer_commit()`` of the attached
    event, its filter, then the fields of its record) against the guest's own."""
    check_case(diff, case, series)


@pytest.mark.parametrize("series,case", _EPROBE_PARAMS,
                         ids=ids(_EPROBE_PARAMS, lambda p: f"{p[0]} {case_id(p[1])}"))
def test_own_eprobe_case_with_the_plugin_engine(series, case, newer_image):
    """The same cases with the plugin engine: one compiled program per line at
    ``trace_event_buffer_commit()``, the trigger arguments and the line's own, judged
    from the capture (harness.backends.eprobes)."""
    from harness import Machine
    from harness.apps.pytest_plugin import DiffHelper

    with Machine.boot(newer_image(series), host="plugin") as vm:
        check_case(DiffHelper(vm, "events"), case, series)


@pytest.mark.parametrize("series", NEWER)
def test_own_eprobe_parse_refusals(series, machine):
    """eprobes_syntax_errors.tc and refused filters: message, caret and errno alike."""
    logged, silent, accepted = check_parse_refusals(machine, EPARSE[series])
    assert (logged, silent, accepted) == (len(EPARSE[series]), 0, 0)


@pytest.mark.parametrize("series", NEWER)
def test_eprobe_host_only_puts_a_stub_on_the_event(series, machine):
    """A host-only run (no guest side): the harness's own ``e`` event on the attached
    event makes the kernel build its records (filtered out: the guest keeps nothing),
    and the host's probe fires on each; the stub is gone afterwards."""
    from harness.backends.host import HostBackend
    from harness.kernel.grammar import KernelView, parse

    spec = parse("e:fk sched.sched_process_fork cp=$child_pid:s32 pc=$parent_comm:string",
                 kernel=KernelView(machine.facts.rules))
    host = HostBackend(machine, alone=True)
    try:
        assert host.register([spec])[0].accepted
        host.enable()
        machine.run("(true); (true); (true)")
        host.disable()
        hits = host.collect()
    finally:
        host.close()
    forks = [h for h in hits if h.probe == "eprobes/fk"]
    assert len(forks) >= 3 and all(int(h.arg("cp")) > 1 for h in forks), hits
    left = machine.run("cat /sys/kernel/tracing/dynamic_events; cat /sys/kernel/tracing/trace"
                       " | grep -c kphstub || true").stdout
    assert "kphstub" not in left.split("\n", 1)[0] and left.strip().endswith("0"), left


def test_inventory():
    """docs/matrix.md states how many cases each kernel's selftests gave and what is skipped."""
    readme = (Path(__file__).parents[2] / "docs" / "matrix.md").read_text()
    for s in NEWER:
        total = len(CASES[s]) + len(PARSE[s]) + len(REGISTRATION) + len(FPROBE_CASES[s]) + \
            len(FPARSE[s]) + len(EPROBE_CASES[s]) + len(EPARSE[s])
        assert f"{s}: **{total} selftest-derived cases**" in readme, s
        for what in SKIPPED[s]:
            assert what in readme, what


@pytest.mark.parametrize("series", NEWER)
def test_plugin_engine_return_probes(series, newer_image):
    """The plugin engine's kretprobe trampoline must be executable text: its callback runs
    after QEMU fetched the instruction. 6.12's ``_etext`` is 2 MiB aligned, so the byte past
    it is NX rodata and a return into it oopsed the guest (found by ``kph fuzz --host
    plugin`` with ``r1:a.b do_sys_openat2``); the engine takes the int3 padding before it."""
    from harness import Machine
    from harness.apps.pytest_plugin import DiffHelper

    with Machine.boot(newer_image(series), host="plugin") as vm:
        etext = vm.symbols.lookup("_etext").addr
        tramp = vm.host.trampoline
        assert tramp in (etext + 1, etext - 1) and tramp & ~0xFFF < etext, hex(tramp)
        res = DiffHelper(vm, "events")(["r1:a/b do_sys_openat2 ret=$retval"], OPEN)
        res.assert_equivalent()
        assert res.matched.get("a/b", 0) >= 1


@pytest.mark.parametrize("series", ["6.1", "6.12", "7.3"])
def test_the_nmissed_words_read_are_what_kprobe_profile_prints(series, newer_image):
    """The guest's nmissed over the window comes from the words probes_profile_seq_show()
    sums (rp.kp.nmissed, plus rp.nmissed for a return probe), read by the host: checked
    against the kernel's own kprobe_profile on each booted kernel, with misses on it (an
    r1: line, two sleepers in do_nanosleep at once: the second finds no instance)."""
    from harness.backends.events import EventsBackend
    from harness.kernel.grammar import parse
    from harness.vmctl import Machine

    with Machine.boot(newer_image(series), smp=2) as vm:
        be = EventsBackend(vm)
        try:
            out = be.register([parse("r1:kphnm/ns do_nanosleep"), parse("p:kphnm/nsp do_nanosleep")])
            assert all(o.accepted for o in out), out
            be.enable()
            be.mark_nhits()
            vm.run("taskset 1 sleep 1 & taskset 2 sleep 1; wait", timeout=60)
            be.mark_nhits()
            be.disable()
            window, profile = be.counters(window=True), be.counters()
        finally:
            be.close()
    ns, nsp = window["kphnm/ns"], window["kphnm/nsp"]
    assert ns.window and profile["kphnm/ns"].nmissed >= 1, (window, profile)
    # no miss before the window's start here: the window's count is the profile's
    assert ns.nmissed == profile["kphnm/ns"].nmissed, (window, profile)
    assert nsp.nmissed == profile["kphnm/nsp"].nmissed == 0, (window, profile)
    assert ns.nhit == profile["kphnm/ns"].nhit and nsp.nhit >= 2, (window, profile)
