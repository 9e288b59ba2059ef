"""Linux 6.12's and 7.3's own probe definitions as data (Debian's linux-source-6.12,
6.12.117, and linux-source-7.3, 7.3.4: tools/testing/selftests/ftrace/test.d/kprobe/*.tc and
the test.d/dynevent/*.tc that write kprobe, uprobe, fprobe, tracepoint-probe or event-probe
definitions), each series' own, as :mod:`harness.apps.selftests` holds 6.1's:

- ``CASES[series]``: accepted lines, or lines refused at registration, with a workload
  that hits them (BTF-typed ``$retval``, BTF argument names, ``char``, ``%pd``, entry
  arguments of return probes, 7.3's casts and ``$current``);
- ``PARSE[series]``: lines that kernel refuses while parsing them;
- ``REGISTRATION``: many-probe selftests;
- ``FPROBE_CASES[series]`` and ``FPARSE[series]``: the ``f:`` and ``t:`` lines;
- ``EPROBE_CASES[series]`` and ``EPARSE[series]``: the ``e:`` lines and refused filters;
- ``SKIPPED[series]``: what cannot run here, each with the reason.

Checked by ``tests/vm/test_selftests_newer.py``; run by ``kph hunt`` on those kernels.
"""
from __future__ import annotations

from .selftests import (ACCEPT, ANY, EEXIST_ARG, EEXIST_EVENT, EEXIST_SAME, EEXIST_TYPE, FORK,
                        FTRACE, MKEVENT, MKINST, OPEN, PROBEFUNC, PVPANIC, READ, STAND_IN,
                        SYMLINK, C)

NEWER = ("6.12", "7.3")


def _good(arg, workload=READ, expect="hit", note=""):
    return C("kprobe/kprobe_args_syntax.tc", f"p {PROBEFUNC} {arg}", workload, expect, note=note)


# ---------------------------------------------------------------- 6.12 (7.3 has them too)

