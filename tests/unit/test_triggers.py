"""Stacktrace triggers (kph diff --trigger): the items, and the verdict's rule for their
frames (harness.diff.verdict.stack_match: the probed context down, frame for frame)."""
from __future__ import annotations

import pytest

from harness.backends.triggers import UNLIMITED, parse_triggers, resolve
from harness.diff.verdict import stack_match
from harness.errors import SetupError


def test_items_parse_as_the_trigger_file_takes_them():
    assert parse_triggers(["k=stacktrace", "kprobes/r=stacktrace:2"]) == \
        {"k": UNLIMITED, "kprobes/r": 2}
    for bad in ("k", "k=traceoff", "=stacktrace", "k=stacktrace:x", "k=stacktrace:0"):
        with pytest.raises(SetupError):
            parse_triggers([bad])


def test_items_name_events_of_the_lines():
    assert resolve({"k": 1}, ["kprobes/k", "g/k", "kprobes/x"]) == {"kprobes/k": 1, "g/k": 1}
    with pytest.raises(SetupError, match="no probe line defines"):
        resolve({"nope": 1}, ["kprobes/k"])


HOST = "kernel_clone __do_sys_clone do_syscall_64 entry_SYSCALL_64_after_hwframe"


@pytest.mark.parametrize("guest,ok", [
    # 6.12's traces of a kprobe, an fprobe, a kretprobe's trampoline, an ftrace trampoline
    ("kprobe_trace_func kprobe_dispatcher aggr_pre_handler kprobe_ftrace_handler "
     "arch_ftrace_ops_list_func ftrace_regs_call " + HOST, True),
    ("fentry_trace_func fentry_dispatcher fprobe_handler arch_ftrace_ops_list_func "
     "ftrace_regs_call " + HOST, True),
    ("kprobe_trace_func kprobe_dispatcher kprobe_ftrace_handler 0xffffffffc020d0de " + HOST,
     True),
    (HOST, True),
    # the ops trampoline named after the last symbol of the module whose range holds it
    ("kprobe_trace_func kprobe_dispatcher kprobe_ftrace_handler pvpanic_pci_driver_exit "
     + HOST, True),
    ("fentry_trace_func fentry_dispatcher fprobe_ftrace_entry some_module_exit " + HOST, True),
    # not the probe's machinery on top, another frame below, a frame missing
    ("vfs_read " + HOST, False),
    ("kprobe_trace_func 0xffffffff81000000 " + HOST, False),
    ("kprobe_trace_func kernel_clone __do_sys_clone3 do_syscall_64 "
     "entry_SYSCALL_64_after_hwframe", False),
    ("kprobe_trace_func kernel_clone do_syscall_64 entry_SYSCALL_64_after_hwframe", False),
    # a named frame is a trampoline only directly under an ops callback, and only one
    ("kprobe_trace_func kprobe_dispatcher pvpanic_pci_driver_exit " + HOST, False),
    ("kprobe_trace_func kprobe_ftrace_handler vfs_read pvpanic_pci_driver_exit " + HOST, False),
])
def test_the_guest_trace_is_the_hosts_under_its_probe_machinery(guest, ok):
    assert stack_match(HOST, guest) is ok
