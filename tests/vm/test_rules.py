"""Each rule of ``harness.kernel.rules`` checked in the guest of every kernel series it
names: a line that tells the series apart is parsed host-side as that kernel's rules say
and written to that kernel's ``kprobe_events``; both sides must accept it, or refuse it
with the same ``error_log`` text, caret and errno. Then ``kph matrix`` on the shipped
example: host and guest agree on each kernel, and the kernels differ where the README
says they do."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from selftests import check_lines

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

SERIES = ("6.1", "6.12", "7.3")

#: One line (or a few) per rule; each kernel answers them its own way.
RULE_LINES = {
    "maxact_on_kprobe": ["p100 vfs_read"],
    "symbol_check": ["p events_show", "p pvpanic:no_such_function", "r pvpanic:capability_show+3",
                     "r vfs_read+10"],
    "symbols_vmlinux_first": ["p capability_show", "p events_show"],
    "fentry_on_return": ["r vfs_read $arg1", "r vfs_read x=$arg2:u32"],
    "btf_args": ["p vfs_read file count", "p vfs_read $arg*", "r kfree $retval",
                 "p vfs_read file->f_pos", "r vfs_read ret=$retval", "p vfs_read hoge",
                 "p kfree $arg10", "p vfs_read+4 $arg1", "p vfs_read file.f_pos"],
    "fetch_types": ["p vfs_read +0(%si):char", "p vfs_read @linux_proc_banner:char[4]"],
    "dentry_types": ["p dput $arg1:%pd", "p vfs_read n=$arg1:%pD"],
    "comm_type_logged": ["p vfs_read $comm:x64", "p vfs_read $comm:string[2]"],
    "max_argstr_len": ["p vfs_read " + "+1(" * 20 + "%ax" + ")" * 20],
    "too_many_args": ["p vfs_read " + " ".join(f"\\{i}" for i in range(1, 130)),
                      "p /bin/sh:10 " + " ".join(f"\\{i}" for i in range(1, 130))],
    "current_var": ["p vfs_read $current", "p vfs_read pid=$current->pid",
                    "p /bin/sh:10 $current:u8"],
    "this_cpu": ["p vfs_read c=this_cpu_read(@this_cpu_off)", "p vfs_read this_cpu_ptr(%di)",
                 "p /bin/sh:10 this_cpu_read(@1)"],
    "typecasts": ["p vfs_read n=(file,f_path)file->f_mode", "p vfs_read n=(task_struct)file",
                  "p vfs_read (a)(b)(c)(d)(e)(f)(g)(h)(i)file->x"],
    "max_nested": ["p vfs_read +0(+0(+0(+0(+0(+0(+0(+0(+0(@0)))))))))"],
    "uprobe_no_symbol_types": ["p /bin/sh:10 $stack0:symstr", "p /bin/sh:10 %ax:symbol"],
    "arg_parser": ["p vfs_read +u0(+0(%di)", "p vfs_read +0(%di):b10@a/16",
                   "p /bin/sh:10 $arg1", "p /bin/sh:10 file"],
}


@pytest.fixture
def machine(request):
    from harness.errors import HarnessError
    from harness.machine.image.build import build_image
    from harness.machine.image.store import default_image
    from harness.apps.pytest_plugin import _boot_opts, boot_machine

    series = request.node.callspec.params["series"]
    try:
        img = default_image(series)
    except HarnessError:
        img = build_image(kernel=series, progress=lambda s: None)
    with boot_machine(img, **_boot_opts(request.config)) as vm:
        yield vm


@pytest.mark.parametrize("series", SERIES)
def test_rules_in_the_guest(series, machine):
    """Every rule's lines on one kernel (one machine: each line leaves nothing behind)."""
    bad = [f"{rule}: {b}" for rule in sorted(RULE_LINES)
           for b in check_lines(machine, RULE_LINES[rule])]
    assert not bad, f"on {series}:\n" + "\n".join(bad)


def test_matrix_example_agrees_on_each_kernel_and_shows_what_changed():
    """docs/matrix.md's example: exit 0 (host = guest on 6.1, 6.12, 7.3); the entry probe at
    +4 on the IBT kernels; ``$retval`` of kernel_clone in hex on 6.1, decimal after."""
    root = Path(__file__).parents[2]
    r = subprocess.run([sys.executable, "-m", "harness.cli", "matrix", "-f",
                        str(root / "probes/examples/matrix.spec"), "--run",
                        'sh -c "true & wait"', "--kernels", "6.1,6.12,7.3"],
                       capture_output=True, text=True, timeout=280, cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stderr              # the text report (the CLI's convention: stdout is --json only)
    assert "kernel_clone+0x0 (6.1) | kernel_clone+0x4 (6.12, 7.3)" in out, out
    assert "printed in hex on 6.1 and in decimal on 6.12, 7.3" in out, out


#: A uretprobe reading just below the returned-to stack pointer: what the kernel's
#: trampoline left there (``uretprobe_syscall``), next to the registers it pushed.
URET_FRAME = ("r /usr/bin/kph-loop:kph_add a=-8($stack) ax=%ax c=-16($stack) cx=%cx "
              "e=-24($stack) r11=%r11")


@pytest.mark.parametrize("series", SERIES)
@pytest.mark.parametrize("side", ["events", "gdbstub", "plugin"])
def test_uretprobe_trampoline_frame_below_sp(series, side):
    """``uretprobe_syscall``: on 6.12 and 7.3 a 64-bit process returns into
    ``uretprobe_trampoline_entry`` (push rax, rcx, r11; ``sys_uretprobe()``), so a handler
    sees rax, rcx and r11 at sp-8, -16, -24. On 6.1 the trampoline is one int3 and sp-8
    still holds what ``ret`` popped: the trampoline's address, never the return value.
    The guest shows the rule; each host engine, alone on the execution, must mirror it
    (found by ``kph fuzz`` on 7.3: the host read the function's leftovers there)."""
    from harness.kernel.rules import rules_for

    cmd = [sys.executable, "-m", "harness.cli", "probe", "--image", series, "--json", URET_FRAME,
           "--run", "/usr/bin/kph-loop 2 kph > /dev/null"]
    cmd += ["--backend", "events"] if side == "events" else ["--backend", "host", "--host", side]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                       cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr
    hits = json.loads(r.stdout)["hits"]
    assert len(hits) == 2, r.stdout
    for hit in hits:
        args = dict(hit["args"])
        if rules_for(series).uretprobe_syscall:
            assert (args["a"], args["c"], args["e"]) == (args["ax"], args["cx"], args["r11"]), args
        else:
            assert args["a"] != args["ax"] and int(args["a"], 16) > 0x400000, args