_KPROBE = [
    C("kprobe/add_and_remove.tc", "p:myevent kernel_clone", FORK),
    C("kprobe/busy_check.tc", "p:myevent kernel_clone", FORK),
    C("kprobe/profile.tc", "p:myevent kernel_clone", FORK),
    C("kprobe/kprobe_args.tc", "p:testprobe kernel_clone $stack $stack0 +0($stack)", FORK),
    C("kprobe/kprobe_args_char.tc", "p:testprobe {dirfunc} arg1=+0(%di):char", MKEVENT),
    C("kprobe/kprobe_args_char.tc",
      "p:testprobe {dirfunc} arg1=+0(%di):char arg2=+0(%di):char[4]", MKEVENT),
    C("kprobe/kprobe_args_comm.tc", "p:testprobe kernel_clone comm=$comm", FORK),
    C("kprobe/kprobe_args_string.tc", "p:testprobe {dirfunc} arg1=+0(%di):string", MKEVENT),
    C("kprobe/kprobe_args_string.tc",
      "p:testprobe {dirfunc} arg1=+0(%di):string arg2=+0(%di):string", MKEVENT),
    C("kprobe/kprobe_args_symbol.tc", [
        "p:testprobe_u kernel_clone arg1=@linux_proc_banner:u64 arg2=@linux_proc_banner:u32 "
        "arg3=@linux_proc_banner:u16 arg4=@linux_proc_banner:u8",
        "p:testprobe_s kernel_clone arg1=@linux_proc_banner:s64 arg2=@linux_proc_banner:s32 "
        "arg3=@linux_proc_banner:s16 arg4=@linux_proc_banner:s8",
        "p:testprobe_x kernel_clone arg1=@linux_proc_banner:x64 arg2=@linux_proc_banner:x32 "
        "arg3=@linux_proc_banner:x16 arg4=@linux_proc_banner:x8",
        "p:testprobe_bf kernel_clone arg1=@linux_proc_banner:b8@4/32"], FORK),
    C("kprobe/kprobe_args_symbol.tc", "p:testprobe_str kernel_clone arg1=@linux_proc_banner:string",
      FORK),
    *[_good(a) for a in ("%ax", "@_sdata", "@{sym:_sdata}", "@_sdata+10", "@_sdata-10",
                         "$stack", "$stack0", "$stack1", "$comm", "+0(%ax)", "-0(%ax)",
                         "+10($stack)", "+0($stack1)", "+10(@_sdata-10)",
                         "+0(+10(+20($stack)))", "varname=%ax", "%ax:x16", "$comm:string",
                         "+0($stack):string")],
    # typed from BTF on these kernels: vfs_read returns ssize_t, printed as s64
    C("kprobe/kprobe_args_syntax.tc", f"r {PROBEFUNC} $retval", READ),
    _good("+0(%ax)+10", note="the selftest calls it bad; the kernel takes it (parse_probe_arg() "
          "ignores what follows the last ')')"),
    *[C("kprobe/kprobe_args_syntax.tc", f"p {PROBEFUNC} {arg}", "true",
        "ENOENT: Invalid probed address or symbol")
      for arg in ("@", "@deaqswdefr", "@_sdata*10", "@_sdata/10", "@_sdata%10", "@_sdata&10",
                  "@_sdata|10")],
    *[C("kprobe/kprobe_args_type.tc",
        f"p:testprobe kernel_clone $stack0:s{w} $stack0:u{w} $stack0:x{w} $stack0:b4@4/{w}", FORK)
      for w in (64, 32, 16, 8)],
    C("kprobe/kprobe_args_user.tc", [
        "p:myevent do_sys_open path=+0($arg2):ustring path2=+u0($arg2):string",
        "p:myevent2 do_sys_openat2 path=+0($arg2):ustring path2=+u0($arg2):string"], OPEN,
      "ok", "hit", note="nothing in the image calls open(2)"),
    C("kprobe/kprobe_args_user.tc",
      "p:myevent vfs_symlink path=+0($arg3):ustring path2=+u0($arg3):string", SYMLINK),
    # %pd/%pD: rewritten by traceprobe_expand_dentry_args() with this kernel's offsets
    C("kprobe/kprobe_args_vfs.tc", "p:testprobe dput name=$arg1:%pd", READ),
    C("kprobe/kprobe_args_vfs.tc", "p:testprobe dput $arg1:%pd", READ),
    C("kprobe/kprobe_args_vfs.tc", "p:testprobe vfs_read name=$arg1:%pD", READ),
    C("kprobe/kprobe_args_vfs.tc", "p:testprobe vfs_read $arg1:%pD", READ),
    C("kprobe/kprobe_eventname.tc", f"p {PROBEFUNC}", READ),
    C("kprobe/kprobe_eventname.tc", f"p:event1 {PROBEFUNC}", READ),
    C("kprobe/kprobe_eventname.tc", f"p:kprobes2/event2 {PROBEFUNC}", READ),
    C("kprobe/kprobe_eventname.tc", "p {dotfunc}", ANY, "ok",
      note="find_dot_func: the first .isra. function with one ftrace location"),
    C("kprobe/kprobe_ftrace.tc", "p:testprobe kernel_clone", FTRACE),
    C("kprobe/kprobe_module.tc", f"p {STAND_IN}", PVPANIC),
    C("kprobe/kprobe_module.tc", f"p:event1 {STAND_IN}", PVPANIC),
    C("kprobe/kprobe_module.tc", f"p:kprobes1/event1 {STAND_IN}", PVPANIC),
    C("kprobe/kprobe_module.tc", "p:event2 trace_printk:trace_printk_irq_work", "true",
      "pending"),
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit"], FORK),
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit",
                                      "p:kprobes/testevent kernel_clone $stack"], FORK,
      "hit", "hit", EEXIST_ARG),
    # "-:EVENT" removes both probes; "-:EVENT SYM1" only kernel_clone's (dyn_event_release())
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit",
                                      "-:kprobes/testevent"], FORK, "ok", "ok", "ok"),
    C("kprobe/kprobe_multiprobe.tc", ["p:kprobes/testevent kernel_clone",
                                      "p:kprobes/testevent do_exit",
                                      "-:kprobes/testevent kernel_clone"], FORK, "ok", "hit", "ok"),
    C("kprobe/kprobe_syntax_errors.tc", "p vfs_read+3", "true",
      "EILSEQ: Probe point is not an instruction boundary"),
    C("kprobe/kprobe_syntax_errors.tc", ["p:kprobes/testevent kernel_clone",
                                         "r:kprobes/testevent do_exit"], FORK, "hit", EEXIST_TYPE),
    C("kprobe/kprobe_syntax_errors.tc", [
        "p:kprobes/testevent kernel_clone abcd=\\1",
        "p:kprobes/testevent kernel_clone bcd=\\1",
        "p:kprobes/testevent kernel_clone abcd=\\1:u8",
        "p:kprobes/testevent kernel_clone abcd=\\\"foo\"",
        "p:kprobes/testevent kernel_clone abcd=\\1"], FORK,
      "hit", EEXIST_ARG, EEXIST_ARG, EEXIST_ARG, EEXIST_SAME),
    # BTF-typed: kernel_clone returns pid_t (int), printed in decimal
    C("kprobe/kretprobe_args.tc", "r:testprobe2 kernel_clone $retval", FORK),
    # $arg1 of a return probe: saved by the kretprobe's entry handler (FETCH_OP_EDATA)
    C("kprobe/kretprobe_entry_arg.tc", ["p:myevent1 vfs_open arg=$arg1",
                                        "r:myevent2 vfs_open arg=$arg1"], OPEN),
    C("kprobe/kretprobe_maxactive.tc", "r:myprobeaccept inet_csk_accept", ACCEPT),
    C("kprobe/kretprobe_maxactive.tc", "r10:myprobeaccept inet_csk_accept", ACCEPT),
    C("kprobe/kretprobe_maxactive.tc", "r inet_csk_accept", ACCEPT),
    C("kprobe/kretprobe_maxactive.tc", "r10 inet_csk_accept", ACCEPT),
    C("kprobe/kretprobe_return_suffix.tc", "r:myprobeaccept vfs_read", READ),
    C("kprobe/kretprobe_return_suffix.tc", "p:myprobeaccept vfs_read%return", READ),
    C("kprobe/probepoint.tc", "p:testprobe tracefs_create_dir", MKINST),
    C("kprobe/probepoint.tc", "p:testprobe {sym:tracefs_create_dir}", MKINST),
    C("kprobe/probepoint.tc", "p:testprobe tracefs_create_dir{next:tracefs_create_dir}",
      "true", "ok"),
    C("kprobe/uprobe_syntax_errors.tc", "p /non_exist_file:100", "true",
      "ENOENT: Failed to find the given file"),
    C("kprobe/uprobe_syntax_errors.tc", "p /sys:100", "true", "EINVAL: Not a regular file"),
    C("dynevent/add_remove_btfarg.tc", "p:kpevent kfree object", ANY),
    C("dynevent/add_remove_btfarg.tc", "p:kpevent kfree $arg*", ANY),
    C("dynevent/add_remove_kprobe.tc", ["p:myevent1 kernel_clone", "r:myevent2 kernel_clone"],
      FORK),
    C("dynevent/add_remove_kprobe.tc", "p:mygroup/ kernel_clone", FORK),
    C("dynevent/test_duplicates.tc", ["p:kgroup/kevent vfs_open file=+0($arg2)",
                                      "p:kgroup/kevent vfs_open file=+0($arg2)",
                                      "p:syscalls/sys_enter_open vfs_open file=+0($arg2)"],
      OPEN, "hit", EEXIST_SAME, EEXIST_EVENT),
]

