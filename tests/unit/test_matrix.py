"""Comparing the guests of several kernels (harness.diff.matrix), on recorded runs."""
from harness.diff.matrix import KernelRun, compare_kernels
from harness.records import Hit, Outcome, SideResult


def _run(series, outcomes, hits):
    return KernelRun(series, f"{series}-abi", guest=SideResult("events", outcomes, hits))


def _hit(probe, ip, kind="p", pid=100, **args):
    return Hit("events", probe, kind, 0, 0, pid, "sh", ip, "kernel_clone" if kind == "r" else None,
               tuple(args.items()))


def test_registration_mode_count_and_fields_are_compared_across_kernels():
    ok = lambda p, m: Outcome(p, True, mode=m)  # noqa: E731
    a = _run("6.1", [ok("k/clone", "ftrace"), ok("k/ret", "ftrace"), ok("k/new", "int3")],
             [_hit("k/clone", "kernel_clone+0x0/0x4c0", pid=120),
              _hit("k/ret", "__do_sys_clone+0x65/0x90", "r", ret="0x79")])
    b = _run("7.3", [ok("k/clone", "ftrace"), ok("k/ret", "ftrace"),
                     Outcome.rejected("k/new", 22, "Invalid fetch argument")],
             [_hit("k/clone", "kernel_clone+0x4/0x4a0", pid=555),
              _hit("k/clone", "kernel_clone+0x4/0x4a0", pid=556),
              _hit("k/ret", "__do_sys_clone+0x71/0x98", "r", ret="121")])
    diffs = {(d.probe, d.what): d for d in compare_kernels([a, b])}
    assert "k/new" == diffs[("k/new", "registration")].probe
    assert dict(diffs[("k/new", "registration")].values)["7.3"].startswith("refused EINVAL")
    assert diffs[("k/clone", "events")].values == (("6.1", "1"), ("7.3", "2"))
    ip = diffs[("k/clone", "ip")]
    assert ip.values == (("6.1", "kernel_clone+0x0"), ("7.3", "kernel_clone+0x4"))  # no /size
    assert ("k/ret", "ip") not in diffs       # a return site compares by the caller's name
    ret = diffs[("k/ret", "arg:ret")]
    assert ret.note == "same value, printed in hex on 6.1 and in decimal on 7.3"
    assert not any(d.what in ("pid", "comm") for d in diffs.values())   # per boot


def test_nothing_to_compare_with_one_kernel_or_identical_guests():
    ok = Outcome("k/x", True, mode="int3")
    a = _run("6.1", [ok], [_hit("k/x", "f+0x5/0x10", v="1")])
    b = _run("6.12", [ok], [_hit("k/x", "f+0x5/0x20", v="1")])
    assert compare_kernels([a]) == []
    assert compare_kernels([a, b]) == []
