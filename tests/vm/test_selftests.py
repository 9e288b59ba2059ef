"""Linux 6.1's own probe definitions, each placed host-side and in the guest, on the
default kernel or each of ``--kph-kernels`` (where a newer kernel answers otherwise, it is
compared with that kernel's guest, not with 6.1's). 6.12's and 7.3's own selftests are in
``test_selftests_newer.py``; the helpers and workloads in ``selftests.py``.

Sources (Debian's linux-source-6.1, 6.1.192): tools/testing/selftests/ftrace/test.d/kprobe/*.tc,
test.d/dynevent/*.tc and samples/kprobes/{kprobe,kretprobe}_example.c. Every definition
these files write to ``kprobe_events``, ``uprobe_events`` or ``dynamic_events`` is here once
(names as the selftest writes them, ``$FUNCTION_FORK`` = ``kernel_clone``), in one of:

- ``PARSE``: lines 6.1 refuses while parsing them. ``kph diff`` refuses them before booting,
  with the kernel's ``error_log`` text and caret column; the test writes every one to the
  guest as well and compares the two entries (and the errno where 6.1 logs nothing).
- ``CASES``: lines 6.1 accepts, or refuses at registration. Each case runs host-side and
  in-guest on one execution of a busybox workload that hits its probes, and must agree hit
  for hit, value for value, or refuse alike with the kernel's errno and ``error_log`` text.
- ``REGISTRATION``: ``multiple_kprobes.tc``'s 256 probes, compared line by line.
- ``SKIPPED``: what cannot run here, each with the reason.

The fidelity section of docs/diff.md gives the counts; ``test_inventory`` keeps them honest.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness.apps.selftests import CASES, PARSE, REGISTRATION, SKIPPED
from selftests import case_id, check_case, check_parse_refusals, check_registration, ids

pytestmark = pytest.mark.vm


@pytest.mark.parametrize("case", CASES, ids=ids(CASES, case_id))
def test_selftest_case(probe_diff, case):
    check_case(probe_diff, case, probe_diff.vm.facts.series)


#: The cases with the harness's module as the in-guest side (uprobe lines and -: lines have none);
#: the ones written for the module above are already there.
MODULE_CASES = [dataclasses.replace(c, guest="module") for c in CASES
                if c.guest == "events" and not any(
                    s.startswith("-") or "/" in (s.split() + ["", ""])[1] for s in c.specs)]


@pytest.mark.parametrize("case", MODULE_CASES, ids=ids(MODULE_CASES, case_id))
def test_selftest_case_with_the_module(probe_diff, case):
    check_case(probe_diff, case, probe_diff.vm.facts.series)


def test_parse_refusals_match_the_guests_error_log(kph_fresh_machine):
    """6.1's refusals on the booted kernel, as that kernel parses them: on 6.1 every line is
    refused, two without an error_log entry (``a:...``, -ECANCELED made -EINVAL, and
    ``$comm:x64``); a newer kernel words some differently (compared with its own
    error_log), logs ``$comm:x64`` (NEED_STRING_TYPE), and 7.3 takes the 65-character
    argument (MAX_ARGSTR_LEN 255)."""
    vm = kph_fresh_machine
    series = vm.facts.series
    logged, silent, accepted = check_parse_refusals(vm, PARSE, carets=series == "6.1")
    if series == "6.1":
        assert (logged, silent, accepted) == (len(PARSE) - 2, 2, 0)
    else:
        assert silent == 1 and accepted == (1 if series == "7.3" else 0)


@pytest.mark.slow
@pytest.mark.timeout(240)   # with --kph-host plugin the reserved-text tables are read via QMP
def test_multiple_kprobes_registration(kph_fresh_machine):
    """multiple_kprobes.tc: ``p SYM+5`` on the first 256 text symbols. Registration only:
    the host side registers them disabled (no breakpoints on hot early text), the guest
    through kprobe_events; every line must be accepted or refused alike."""
    vm = kph_fresh_machine
    syms = [s for s in vm.symbols if s.type in "tT" and s.module is None and "." not in s.name]
    g_out = check_registration(vm, [f"p {s.name}+5" for s in syms[:256]])
    # On 6.12 and 7.3 most of the first text symbols are __pfx_ padding or their +5 is
    # no instruction boundary: both sides refuse alike (6.12's own selftest walks on until
    # 256 register: test_selftests_newer.py).
    assert sum(o.accepted for o in g_out) >= (100 if vm.facts.series == "6.1" else 1)


def test_dot_func_is_the_one_the_selftests_loop_finds(vm):
    """``{dotfunc}`` found host-side (one read of available_filter_functions) is the
    function kprobe_eventname.tc's find_dot_func loop finds in the guest."""
    from harness.apps.selftests import dot_func

    r = vm.run("cd /sys/kernel/tracing; grep ' [tT] .*\\.isra\\..*' /proc/kallsyms | "
               "cut -f 3 -d ' ' | while read f; do "
               "[ $(grep -s $f available_filter_functions | wc -l) -eq 1 ] && "
               "echo $f && break; done", check=True, timeout=120)
    assert r.stdout.split() and dot_func(vm) == r.stdout.split()[0], r.stdout


def test_inventory():
    """docs/diff.md states how many selftest-derived cases there are and what is skipped."""
    readme = (Path(__file__).parents[2] / "docs" / "diff.md").read_text()
    total = len(CASES) + len(PARSE) + len(REGISTRATION)
    assert f"**{total} selftest-derived cases**" in readme
    assert f"{len(CASES)} differential cases" in readme and f"{len(PARSE)} parse refusals" in readme
    for what in SKIPPED:
        assert what in readme, what