_PARSE_COMMON = [
    *[("kprobe/kprobe_syntax_errors.tc", ln) for ln in (
        "p^100 vfs_read", "r^1a111 vfs_read", "r^100000 vfs_read", "p ^non_exist_func",
        "p ^hoge-fuga", "p ^hoge+1000-1000", "r ^vfs_read+10", "p:^/bar vfs_read",
        "p:^12345678901234567890123456789012345678901234567890123456789012345/bar vfs_read",
        "p:^foo.1/bar vfs_read", "p:^ vfs_read",
        "p:foo/^12345678901234567890123456789012345678901234567890123456789012345 vfs_read",
        "p:foo/^bar.1 vfs_read", "p vfs_read ^$retval", "p vfs_read ^$stack10000",
        "p vfs_read ^$arg10000", "p vfs_read ^$none_var", "p vfs_read ^%none_reg",
        "p vfs_read ^@12345678abcde", "p vfs_read ^@+10", "p vfs_read arg1=\\^x",
        "p vfs_read arg1=\\\"abcd^", "p vfs_read ^+0@0)", "p vfs_read ^+0ab1(@0)",
        "p vfs_read +0(+0(@0^)", "p vfs_read +0(^$comm)", "p vfs_read ^&1",
        "p vfs_read +0(@11):u8[10^", "p vfs_read +0(@11):u8[10]^a",
        "p vfs_read +0(@11):u8[^10a]", "p vfs_read +0(@11):u8[^256]",
        "p vfs_read @11:^unknown_type", "p vfs_read $stack0:^string", "p vfs_read @11:^b10@a/16",
        "p vfs_read ^arg123456789012345678901234567890=@11", "p vfs_read ^=@11",
        "p vfs_read ^var.1=@11", "p vfs_read var1=@11 ^var1=@12", "p vfs_read arg1=^",
        "p vfs_read^%hoge", "p ^vfs_read+10%return",
        # BTF arguments (the selftest's BAD_VAR_ARGS is logged as BAD_VAR by the kernel)
        "p vfs_read args=^$arg*", "p vfs_read +0(^$arg*)", "p vfs_read $arg* ^$arg*",
        "p vfs_read+20 ^$arg*", "p vfs_read ^hoge", "p kfree ^$arg10", "r kfree ^$retval")],
    *[("kprobe/kprobe_args_syntax.tc", f"p {PROBEFUNC} {arg}") for arg in (
        "%ex", "$stackp", "$stack0+10", "$stack1-10", "$retval", "+(%ax)", "(%ax+10)",
        "-(%ax)", "(%ax)", "+10($comm)", "varname=varname2=%ax", "%ax::x16", "%ax:y16",
        "x16:%ax", "$comm:x64", "$stack:string", "%ax:string")],
    ("kprobe/kretprobe_maxactive.tc", "a:myprobeaccept inet_csk_accept"),
    ("kprobe/kretprobe_maxactive.tc", "r1000000:myprobeaccept inet_csk_accept"),
    ("kprobe/kretprobe_maxactive.tc", "r10fuzz:myprobeaccept inet_csk_accept"),
    ("kprobe/kprobe_non_uniq_symbol.tc", "p:test_non_unique name_show"),
    ("kprobe/probepoint.tc", "p:testprobe tracefs_create_dir{prev:tracefs_create_dir}"),
    ("kprobe/probepoint.tc", "p:testprobe tracefs_create_dir{overflow:tracefs_create_dir}"),
    *[("kprobe/uprobe_syntax_errors.tc", ln) for ln in (
        "p /bin/sh:^10a", "p /bin/sh:10(^1a)", "p /bin/sh:10(10^", "p /bin/sh:10(10)^a",
        "p /bin/sh:10 ^@+ab", "p /bin/sh:10 ^@symbol", "p /bin/sh:10^%hoge",
        "p /bin/sh:10(10)^%return", "p /bin/sh:10 $stack0:^symstr")],
]

# ---------------------------------------------------------------- 7.3's additions

_ARGS128 = " ".join(f"\\{i}" for i in range(1, 129))

