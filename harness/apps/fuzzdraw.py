"""What ``kph fuzz`` draws: examples of probe definitions from the grammar the harness
mirrors (``strategies``), the same list for a seed wherever it is drawn (``list_examples``,
``grammar_only``). harness.apps.fuzz judges them.

An example is one line (mostly) or two: well-formed lines of every probe kind the booted
kernel has, with the constructs of its series; lines with one defect (a bad kind, name,
place, argument or type, a mutated character, one argument too many), where what other
kinds take is drawn too (``FOREIGN``); two lines for one event; a definition and its
deletion. ``mix="defects"`` draws the defective lines only.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ..kernel import grammar
from ..kernel.rules import SERIES

UPROBE_PLACES = ("/usr/bin/kph-loop:kph_add", "/usr/bin/kph-loop:main")
#: File offsets a uprobe's ``@+FOFFS`` reads at (kph-loop's ELF header, its program
#: headers, the start of its text): each is mapped while the probe hits.
FILE_OFFSETS = (0x4, 0x18, 0x40, 0x78, 0x1000, 0x1010)
#: Fetch args the grammar has for some probe kinds and not for this one
#: (kernel/trace/trace_probe.c: parse_probe_vars(), parse_probe_arg(): registers and stack
#: slots need pt_regs, which an event probe has not; ``$argN`` needs a function entry or
#: BTF; ``$retval`` a return; ``@SYM`` a kernel address): drawn as arguments of that kind
#: so its refusals (and their error_log entries) are checked against the kernel's.
FOREIGN = {
    "eprobe": ("$stack", "$stack0", "$stack3", "%ax", "%di", "%sp", "$arg1", "$retval",
               "@+0x40"),
    "fprobe": ("%ax", "%di", "%sp", "@+0x40"),
    "uprobe": ("$arg1", "$retval", "@linux_proc_banner", "@jiffies+8", "$current"),
}


#: What a run draws: ``all`` (the mix below), or ``defects`` only (lines with one defect:
#: the kernel's parser refuses most, and a refusal is judged by one write to the guest's
#: tracefs, no workload, about ten times as many a minute).
MIXES = ("all", "defects")


def strategies(pool: list[str], *, rules: Any = None, guest: str = "events",
               mix: str = "all", unbounded: list[str] | None = None) -> Any:
    """A Hypothesis strategy of examples: tuples of one (mostly) or two lines.

    Three of five examples are well formed from end to end (they reach registration and,
    on a called function, record hits); one has exactly one defect (a bad kind, name,
    place, argument or type, a mutated character, one argument too many); one is two
    lines for the same event (appending, EEXIST).

    The grammar is the booted kernel's (``rules``, :class:`harness.kernel.rules.KernelRules`,
    default 6.1's): its fetch types, and the constructs its series added (BTF names and
    ``$arg*``, ``%pd``/``%pD``, ``$current``, ``this_cpu_*()``, typecasts) are drawn where it
    has them, and offered as defects where it does not. With ``guest="module"`` no uprobe
    and no ``-:`` line is drawn: the module registers kprobes and has neither.
    ``unbounded``: the functions of ``pool`` without a BTF prototype, where ``$argN`` is
    not bounded by the function's parameters (kernel/trace/trace_probe.c: with a
    prototype, an ``$argN`` past its parameters is BAD_VAR): where a return probe's
    entry-argument limit can be met, so the lines that draw it are on them.
    """
    from hypothesis import strategies as st

    r = rules or SERIES["6.1"]
    regs = list(grammar.REGISTERS)
    types = sorted(r.fetch_types)
    max_args = int(grammar.MAX_TRACE_ARGS)
    # constructs of later series: well formed where this kernel has them (drawn with the
    # good leaves), a defect where it does not (drawn with the bad ones)
    later = {
        "btf_args": ["$arg*", "file", "file->f_pos", "count", "$arg1->f_flags"],
        "current_var": ["$current", "$current->pid", "$current->comm"],
        "this_cpu": ["this_cpu_read(@this_cpu_off)", "this_cpu_ptr(%di)"],
        "typecasts": ["(file)$arg1->f_flags", "(task_struct)$current->pid"],
    }
    newer = [t for k, ts in later.items() if getattr(r, k) for t in ts]
    older = [t for k, ts in later.items() if not getattr(r, k) for t in ts]
    syms = st.sampled_from(pool or ["do_sys_openat2"])
    ident = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)

    # -- well-formed pieces ($argN only where the kernel takes it: a function entry)
    def leaves(entry: bool) -> Any:
        return st.one_of(
            st.sampled_from(regs).map(lambda r: f"%{r}"),
            st.integers(0, 40).map(lambda n: f"$stack{n}"),
            st.sampled_from(["$stack", "$comm"] + (["$arg1", "$arg2", "$arg3", "$arg6"]
                                                   if entry else [])),
            st.tuples(st.sampled_from(["linux_proc_banner", "init_uts_ns", "saved_command_line", "_sdata"]),
                      st.sampled_from(["", "+4", "-8", "+0x10"])).map(lambda t: f"@{t[0]}{t[1]}"),
            st.integers(-5, 300).map(lambda n: f"\\{n}"),
            st.just('\\"kph\\"'),
            *([st.sampled_from(newer)] if newer else []),
        )

    def deref(inner: Any) -> Any:
        return st.tuples(st.sampled_from(["+", "+", "-", "+u", "+0x"]), st.integers(0, 64),
                         inner).map(lambda t: f"{t[0]}{t[1]}({t[2]})")

    fetch = st.recursive(leaves(False), deref, max_leaves=6)
    entry_fetch = st.recursive(leaves(True), deref, max_leaves=6)
    good_type = st.one_of(
        st.sampled_from(types + (["%pd", "%pD"] if r.dentry_types else [])),
        st.tuples(st.integers(1, 8), st.integers(0, 7), st.sampled_from([8, 16, 32, 64]))
          .map(lambda t: f"b{t[0]}@{t[1]}/{t[2]}"),
        st.tuples(st.sampled_from(types), st.integers(1, 8)).map(lambda t: f"{t[0]}[{t[1]}]"),
    )
    tname = st.one_of(st.none(), st.none(), good_type)
    aname = st.one_of(st.none(), ident)

    def argtext(t: tuple[str | None, str, str | None]) -> str:
        return (f"{t[0]}=" if t[0] is not None else "") + t[1] + (f":{t[2]}" if t[2] else "")

    # nested derefs up to the kernel's depth limit and one past it (7.3:
    # TRACEPROBE_MAX_NESTED_LEVEL; earlier kernels are bounded by MAX_ARGSTR_LEN only)
    depth = r.max_nested or 8
    nested = st.tuples(st.integers(1, depth + 1), st.sampled_from(["%di", "%sp", "$stack"])).map(
        lambda t: "+0(" * t[0] + t[1] + ")" * t[0])
    # arrays of strings over memory that is mostly not strings (stack words, a struct):
    # their elements fault or hold bytes, and each element's length and data_loc take
    # the fetch's error paths (trace_probe_tmpl.h: process_fetch_insn_bottom(), the
    # string array loop)
    str_types = [t for t in ("string", "ustring", "symstr") if t in types]

    def str_array(bases: list[str]) -> Any:
        return st.tuples(aname, st.sampled_from(bases),
                         st.tuples(st.sampled_from(str_types), st.integers(2, 4))
                         .map(lambda t: f"{t[0]}[{t[1]}]")).map(argtext)
    arg = st.one_of(st.tuples(aname, fetch, tname), st.tuples(aname, fetch, tname),
                    st.tuples(aname, nested, tname),
                    str_array(["+0(%sp)", "+8(%sp)", "+0(%di)", "+0(%si)", "+0($stack)"])
                    ).map(lambda a: a if isinstance(a, str) else argtext(a))
    entry_arg = st.tuples(aname, entry_fetch, tname).map(argtext)
    ret_arg = st.tuples(aname, st.one_of(st.just("$retval"), fetch), tname).map(argtext)
    args = st.lists(arg, max_size=3)
    offset = st.one_of(st.just(""), st.just(""), st.integers(0, 64).map(lambda n: f"+{n}"),
                       st.integers(0, 64).map(lambda n: f"+0x{n:x}"))
    name = st.one_of(st.just(""), ident.map(lambda n: f":{n}"),
                     st.tuples(ident, ident).map(lambda t: f":{t[0]}/{t[1]}"))
    p_line = st.one_of(
        st.tuples(st.just("p"), name, st.tuples(syms, offset).map("".join), args),
        st.tuples(st.just("p"), name, syms, st.lists(entry_arg, max_size=3)))
    r_line = st.tuples(st.sampled_from(["r", "r", "r1", "r4"]), name,
                       st.one_of(syms, syms.map(lambda s: f"{s}%return")),
                       st.lists(ret_arg, max_size=3))

    def line(t: tuple[str, str, str, list[str]]) -> str:
        k, n, pl, a = t
        return " ".join([f"{k}{n}", pl, *a]).strip()

    # uprobes on the shipped test programs (the default workload runs kph-loop): user
    # registers, stack slots and user memory; a uprobe takes no @SYM and no $argN
    def uleaf(rs: list[str]) -> Any:
        return st.one_of(st.sampled_from(rs).map(lambda x: f"%{x}"),
                         st.integers(0, 8).map(lambda n: f"$stack{n}"),
                         st.sampled_from(["$stack", "$comm", "\\7"]),
                         # memory at a file offset of the probed binary (@+FOFFS: its ELF
                         # header, program headers, text), and what only other kinds take
                         st.sampled_from(FILE_OFFSETS).map(lambda n: f"@+0x{n:x}"),
                         st.sampled_from(FOREIGN["uprobe"]))

    def ufetches(rs: list[str]) -> Any:
        return st.recursive(uleaf(rs), lambda i: st.tuples(st.sampled_from(["+", "-"]),
                                                           st.integers(0, 16), i)
                            .map(lambda t: f"{t[0]}{t[1]}({t[2]})"), max_leaves=3)
    ufetch = ufetches(regs)
    utype = st.one_of(st.none(), st.sampled_from(["u32", "s64", "x64", "string", "ustring",
                                                  "u8[4]", "b4@0/32"]))
    # arrays of user strings: at a C main %si and %dx are argv and envp, arrays of
    # string pointers the length pass and the store pass both walk
    # (trace_probe_tmpl.h: process_fetch_insn_bottom(), FETCH_OP_ST_USTRING in the loop)
    u_strs = st.tuples(aname, st.sampled_from(["+0(%si)", "+0(%dx)", "+8(%si)", "+0(%sp)"]),
                       st.tuples(st.sampled_from(["string", "ustring"]), st.integers(2, 4))
                       .map(lambda t: f"{t[0]}[{t[1]}]")).map(argtext)
    u_args = st.lists(st.one_of(st.tuples(aname, ufetch, utype).map(argtext),
                                st.tuples(aname, ufetch, utype).map(argtext), u_strs),
                      max_size=3)
    u_line = st.one_of(
        st.tuples(st.just("p"), name, st.sampled_from(UPROBE_PLACES), u_args),
        st.tuples(st.just("r"), name, st.sampled_from(UPROBE_PLACES),
                  st.lists(st.tuples(aname, st.one_of(st.just("$retval"), ufetch), utype)
                           .map(argtext), max_size=2)))

    # fprobe events and tracepoint probes (6.12+, kernel/trace/trace_fprobe.c): no
    # registers; an exit by %return or by $retval; 6.12's f[N] on exits. The module
    # registers kprobes only.
    f_lines = []
    if r.fprobe and guest != "module":
        def fleaves(entry: bool) -> Any:
            return st.one_of(
                st.integers(0, 40).map(lambda n: f"$stack{n}"),
                st.sampled_from(["$stack", "$comm"] + (["$arg1", "$arg2", "$arg3", "$arg6"]
                                                       if entry else [])),
                st.tuples(st.sampled_from(["linux_proc_banner", "init_uts_ns", "_sdata"]),
                          st.sampled_from(["", "+4", "-8"])).map(lambda t: f"@{t[0]}{t[1]}"),
                st.integers(-5, 300).map(lambda n: f"\\{n}"),
                st.sampled_from(FOREIGN["fprobe"]),
                *([st.sampled_from(newer)] if newer else []))
        f_entry = st.one_of(st.tuples(aname, st.recursive(fleaves(True), deref, max_leaves=4),
                                      tname).map(argtext),
                            str_array(["+0($stack)", "+8($stack)", "+0($stack1)"]))
        f_ret = st.tuples(aname, st.one_of(st.just("$retval"),
                                           st.recursive(fleaves(True), deref, max_leaves=4)),
                          tname).map(argtext)
        f_heads = ["f", "f", "f"] + (["f2", "f16"] if r.fprobe == "rethook" else [])
        # tracepoint probes: the fork's and exec's (the default workload forks and
        # execs), kfree's (hot) and a name no kernel has (kept, never registered)
        tps = st.sampled_from(["sched_process_fork", "sched_process_exec", "kfree",
                               "sched_process_exit", "no_such_tp_kph"])
        f_lines = [
            st.tuples(st.just("t"), name, tps, st.lists(f_entry, max_size=3)),
            st.tuples(st.just("f"), name, syms, st.lists(f_entry, max_size=3)),
            st.tuples(st.sampled_from(f_heads), name, syms.map(lambda s: f"{s}%return"),
                      st.lists(f_ret, max_size=3)),
            st.tuples(st.just("f"), name, syms,
                      st.lists(f_ret, max_size=2).map(lambda a: [*a, "rv=$retval"])),
        ]
    # event probes (6.12+, kernel/trace/trace_eprobe.c): fields of the attached event's
    # record ($FIELD, 7.3's bare FIELD and typecasts), $comm (untyped: its address), @SYM,
    # immediates, dereferences, and an `if` filter on the record. Events the default
    # workload fires (opens, forks, execs), one with a __data_loc string, and one no
    # kernel has (BAD_ATTACH_EVENT).
    e_lines: list[Any] = []
    if r.eprobe and guest != "module":
        ev_fields = {"syscalls.sys_enter_openat": ["dfd", "filename", "flags", "mode"],
                     "syscalls.sys_exit_openat": ["ret", "__syscall_nr"],
                     "sched.sched_process_fork": ["parent_comm", "parent_pid", "child_comm",
                                                  "child_pid"],
                     "sched.sched_process_exec": ["filename", "pid", "old_pid"],
                     "sched/sched_process_exit": ["comm", "pid", "prio"],
                     "no_sys.no_event_kph": ["x"]}
        str_fields = {"filename", "parent_comm", "child_comm", "comm"}
        bare = r.eprobe == "bare"

        def eleaves(fields: list[str]) -> Any:
            return st.one_of(
                st.sampled_from(fields).map(lambda f: f"${f}"),
                *([st.sampled_from(fields)] if bare else []),
                st.sampled_from(["$comm", "$comm", '\\"kph\\"', "\\7", "@linux_proc_banner",
                                 "@init_uts_ns+4"]),
                st.sampled_from(FOREIGN["eprobe"]),
                *([st.sampled_from(fields).map(lambda f: f"(task_struct)${f}->pid")]
                  if r.typecasts else []))

        def eargs(fields: list[str]) -> Any:
            # a string field as the string types take it (a char[N], a __data_loc, a
            # char * the kernel or the user owns: trace_eprobe.c get_event_field())
            strs = [f for f in fields if f in str_fields]
            typed = [st.tuples(aname, st.sampled_from(strs).map(lambda f: f"${f}"),
                               st.sampled_from([None, "string", "ustring", "x64"]))
                     .map(argtext)] if strs else []
            return st.lists(st.one_of(
                st.tuples(aname, st.recursive(eleaves(fields), deref, max_leaves=3),
                          tname).map(argtext), *typed), max_size=3)

        def efilter(fields: list[str]) -> Any:
            nums = [f for f in fields if f not in str_fields] + ["common_pid", "CPU"]
            strs = [f for f in fields if f in str_fields] + ["comm"]
            pred = st.one_of(
                st.tuples(st.sampled_from(nums), st.sampled_from(["==", "!=", "<", "<=", ">",
                                                                  ">=", "&"]),
                          st.sampled_from(["0", "1", "-1", "0x40", "100000"]))
                .map(" ".join),
                st.tuples(st.sampled_from(strs), st.sampled_from(["==", "!=", "~"]),
                          st.sampled_from(['"sh"', '"k*"', '"*sh*"', '"*t"', '"k?loop"',
                                           '"[a-c]*"', '"!sh"'])).map(" ".join))
            expr = st.one_of(pred, st.tuples(pred, st.sampled_from(["&&", "||"]), pred)
                             .map(" ".join),
                             pred.map(lambda p: f"!({p})"))
            return st.one_of(st.just([]), st.just([]), expr.map(lambda e: ["if", e]))

        e_line = st.sampled_from(sorted(ev_fields)).flatmap(
            lambda ev: st.tuples(st.just("e"), name, st.just(ev),
                                 st.tuples(eargs(ev_fields[ev]), efilter(ev_fields[ev]))
                                 .map(lambda t: t[0] + t[1])))
        e_lines = [e_line, e_line]
    good_parts = st.one_of(p_line, p_line, r_line, *f_lines, *e_lines,
                           *([u_line] if guest != "module" else []))
    good = good_parts.map(line)

    # -- one defect each
    bad_kind = st.sampled_from(["r0", "r5000", "p5", "x", "rx", "p-",
                                *(["f0", "f5000", "fx", "f-"] if r.fprobe else []),
                                *(["e5", "ex"] if r.eprobe else [])])
    bad_name = st.sampled_from([":1abc", ":a-b", ":a.b", ":", ":" + "x" * 65, ":g/",
                                ":/e", ":a/b/c"])
    bad_place = st.one_of(
        # a function's CFI/padding preamble symbol (kernel/kprobes.c:
        # is_cfi_preamble_symbol()): not code that runs, refused where the kernel has one
        syms.flatmap(lambda s: st.sampled_from([f"__pfx_{s}", f"__cfi_{s}"])),
        st.sampled_from(["no_such_function_kph", "init_task", "linux_proc_banner",
                         *(["a.", ".b", "sched.", "sched/no_event_kph"] if r.eprobe else []),
                         # a tracepoint named as a trace event is (SYSTEM:NAME, SYSTEM/NAME)
                         # or with a character a C identifier does not have
                         *(["sched:sched_process_fork", "sched/kfree", "kfree-x", "kfree.1"]
                           if r.fprobe else []),
                         "kprobe_int3_handler", "do_int3", "asm_exc_int3",
                         "virtio_console:port_fops_open", "port_fops_open", "no_mod:vfs_read",
                         "0xffffffff81000000", "0x1234", ""]),
        st.tuples(syms, st.sampled_from(["+1", "+2", "+3", "+-1", "+0x", "+z"])).map("".join),
    )
    bad_leaf = st.sampled_from(["%rax", "%eip", "%zz", "$arg0", "$arg9", "$stack4096",
                                "$retvalx", "$retval", "@no_such_sym", "@_sdata*10", "@",
                                '\\"', "%", "$", "+", "10", "+0x(%di)", "+8($comm)",
                                "+u0($retval)", "+8(%di", "+(%di)", "+u8(+8($arg1))",
                                *(["$no_field_kph", "$common_pid", "if", "if pid >",
                                   "if comm == kph", "if nofield == 1", "if pid ~ 1",
                                   'if comm < "a"', 'if (pid == 1'] if r.eprobe else []),
                                *older])
    bad_fetch = st.one_of(bad_leaf, st.tuples(st.integers(0, 32), bad_leaf)
                          .map(lambda t: f"+{t[0]}({t[1]})"))
    bad_type = st.sampled_from(["u128", "x", "str", *(["char", "%pd"] if "char" not in r.fetch_types
                                                    else ["%pz"]), "b0@0/8", "b9@0/8",
                                "u8[0]", "u8[65]", "string[2]", "b8@60/64", "x32[", "symstr"])
    bad_arg = st.one_of(
        st.tuples(aname, bad_fetch, tname).map(argtext),
        st.tuples(aname, fetch, bad_type).map(argtext),
        st.tuples(st.sampled_from(["1abc", "a-b", "", "x" * 33, "common_pid", "ab$"]),
                  fetch, tname).map(argtext),
    )

    def with_defect(t: tuple[tuple[str, str, str, list[str]], int, Any]) -> str:
        (k, n, pl, a), which, bad = t
        parts = [k, n, pl, list(a)]
        if which < 3:
            parts[which] = bad
        else:
            parts[3].insert(len(a) // 2, bad)
        return line(tuple(parts))  # type: ignore[arg-type]

    # which part is bad is drawn first and only that part's defect is drawn: a tuple of
    # all four (one used) overran Hypothesis's choice buffer so often that a bad kind or
    # place was almost never drawn (0 in 1,800 lines, 2026-11-29)
    bad_part = (bad_kind, bad_name, bad_place, bad_arg)
    one_bad = st.tuples(good_parts, st.integers(0, 3)).flatmap(
        lambda t: bad_part[t[1]].map(lambda bad: with_defect((t[0], t[1], bad))))
    mutated = st.tuples(good, st.integers(0, 200), st.sampled_from(list(" :=()+-$%@\\\"x,0"))) \
        .map(lambda t: t[0][:t[1] % (len(t[0]) + 1)] + t[2] + t[0][t[1] % (len(t[0]) + 1) + 1:])
    too_many = st.tuples(p_line, st.just(max_args + 1)).map(
        lambda t: line((t[0][0], t[0][1], t[0][2], [f"a{i}=%di" for i in range(t[1])])))
    # a kernel limit and one past it: a return probe's arguments saved at entry (one word
    # each: 7.3's fprobe keeps 15, MAX_FPROBE_DATA_SIZE; a kretprobe's data up to 4 KiB)
    if r.entry_args_on_return:
        saved = st.tuples(st.sampled_from(["f", "r"] if f_lines else ["r"]), name,
                          st.sampled_from(unbounded) if unbounded else syms,
                          st.integers(14, 17)).map(lambda t: line((
                              t[0], t[1], t[2] + ("%return" if t[0] == "f" else ""),
                              [f"$arg{i}" for i in range(1, t[3] + 1)])))
        too_many = st.one_of(too_many, saved)
    defective = st.one_of(one_bad, mutated, too_many)
    kinds = ["p", "r"] + (["f", "t"] if f_lines else [])
    same_event = st.tuples(
        st.tuples(st.sampled_from(kinds), st.just(":kph/e"), syms, args).map(line),
        st.tuples(st.sampled_from(kinds), st.just(":kph/e"), syms, args).map(line))
    # a -: line after a definition (dyn_event_release(): by name, group, place, arguments)
    release = st.tuples(
        st.tuples(st.sampled_from(kinds), st.just(":kph/e"), syms, args).map(line),
        st.one_of(st.sampled_from(["-:kph/e", "-:e", "-:kph/", "-:kph/x", "-:x/e", "-:"]),
                  syms.map(lambda s: f"-:kph/e {s}")))
    # after a uprobe's definition: a -: line goes to uprobe_events, the file that frees
    # uprobes (kernel/trace/trace_uprobe.c: create_or_delete_trace_uprobe()); a place is
    # compared with PATH:0x%016lx (trace_uprobe_match_command_head(): a symbol never is)
    release = st.one_of(release, st.tuples(
        st.tuples(st.sampled_from(["p", "r"]), st.just(":kph/e"), st.sampled_from(UPROBE_PLACES),
                  u_args).map(line),
        st.sampled_from(["-:kph/e", "-:e", "-:kph/", "-:x/e",
                         *(f"-:kph/e {p}" for p in UPROBE_PLACES)])))
    if e_lines:     # eprobe_dyn_event_match(): the attached event, then the arguments
        release = st.one_of(release, st.tuples(
            st.just("e:kph/e sched.sched_process_fork c=$child_pid"),
            st.sampled_from(["-:kph/e", "-:kph/e sched/sched_process_fork",
                             "-:kph/e sched.sched_process_fork c=$child_pid",
                             "-:kph/e sch/sched_process_fork", "-:kph/e sched/sched_switch",
                             "-:kph/e sched.sched_process_fork c=$parent_pid"])))
    if mix == "defects":        # a bad part (kind, name, place, argument) twice as often
        defective = st.one_of(one_bad, one_bad, mutated, too_many)
    if guest == "module":
        defective = defective.filter(lambda s: not s.lstrip().startswith("-"))
    if mix == "defects":
        return defective.map(lambda s: (s,))
    return st.one_of(good.map(lambda s: (s,)), good.map(lambda s: (s,)),
                     good.map(lambda s: (s,)), defective.map(lambda s: (s,)), same_event,
                     *([release] if guest != "module" else []))


def list_examples(pool: list[str], *, examples: int, seed: int,
                  rules: Any = None, guest: str = "events", mix: str = "all",
                  unbounded: list[str] | None = None) -> list[tuple[str, ...]]:
    """The examples a run with ``seed`` draws first on a kernel of ``rules`` (no database,
    nothing judged): the same list every time."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out: list[tuple[str, ...]] = []

    def body(lines: tuple[str, ...]) -> None:
        out.append(lines)

    test = settings(max_examples=examples, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.generate])(
        given(strategies(pool, rules=rules, guest=guest, mix=mix, unbounded=unbounded))(body))
    with grammar_only():
        hseed(seed)(test)()
    return out[:examples]


@contextlib.contextmanager
def grammar_only() -> Iterator[None]:
    """Draws from the strategies alone, whatever has been imported.

    Why: Hypothesis (6.13x on) mixes the literals of every local module imported so far
    into its draws (``hypothesis.internal.conjecture.providers._get_local_constants``), so
    one seed drew other examples once another module was loaded: ``kph fuzz --list``
    against a run, a pytest session against the CLI. With that pool held empty the same
    seed draws the same examples everywhere. A Hypothesis without it is left as it is.
    """
    try:
        from hypothesis.internal.conjecture import providers
        get, cache, empty = (providers._get_local_constants, providers.CONSTANTS_CACHE,
                             type(providers._local_constants)())
    except (ImportError, AttributeError, TypeError):
        yield
        return
    cache.cache.clear()
    providers._get_local_constants = lambda: empty
    try:
        yield
    finally:
        providers._get_local_constants = get
        cache.cache.clear()