_KPROBE_7_3 = [
    # kprobe_module.tc: a module function named without its module
    C("kprobe/kprobe_module.tc", "p:event0 capability_show", PVPANIC),
    # btf_typecast_accepted.tc, the kprobe lines (kpevent9/10 need trace-events-sample)
    C("dynevent/btf_typecast_accepted.tc",
      "p:kpevent1 vfs_read name=(file)file->f_path.dentry->d_name.name:string", READ),
    C("dynevent/btf_typecast_accepted.tc",
      "p:kpevent2 vfs_read name=(file)(file)->f_path.dentry->d_name.name:string", READ),
    C("dynevent/btf_typecast_accepted.tc",
      "p:kpevent3 vfs_read name=(dentry)((file)file->f_path.dentry)->d_name.name:string", READ),
    C("dynevent/btf_typecast_accepted.tc", "p:kpevent4 vfs_read name=(file,f_path)file->f_mode",
      READ),
    C("dynevent/btf_typecast_accepted.tc",
      "r:kpevent5 vfs_read name=(file)$retval->f_path.dentry->d_name.name:string", READ),
    C("dynevent/btf_typecast_accepted.tc", "p:kpevent6 vfs_read pid=$current->pid", READ),
    C("dynevent/btf_typecast_accepted.tc", "p:kpevent7 vfs_read pid=(task_struct)$current->pid",
      READ),
    C("dynevent/btf_typecast_accepted.tc",
      "p:kpevent8 vfs_read pid=(task_struct,group_leader)$current->pid", READ),
    # dynevent_limitations.tc: 128 arguments, then one more
    C("dynevent/dynevent_limitations.tc", f"p vfs_read {_ARGS128}", READ),
    C("dynevent/dynevent_limitations.tc", f"p /bin/sh:10 {_ARGS128}", "true", "ok"),
]

_PARSE_7_3 = [
    ("kprobe/kprobe_syntax_errors.tc",
     "p vfs_read +0(+0(+0(+0(+0(+0(+0(+0(^+0(@0)))))))))"),
    ("kprobe/kprobe_syntax_errors.tc", "p vfs_read ^+1234567(" * 1 + "+1234567(" * 25 + "@1234"
     + ")" * 26),
    *[("kprobe/kprobe_syntax_errors.tc", ln) for ln in (
        "p vfs_read arg1=(task_struct)file^",
        "p vfs_read arg1=(a)((b)((c)((d)((e)((f)((g)((h)(^(i)file->i)->h)->g)->f)->e)->d)"
        "->c)->b)->a",
        "p vfs_read arg1=(task_struct,^in_execve)file->comm",
        "p vfs_read arg1=(task_struct,^foo_bar)file->pid",
        "p vfs_read arg1=(^task_struct1234)file->pid",
        "p vfs_read arg1=(task_struct,se^->group_node)file->comm",
        "p vfs_read arg1=(task_struct,^->pid)file->comm",
        "p vfs_read arg1=(task_struct,^.pid)file->comm",
        "p vfs_read arg1=(task_struct,^.)file->comm",
        "p vfs_read arg1=(task_struct)^@symbol+10->comm")],
    ("kprobe/uprobe_syntax_errors.tc", "p /bin/sh:10 ^$current:u8"),
    # dynevent_limitations.tc: one argument past MAX_TRACE_ARGS (TOO_MANY_ARGS at the first)
    ("dynevent/dynevent_limitations.tc", f"p vfs_read ^{_ARGS128} \\129"),
    ("dynevent/dynevent_limitations.tc", f"p /bin/sh:10 ^{_ARGS128} \\129"),
]

_PARSE_6_12 = [
    ("kprobe/kprobe_syntax_errors.tc",
     "p vfs_read +0(^+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(@0))))))))))))))"),
    ("kprobe/kprobe_syntax_errors.tc",
     "p vfs_read ^+1234567(+1234567(+1234567(+1234567(+1234567(+1234567(@1234))))))"),
]

CASES = {"6.12": _KPROBE, "7.3": _KPROBE + _KPROBE_7_3}
PARSE = {"6.12": _PARSE_COMMON + _PARSE_6_12, "7.3": _PARSE_COMMON + _PARSE_7_3}
REGISTRATION = [
    ("kprobe/multiple_kprobes.tc", "p SYM+5 on text symbols without a dot, from the first, "
     "until 256 register, as the selftest walks /proc/kallsyms"),
    ("kprobe/kprobe_insn_boundary.tc", "p kernel_clone+N for N in 0..255"),
    ("kprobe/kprobe_opt_types.tc", "p:testprobe kernel_clone+N for the first N the guest "
     "optimizes ([OPTIMIZED]), then a fork on both sides"),
]

# ---------------------------------------------------------------- fprobe events (f:)

#: Each kernel's fprobe selftests: accepted lines run on both sides, and the lines
#: fprobe_syntax_errors.tc expects refused at registration or against an existing event.
def _einval(want: str) -> str:
    return "EINVAL:" + want.split(":", 1)[1]


_NO_MATCH = {"6.12": "EINVAL: Failed to register probe event",
             "7.3": "EINVAL: Invalid probed address or symbol"}


def _add_remove(source: str, first: str, second: str) -> list:
    """add_remove_{fprobe,tprobe}.tc: two events, then ``-:myevent2``."""
    lines = [f"{first[0]}:myevent1 {first[1:]}", f"{second[0]}:myevent2 {second[1:]}"]
    return [C(source, lines, FORK), C(source, lines + ["-:myevent2"], FORK, "hit", "ok", "ok")]


def _append_errors(source: str, head: str, place: str) -> list:
    """{fprobe,tprobe}_syntax_errors.tc's appends to an existing event: other arguments,
    then the same probe (7.3 makes every such refusal EINVAL)."""
    lines = [f"{head} {place} abcd=\\1", f"{head} {place} bcd=\\1",
             f"{head} {place} abcd=\\1:u8", f'{head} {place} abcd=\\"foo"',
             f"{head} {place} abcd=\\1"]
    want = (EEXIST_ARG,) * 3 + (EEXIST_SAME,)
    return [C(source, lines, FORK, "hit", *want,
              expect_by={"7.3": ("hit", *map(_einval, want))})]


_FPROBE = [
    *_add_remove("dynevent/add_remove_fprobe.tc", "fkernel_clone", "fkernel_clone%return"),
    C("dynevent/add_remove_btfarg.tc", "f:fpevent kfree object", FORK),
    C("dynevent/add_remove_btfarg.tc", "f:fpevent kfree $arg1", FORK),
    C("dynevent/add_remove_btfarg.tc", "f:fpevent kfree $arg*", FORK),
    C("dynevent/add_remove_btfarg.tc",
      "f:fpevent getname_flags%return path=$retval->name:string", OPEN),
    C("dynevent/fprobe_args_vfs.tc", "f:testprobe dput name=$arg1:%pd", READ),
    C("dynevent/fprobe_args_vfs.tc", "f:testprobe dput $arg1:%pd", READ),
    C("dynevent/fprobe_args_vfs.tc", "f:testprobe vfs_read name=$arg1:%pD", READ),
    C("dynevent/fprobe_args_vfs.tc", "f:testprobe vfs_read $arg1:%pD", READ),
    C("dynevent/fprobe_entry_arg.tc", ["f:tests/myevent1 vfs_open arg=$arg1",
                                       "f:tests/myevent2 vfs_open%return arg=$arg1"], OPEN),
    *[C("dynevent/fprobe_syntax_errors.tc", line, "true", _NO_MATCH["6.12"],
        expect_by={"7.3": (_NO_MATCH["7.3"],)})
      for line in ("f non_exist_func", "f vfs_read+10")],
    # 7.3's trace_fprobe_create_internal() returns -EINVAL for any registration failure
    C("dynevent/fprobe_syntax_errors.tc", ["f:fprobes/testevent kernel_clone",
                                           "f:fprobes/testevent do_exit%return"], FORK,
      "hit", EEXIST_TYPE, expect_by={"7.3": ("hit", _einval(EEXIST_TYPE))}),
    *_append_errors("dynevent/fprobe_syntax_errors.tc", "f:fprobes/testevent", "kernel_clone"),
    # several fprobes on one function, each kind, with the return slot read at the entry
    # after (and before) an exit fprobe hooked it
    C("dynevent/add_remove_fprobe.tc", ["f:a kernel_clone $stack0", "f:b kernel_clone%return",
                                        "f:c kernel_clone $stack0 $arg1",
                                        "p:k kernel_clone $stack0"], FORK),
]
_FPROBE_7_3 = [
    C("dynevent/add_remove_multiple_fprobe.tc", ["f:event1 vfs_read", "f:event2 vfs_read%return",
                                                 "f:event3 vfs_open%return"], f"{READ}; {OPEN}"),
    C("dynevent/add_remove_fprobe_repeat.tc", "f:myevent kernel_clone", FORK),
    *[C("dynevent/btf_typecast_accepted.tc", line, READ) for line in (
        "f:fpevent1 vfs_read name=(file)file->f_path.dentry->d_name.name:string",
        "f:fpevent2 vfs_read name=(file)(file)->f_path.dentry->d_name.name:string",
        "f:fpevent3 vfs_read name=(dentry)((file)file->f_path.dentry)->d_name.name:string",
        "f:fpevent4 vfs_read name=(file,f_path)file->f_mode",
        "f:fpevent5 vfs_read%return name=(file)$retval->f_path.dentry->d_name.name:string",
        "f:fpevent6 vfs_read pid=$current->pid",
        "f:fpevent7 vfs_read pid=(task_struct)$current->pid",
        "f:fpevent8 vfs_read pid=(task_struct,group_leader)$current->pid")],
]
#: Tracepoint probes (t:): an fprobe on the tracepoint's stub, __probestub_TP.
_TPROBE = [
    *_add_remove("dynevent/add_remove_tprobe.tc", "tkmem_cache_alloc", "tkmem_cache_free"),
    C("dynevent/add_remove_btfarg.tc", "t:tpevent kfree ptr", FORK),
    C("dynevent/add_remove_btfarg.tc", "t:tpevent kfree $arg*", FORK),
    C("dynevent/add_remove_btfarg.tc", ["f:fpevent kfree object", "t:tpevent kfree ptr"], FORK),
    C("dynevent/add_remove_btfarg.tc", "t:tpevent kmem_cache_alloc obj_size=s->object_size",
      FORK),
    # a tracepoint the kernel lacks may come with a module: accepted, nothing registered
    C("dynevent/add_remove_tprobe_module.tc", "t:myevent1 foo_bar", "true", "pending"),
    # on a tracepoint the idle task does not hit, for both engines: the fork's own
    C("dynevent/add_remove_btfarg.tc",
      "t:fk sched_process_fork pp=parent->pid cp=child->pid $arg1 comm=$comm", FORK),
    # 6.12 puts the same stub on a tracepoint for every t: event, and the second time
    # tracepoint_add_func() refuses it: -EEXIST, nothing logged (7.3 puts it on once)
    C("dynevent/add_remove_btfarg.tc", ["t:a kfree", "t:b kfree ptr"], FORK,
      "hit", "EEXIST", expect_by={"7.3": ("hit", "hit")}),
    C("dynevent/tprobe_syntax_errors.tc", ["t:tracepoint/testevent kfree",
                                           "f:tracepoint/testevent kfree"], FORK,
      "hit", EEXIST_TYPE, expect_by={"7.3": ("hit", _einval(EEXIST_TYPE))}),
    *_append_errors("dynevent/tprobe_syntax_errors.tc", "t:tracepoints/testevent", "kfree"),
]
_TPROBE_7_3 = [C("dynevent/enable_disable_tprobe.tc", "t:myprobe sched_switch", FORK)]
FPROBE_CASES = {"6.12": _FPROBE + _TPROBE, "7.3": _FPROBE + _FPROBE_7_3 + _TPROBE + _TPROBE_7_3}

#: fprobe_syntax_errors.tc's parse errors (caret where the selftest puts it).
_FPARSE_COMMON = [("dynevent/fprobe_syntax_errors.tc", line) for line in (
    "f:^/bar vfs_read",
    "f:^12345678901234567890123456789012345678901234567890123456789012345/bar vfs_read",
    "f:^foo.1/bar vfs_read", "f:^ vfs_read",
    "f:foo/^12345678901234567890123456789012345678901234567890123456789012345 vfs_read",
    "f:foo/^bar.1 vfs_read", "f vfs_read ^$stack10000", "f vfs_read ^$arg10000",
    "f vfs_read ^$none_var", "f vfs_read ^%ax", "f vfs_read ^@12345678abcde",
    "f vfs_read ^@+10", "f vfs_read arg1=\\^x", 'f vfs_read arg1=\\"abcd^',
    "f vfs_read ^+0@0)", "f vfs_read ^+0ab1(@0)", "f vfs_read +0(+0(@0^)",
    "f vfs_read +0(^$comm)", "f vfs_read ^&1", "f vfs_read +0(@11):u8[10^",
    "f vfs_read +0(@11):u8[10]^a", "f vfs_read +0(@11):u8[^10a]", "f vfs_read +0(@11):u8[^256]",
    "f vfs_read @11:^unknown_type", "f vfs_read $stack0:^string", "f vfs_read @11:^b10@a/16",
    "f vfs_read ^arg123456789012345678901234567890=@11", "f vfs_read ^=@11",
    "f vfs_read ^var.1=@11", "f vfs_read var1=@11 ^var1=@12", "f vfs_read arg1=^",
    "f vfs_read^%hoge", "f vfs_read args=^$arg*", "f vfs_read +0(^$arg*)",
    "f vfs_read $arg* ^$arg*", "f vfs_read ^hoge", "f kfree ^$arg10",
    "f kfree%return ^$retval", "f vfs_read%return $retval->^foo", "f vfs_read file->^foo",
    "f vfs_read file^-.foo", "f vfs_read ^file:string")]
FPARSE = {
    "6.12": _FPARSE_COMMON + [("dynevent/fprobe_syntax_errors.tc", line) for line in (
        "f^100 vfs_read", "f^1a111 vfs_read", "f^100000 vfs_read",
        "f vfs_read +0(^+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(@0))))))))))))))",
        "f vfs_read ^+1234567(+1234567(+1234567(+1234567(+1234567(+1234567(@1234))))))")],
    "7.3": _FPARSE_COMMON + [("dynevent/fprobe_syntax_errors.tc", line) for line in (
        "f^100 vfs_read", "f vfs_read +0(+0(+0(+0(+0(+0(+0(+0(^+0(@0)))))))))",
        "f vfs_read ^" + "+1234567(" * 26 + "@1234" + ")" * 26,
        "f vfs_read arg1=(task_struct)file^",
        "f vfs_read arg1=(a)((b)((c)((d)((e)((f)((g)((h)(^(i)file->i)->h)->g)->f)->e)->d)->c)"
        "->b)->a",
        "f vfs_read arg1=(task_struct,^in_execve)file->comm",
        "f vfs_read arg1=(task_struct,^foo_bar)file->pid",
        "f vfs_read arg1=(^task_struct1234)file->pid",
        "f vfs_read arg1=(task_struct,se^->group_node)file->comm",
        "f vfs_read arg1=(task_struct,^->pid)file->comm",
        "f vfs_read arg1=(task_struct,^.pid)file->comm",
        "f vfs_read arg1=(task_struct,^.)file->comm",
        "f vfs_read arg1=(task_struct)^@symbol+10->comm")],
}

#: tprobe_syntax_errors.tc's parse errors.
_TPARSE_COMMON = [("dynevent/tprobe_syntax_errors.tc", line) for line in (
    "t^100 kfree", "t:^/bar kfree",
    "t:^12345678901234567890123456789012345678901234567890123456789012345/bar kfree",
    "t:^foo.1/bar kfree", "t:^ kfree",
    "t:foo/^12345678901234567890123456789012345678901234567890123456789012345 kfree",
    "t:foo/^bar.1 kfree", "t kfree ^$retval", "t kfree ^$stack10000", "t kfree ^$arg10000",
    "t kfree ^$none_var", "t kfree ^%rax", "t kfree ^@12345678abcde", "t kfree ^@+10",
    "t kfree arg1=\\^x", 't kfree arg1=\\"abcd^', "t kfree ^+0@0)", "t kfree ^+0ab1(@0)",
    "t kfree +0(+0(@0^)", "t kfree +0(^$comm)", "t kfree ^&1", "t kfree +0(@11):u8[10^",
    "t kfree +0(@11):u8[10]^a", "t kfree +0(@11):u8[^10a]", "t kfree +0(@11):u8[^256]",
    "t kfree @11:^unknown_type", "t kfree $stack0:^string", "t kfree @11:^b10@a/16",
    "t kfree ^arg123456789012345678901234567890=@11", "t kfree ^=@11", "t kfree ^var.1=@11",
    "t kfree var1=@11 ^var1=@12", "t kfree arg1=^")]
FPARSE["6.12"] += _TPARSE_COMMON + [("dynevent/tprobe_syntax_errors.tc", line) for line in (
    "t kfree +0(^+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(+0(@0))))))))))))))",
    "t kfree ^+1234567(+1234567(+1234567(+1234567(+1234567(+1234567(@1234))))))")]
FPARSE["7.3"] += _TPARSE_COMMON + [("dynevent/tprobe_syntax_errors.tc", line) for line in (
    "t kfree +0(+0(+0(+0(+0(+0(+0(+0(^+0(@0)))))))))",
    "t kfree ^" + "+1234567(" * 26 + "@1234" + ")" * 26)] + [
    ("dynevent/fprobe_syntax_errors.tc", "t kmem^/kfree")]

#: Event probes (e:): the dynevent selftests' lines, each kind of field, filters.
CHDIR = "cd /sys/kernel/tracing; cd /"                # add_remove_eprobe.tc's workload
_EP = "syscalls/sys_enter_chdir file=+0($filename):ustring"
_DUP = "syscalls/sys_enter_openat file=+0($filename):ustring"
_DUP_LINES = [f"e:egroup/eevent {_DUP}", f"e:egroup/eevent {_DUP}",
              f"e:syscalls/sys_enter_open {_DUP}", "p:kgroup/kevent vfs_open file=+0($arg2)",
              f"e:kgroup/kevent {_DUP}", "p:kgroup/kevent vfs_open file=+0($arg2)",
              "p:egroup/eevent vfs_open file=+0($arg2)",
              "p:syscalls/sys_enter_open vfs_open file=+0($arg2)"]
_DUP_WANT = ("hit", EEXIST_EVENT, EEXIST_EVENT, "hit", EEXIST_EVENT, EEXIST_SAME,
             EEXIST_EVENT, EEXIST_EVENT)
_EPROBE = [
    C("dynevent/add_remove_eprobe.tc", f"e:eprobe_chdir {_EP}", CHDIR),
    *[C("dynevent/add_remove_eprobe.tc", [f"e:eprobe_chdir {_EP}", minus], CHDIR, "ok", "ok")
      for minus in ("-:eprobe_chdir", "-:eprobes/eprobe_chdir",
                    "-:eprobes/eprobe_chdir syscalls/sys_enter_chdir",
                    "-:eprobe_chdir syscalls/sys_enter_chdir", f"-:eprobe_chdir {_EP}",
                    f"-:eprobes/eprobe_chdir {_EP}")],
    C("dynevent/add_remove_eprobe.tc", f"e:mygroup/ {_EP}", CHDIR),
    C("dynevent/add_remove_eprobe.tc", [f"e:mygroup/ {_EP}", "-:mygroup/"], CHDIR, "ok", "ok"),
    # -: lines that match nothing: another attached event, another argument
    C("dynevent/add_remove_eprobe.tc", [f"e:eprobe_chdir {_EP}",
                                        "-:eprobe_chdir sched/sys_enter_chdir",
                                        "-:eprobe_chdir syscalls/sys_enter_chdir x=$filename"],
      CHDIR, "hit", "ENOENT", "ENOENT"),
    C("dynevent/test_duplicates.tc", _DUP_LINES, OPEN, *_DUP_WANT),
    C("dynevent/test_duplicates.tc", _DUP_LINES + ["-:kgroup/kevent", "-:egroup/eevent"], OPEN,
      "ok", *_DUP_WANT[1:3], "ok", *_DUP_WANT[4:], "ok", "ok"),
    # each kind of field get_event_field() reads, $comm untyped (an address) and typed,
    # @SYM and immediates, and filters on numbers, strings, the generic comm and CPU
    C("dynevent/add_remove_eprobe.tc",
      "e:op syscalls.sys_enter_openat f=+0($filename):ustring fl=$flags:x32 d=$dfd:s32 "
      "c=$comm c2=$comm:string j=@nr_cpu_ids:u32 i=\\7 s=\\\"str\"", OPEN),
    C("dynevent/add_remove_eprobe.tc",
      "e:fk sched.sched_process_fork pp=$parent_pid cp=$child_pid:s32 "
      "pc=$parent_comm:string pa=$parent_comm if child_pid > 0 && parent_comm ~ \"*s*\"",
      FORK),
    C("dynevent/add_remove_eprobe.tc",
      ["e:a syscalls.sys_enter_openat f=+0($filename):ustring if comm == \"nothing\"",
       "e:b syscalls.sys_enter_openat f=+0($filename):ustring if dfd != 1 || CPU == 0",
       "e:c sched.sched_process_fork p=$child_pid if !(child_pid < 2) && common_pid > 0"],
      f"{OPEN}; {FORK}", "ok", "hit", "hit"),
    # a glob on a char[16] field is matched on all 16 bytes (filter_pred_string() passes
    # field->size): "*t" compares the bytes before the last one, so cat's exit is not
    # recorded; a __data_loc string passes its own length, where "*loop" matches
    C("dynevent/add_remove_eprobe.tc",
      ["e:xt sched.sched_process_exit c=$comm:string if comm ~ \"*t\"",
       "e:xc sched.sched_process_exit c=$comm:string if comm ~ \"c?t*\"",
       "e:xe sched.sched_process_exec f=$filename:string if filename ~ \"*loop\""],
      "cat /proc/version > /dev/null; /usr/bin/kph-loop 1 x > /dev/null", "ok", "hit", "hit"),
]
_EPROBE_7_3 = [
    # bare field names, a __data_loc string, a typecast of a field (7.3)
    C("dynevent/eprobes_syntax_errors.tc",
      "e:op syscalls.sys_enter_openat f=filename:ustring v=__filename_val:string dfd",
      OPEN),
    C("dynevent/btf_typecast_accepted.tc",
      "e:tc sched.sched_process_fork p=(task_struct)$parent_comm->pid:x32", FORK),
]
EPROBE_CASES = {"6.12": _EPROBE, "7.3": _EPROBE + _EPROBE_7_3}

#: eprobes_syntax_errors.tc's parse errors (caret where the selftest puts it), and filters
#: create_event_filter() refuses (the caret in the filter: no selftest caret).
_EPARSE_COMMON = [("dynevent/eprobes_syntax_errors.tc", line) for line in (
    "e ^a.", "e ^.b", "e ^a.b", "e syscalls/sys_enter_openat ^foo",
    "e:^/bar syscalls/sys_enter_openat",
    "e:^12345678901234567890123456789012345678901234567890123456789012345/bar "
    "syscalls/sys_enter_openat",
    "e:^foo.1/bar syscalls/sys_enter_openat", "e:^ syscalls/sys_enter_openat",
    "e:foo/^12345678901234567890123456789012345678901234567890123456789012345 "
    "syscalls/sys_enter_openat",
    "e:foo/^bar.1 syscalls/sys_enter_openat", "e:foo/bar syscalls/sys_enter_openat arg=^$foo",
    "e:foo/bar syscalls/sys_enter_openat if ^")] + [
    ("dynevent/add_remove_eprobe.tc", line) for line in (
        "e sched/sched_switch if prev_pid >", "e sched/sched_switch if foo == 1",
        "e sched/sched_switch if prev_comm == 1", "e sched/sched_switch if prev_comm < \"a\"",
        "e sched/sched_switch if prev_pid == 1x", "e sched/sched_switch if prev_comm ~ \"ab",
        "e sched/sched_switch ^$common_pid", "e sched/sched_switch ^%ax",
        "e sched/sched_switch ^$arg1", "e sched/sched_switch +0(^$comm)",
        "e sched/sched_switch $prev_comm:^unknown")]
EPARSE = {"6.12": _EPARSE_COMMON + [("dynevent/eprobes_syntax_errors.tc",
                                     "e:foo/bar syscalls/sys_enter_openat arg=^dfd")],
          "7.3": _EPARSE_COMMON + [("dynevent/eprobes_syntax_errors.tc", line) for line in (
              "e:foo/bar syscalls/sys_enter_openat arg=^COMM",
              "e:foo/bar syscalls/sys_enter_openat arg=^current",
              "e:foo/bar syscalls/sys_enter_openat arg=^this_cpu_read(file)")]}

_SKIPPED_COMMON = {
    "dynevent/add_remove_btfarg.tc: t:tpevent2 sched_wakeup p->se.group_node.next->prev":
        "both sides record the same wakeups, but the idle task's, woken from an interrupt "
        "at the start of the window, sort into another place of the guest's trace now and "
        "then (the diff compares in order; the line's parse and BTF fields are the "
        "kmem_cache_alloc case's)",
    "dynevent/add_remove_tprobe_module.tc: t: lines on trace-events-sample's foo_bar "
    "with the module loaded":
        "the sample module is not built (CONFIG_SAMPLES is off in Debian's kernels); "
        "the line on a tracepoint no module brought is a case (pending on both sides)",
    "kprobe/kprobe_module.tc: rmmod trace-printk, then modprobe it and see event1 fire":
        "pvpanic (the stand-in) cannot be unloaded while its device is bound; "
        "trace_printk.ko is not built (CONFIG_SAMPLES is off in Debian's kernels)",
    "kprobe/busy_check.tc: 'echo > kprobe_events' refused while an event is enabled":
        "a property of clearing kprobe_events, not of a probe definition",
    "dynevent/clear_select_events.tc, generic_clear_event.tc":
        "their kprobe definitions are add_remove_kprobe.tc's; they test synthetic events",
    "dynevent/add_remove_uprobe.tc: p:myevent on /bin/busybox's ELF entry point":
        "a uprobe on a program's first instruction stops the host's gdbstub engine (QEMU "
        "answers E14 reading the instruction at the first hit, on 6.1 too): a known "
        "limitation of the uprobe engine, not of these kernels' rules",
    "dynevent/add_remove_synth.tc": "synthetic events, not probe lines",
}
SKIPPED = {"6.12": _SKIPPED_COMMON, "7.3": _SKIPPED_COMMON | {
    "dynevent/btf_typecast_accepted.tc: kpevent9, kpevent10; btf_probe_event.tc":
        "they probe trace-events-sample's sample_timer_cb (CONFIG_SAMPLES is off)",
    "dynevent/add_remove_fprobe_module.tc: f:test1 foo_bar* on trace-events-sample":
        "the sample module is not built (CONFIG_SAMPLES is off in Debian's kernels)",
    "dynevent/btf_typecast_accepted.tc: fpevent9, fpevent10":
        "they probe trace-events-sample's sample_timer_cb (CONFIG_SAMPLES is off)",
}}
