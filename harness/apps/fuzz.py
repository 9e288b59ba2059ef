"""``kph fuzz``: probe definitions generated from the grammar, host against guest, every
divergence shrunk to one line.

The kernel is the oracle. Each example is one or two ``kprobe_events`` lines drawn by
Hypothesis (``strategies``) from the grammar data the harness mirrors (registers, fetch
types, limits, the kernel's own function names) plus deliberate mistakes. The example is
judged on one booted guest (``Oracle``):

- a line the host's parser refuses is written to the guest's ``kprobe_events`` as is; the
  guest must refuse it too, with the same ``error_log`` message and caret column;
- lines the host parses go through ``harness.diff.runner.run_differential`` (both worlds on one
  execution of the workload) and ``harness.diff.verdict.compare``: the same registration verdict,
  errno and message, and the same events, with the normalizations ``kph diff`` documents
  and no new ones;
- a traceback or a hang (each example has a timeout) is a finding too.

A divergence makes the example fail; Hypothesis shrinks it to a minimal definition, the run
records it (``Finding``: a ``kph diff`` one-liner and a regression line) and goes on with
its class (``Finding.signature``) known, until the budget is spent. The example database
lives in the cache (``$KPH_CACHE/fuzz/db``), so a failure found once is tried first next
time. The same seed draws the same examples (``list_examples``).

The symbol pool comes from the functions the workload really calls: one in-guest
function-tracer pass per image and workload, cached (``symbol_pool``), so most examples
record hits.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shlex
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import constants as C
from ..errors import GuestAgentError, HarnessError, NotMirroredError, ProbeSpecError, VMError
from ..kernel import grammar
from ..kernel.rules import SERIES
from ..kernel.grammar import parse
from ..diff.runner import resolve_uprobes, run_differential, trampoline_text
from ..diff.verdict import compare
from ..diff.report import findings_text
from ..kernel.splat import KernelFinding, during, headline
from ..backends.tracelayer import TraceLayer
from ..vmctl import Machine

log = logging.getLogger(__name__)

#: A workload with opens, reads, forks, execs and sleeps: most kernel paths a probe on a
#: called function would see.
DEFAULT_WORKLOAD = ("cat /proc/version > /dev/null; head -c 20 /proc/cpuinfo > /dev/null; "
                    "sh -c 'true & wait'; /usr/bin/kph-loop 2 kph > /dev/null")
EXAMPLE_TIMEOUT = 30.0
#: uprobe places the strategies draw (PATH:SYMBOL of the image's test programs)
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
MAX_POOL = 400
#: Names that are not functions, or not probeable: the misses a pool must also hold.
MISSES = ("no_such_function_kph", "init_task", "linux_proc_banner", "kprobe_int3_handler",
          "do_int3", "asm_exc_int3")


#: Known differences the harness does not mirror, as signature patterns, each with its
#: reason (docs: kph fuzz, "Findings"); an example that only shows one is not a finding.
KNOWN: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Finding:
    """One class of divergence, at its shrunk example."""

    lines: tuple[str, ...]
    kind: str                    # parse, registration, events, crash, timeout, kernel, hang
    detail: str
    signature: str
    repro: str = ""
    #: Hypothesis replayed the example and the verdict changed (the guest's execution is
    #: not the same twice): reported, but no regression case the suite could replay
    flaky: bool = False

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FuzzStats:
    examples: int = 0
    findings: list[Finding] = field(default_factory=list)
    seconds: float = 0.0
    agreed_refusals: int = 0
    agreed_runs: int = 0
    #: examples with a construct the host engine or the guest side does not mirror
    not_mirrored: int = 0
    #: each reason, as the refusal's first line says it, and how many examples had it
    not_mirrored_why: dict[str, int] = field(default_factory=dict)
    events: int = 0
    known: dict[str, int] = field(default_factory=dict)
    #: The machine the run ended on (a reboot replaces the first).
    vm: Machine = None

    @property
    def per_minute(self) -> float:
        return 60.0 * self.examples / self.seconds if self.seconds else 0.0


# -- the symbol pool --------------------------------------------------------------------

def symbol_pool(vm: Machine, workload: str) -> list[str]:
    """Functions ``workload`` calls on this image, probeable by the kernel's rules
    (cached per image and workload): an in-guest function-tracer pass."""
    key = hashlib.sha256(f"{vm.kernel}\0{workload}".encode()).hexdigest()[:16]
    d = C.cache_dir() / "fuzz" / "pools"
    f = d / f"{key}.json"
    if f.exists():
        return list(json.loads(f.read_text()))
    t = "/sys/kernel/tracing"
    script = (f"cd {t}; echo 0 > tracing_on; echo > trace; echo function > current_tracer; "
              f"echo 1 > tracing_on; ({workload}) >/dev/null 2>&1; echo 0 > tracing_on; "
              f"echo nop > current_tracer")
    vm.run(script, timeout=120)
    text = vm.run(f"cat {t}/trace; echo > {t}/trace", timeout=120).stdout
    names: dict[str, None] = {}
    for line in text.splitlines():
        m = re.search(r":\s+([\w.]+) <-", line)
        if m:
            names.setdefault(m[1], None)
    syms, bl = vm.symbols, vm.blacklist
    pool = []
    for n in names:
        s = syms.get(n)
        if s is None or s.module or not s.is_text or bl.find(s.addr) is not None:
            continue
        pool.append(n)
    pool = sorted(pool)[:MAX_POOL] if len(pool) > MAX_POOL else sorted(pool)
    d.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(pool))
    return pool


# -- strategies -------------------------------------------------------------------------

def strategies(pool: list[str], *, rules: Any = None, guest: str = "events") -> Any:
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
    arg = st.one_of(st.tuples(aname, fetch, tname), st.tuples(aname, fetch, tname),
                    st.tuples(aname, nested, tname)).map(argtext)
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
    u_args = st.lists(st.tuples(aname, ufetch, utype).map(argtext), max_size=3)
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
        f_entry = st.tuples(aname, st.recursive(fleaves(True), deref, max_leaves=4),
                            tname).map(argtext)
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
            return st.lists(st.tuples(aname, st.recursive(eleaves(fields), deref, max_leaves=3),
                                      tname).map(argtext), max_size=3)

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

    def with_defect(t: tuple[tuple[str, str, str, list[str]], int, Any, str]) -> str:
        (k, n, pl, a), which, bad, _ = t
        parts = [k, n, pl, list(a)]
        if which == 0:
            parts[0] = bad[0]
        elif which == 1:
            parts[1] = bad[1]
        elif which == 2:
            parts[2] = bad[2]
        else:
            parts[3].insert(len(a) // 2, bad[3])
        return line(tuple(parts))  # type: ignore[arg-type]

    defective = st.one_of(
        st.tuples(good_parts, st.integers(0, 3), st.tuples(bad_kind, bad_name, bad_place, bad_arg),
                  st.just("")).map(with_defect),
        st.tuples(good, st.integers(0, 200), st.sampled_from(list(" :=()+-$%@\\\"x,0")))
          .map(lambda t: t[0][:t[1] % (len(t[0]) + 1)] + t[2] + t[0][t[1] % (len(t[0]) + 1) + 1:]),
        st.tuples(p_line, st.just(max_args + 1)).map(
            lambda t: line((t[0][0], t[0][1], t[0][2], [f"a{i}=%di" for i in range(t[1])]))),
    )
    kinds = ["p", "r"] + (["f", "t"] if f_lines else [])
    same_event = st.tuples(
        st.tuples(st.sampled_from(kinds), st.just(":kph/e"), syms, args).map(line),
        st.tuples(st.sampled_from(kinds), st.just(":kph/e"), syms, args).map(line))
    # a -: line after a definition (dyn_event_release(): by name, group, place, arguments)
    release = st.tuples(
        st.tuples(st.sampled_from(kinds), st.just(":kph/e"), syms, args).map(line),
        st.one_of(st.sampled_from(["-:kph/e", "-:e", "-:kph/", "-:kph/x", "-:x/e", "-:"]),
                  syms.map(lambda s: f"-:kph/e {s}")))
    if e_lines:     # eprobe_dyn_event_match(): the attached event, then the arguments
        release = st.one_of(release, st.tuples(
            st.just("e:kph/e sched.sched_process_fork c=$child_pid"),
            st.sampled_from(["-:kph/e", "-:kph/e sched/sched_process_fork",
                             "-:kph/e sched.sched_process_fork c=$child_pid",
                             "-:kph/e sch/sched_process_fork", "-:kph/e sched/sched_switch",
                             "-:kph/e sched.sched_process_fork c=$parent_pid"])))
    if guest == "module":
        defective = defective.filter(lambda s: not s.lstrip().startswith("-"))
    return st.one_of(good.map(lambda s: (s,)), good.map(lambda s: (s,)),
                     good.map(lambda s: (s,)), defective.map(lambda s: (s,)), same_event,
                     *([release] if guest != "module" else []))


# -- the oracle -------------------------------------------------------------------------

def guest_error(vm: Machine, line: str) -> tuple[bool, int, str | None, int | None]:
    """Write ``line`` to the guest's kprobe_events (uprobe_events for a path target):
    (accepted, errno, error_log message or None, caret column or None). An accepted line
    is deleted again."""
    toks = line.split()
    f = "dynamic_events" if line[:1] in "fte" else \
        "uprobe_events" if len(toks) > 1 and "/" in toks[1] else "kprobe_events"
    r = vm.run(f"cd /sys/kernel/tracing; : > error_log; echo {shlex.quote(line)} >> {f}; "
               "echo \"@rc=$?\"; cat error_log", timeout=30)
    if "@rc=0" in r.stdout:
        vm.run("cd /sys/kernel/tracing; echo > dynamic_events", timeout=30)
        return True, 0, None, None
    import os
    err = r.stderr.rsplit("write error: ", 1)[-1].strip()
    code = {os.strerror(n): n for n in range(1, 134)}.get(err, 22)
    log_lines = r.stdout.split("\n", 1)[1].splitlines() if "\n" in r.stdout else []
    if not log_lines or " error: " not in log_lines[0]:
        return False, code, None, None
    # the last entry: a write can log twice (6.12's fprobe %REG: BAD_VAR, BAD_FETCH_ARG)
    # "[ts] SUBSYSTEM: error: MSG" (an event filter's: "event filter parse error: error:")
    msg = [ln for ln in log_lines if " error: " in ln][-1].split(": error: ", 1)[1]
    caret = log_lines[-1].index("^") - len("  Command: ") if "^" in log_lines[-1] else None
    return False, code, msg, caret


class Oracle:
    """Judges examples on one machine (probes removed after each; the guest's tracefs is
    checked empty before the next)."""

    def __init__(self, vm: Machine, *, guest: str = "events", workload: str = DEFAULT_WORKLOAD,
                 timeout: float = EXAMPLE_TIMEOUT) -> None:
        self.vm, self.guest, self.workload, self.timeout = vm, guest, workload, timeout
        # The booted kernel's grammar (harness.kernel.rules), BTF and symbols: the host
        # parses each line as that kernel does.

        # and the trace events an event probe attaches to (TraceLayer.event_format)
        self._parse_kw = {"kernel": TraceLayer(vm).view()}
        self.stats = FuzzStats()
        self._places: dict[str, str] = {}

    def kernel_form(self, line: str) -> str:
        """``line`` with the harness's ``PATH:SYMBOL`` uprobe places (UPROBE_PLACES) as the
        ``PATH:0xOFFSET`` the kernel's ``uprobe_events`` takes, so both sides get one text."""
        for place in UPROBE_PLACES:
            if place in line:
                if place not in self._places:
                    (spec,) = resolve_uprobes(self.vm, [parse(f"p {place}")])
                    self._places[place] = f"{spec.path}:{spec.offset:#x}"
                line = line.replace(place, self._places[place])
        return line

    def judge(self, lines: tuple[str, ...]) -> Finding | None:
        """None when host and guest agree on ``lines``; else the finding."""
        try:
            lines = tuple(self.kernel_form(ln) for ln in lines)
        except VMError as exc:          # the guest died (a panic) or hung under the last one
            return self._vm_error(lines, exc)
        specs = []
        for ln in lines:
            try:
                # the kernel's text only: a PATH:SYMBOL left (a mutated place) is its
                # BAD_UPROBE_OFFS, not a symbol for the harness to look up
                specs.append(parse(ln, uprobe_symbols=False, **self._parse_kw))
            except NotMirroredError as exc:
                self._not_mirrored(exc)
                return None
            except ProbeSpecError as exc:
                return self._parse_refusal(ln, exc)
        try:
            return self._differential(lines, specs)
        except NotMirroredError as exc:
            # a construct this host engine or in-guest side says it does not mirror
            # (harness.kernel.grammar.program: the plugin engine's, 7.3's $current): not a verdict
            self._not_mirrored(exc)
            return None
        except VMError as exc:
            return self._vm_error(lines, exc)
        except HarnessError as exc:
            return Finding(lines, "crash", f"{type(exc).__name__}: {exc}",
                           f"crash:{type(exc).__name__}:{_shape(str(exc))}")
        except Exception as exc:  # noqa: BLE001 - a traceback is a finding, with its text
            tb = traceback.format_exc(limit=6)
            return Finding(lines, "crash", tb, f"crash:{type(exc).__name__}:{_where(exc)}")

    def _not_mirrored(self, exc: NotMirroredError) -> None:
        """Count an example the oracle cannot judge, by its reason (the run's summary
        names them, so a count is never left unexplained)."""
        why = str(exc).splitlines()[0]
        self.stats.not_mirrored += 1
        self.stats.not_mirrored_why[why] = self.stats.not_mirrored_why.get(why, 0) + 1

    def _vm_error(self, lines: tuple[str, ...], exc: Exception) -> Finding:
        """A guest that died or hung: the finding, with the kernel's last console lines
        when it panicked (the oops names the code and the call trace). A panic or a hang
        the run's kernel watch saw (``harness.machine.kwatch``) is a ``kernel`` or ``hang``
        finding with its splats."""
        if isinstance(exc, KernelFinding):
            return kernel_finding(lines, exc.verdict, exc.splats)
        detail = str(exc).splitlines()[0]
        if "panicked" in detail:
            try:
                detail += "\n" + self.vm.console_tail(60)
            except Exception:  # noqa: BLE001 - the finding stands without the console
                pass
        return Finding(lines, "timeout" if "did not" in str(exc) else "crash", detail,
                       f"crash:{type(exc).__name__}")

    def _parse_refusal(self, line: str, exc: ProbeSpecError) -> Finding | None:
        ok, code, msg, col = guest_error(self.vm, line)
        ours = (str(exc), exc.column)
        if ok:
            return Finding((line,), "parse", f"host refuses ({ours[0]!r} at {ours[1]}), the "
                           "guest accepts", f"parse:host-refuses:{ours[0]}")
        if msg is None:                 # the kernel refused without a log entry
            self.stats.agreed_refusals += 1
            return None
        if (msg, col) != ours:
            return Finding((line,), "parse", f"guest {msg!r} at {col}, host {ours[0]!r} at "
                           f"{ours[1]}", f"parse:{msg}|{ours[0]}|{col == ours[1]}")
        self.stats.agreed_refusals += 1
        return None

    def _differential(self, lines: tuple[str, ...], specs: list[Any]) -> Finding | None:
        vm = self.vm
        host, guest = run_differential(vm, specs, self.workload, guest=self.guest,
                                       timeout=self.timeout)
        res = compare(host, guest, trampoline=trampoline_text(vm))
        left = _events_left(vm)
        if left.strip():
            vm.run("cd /sys/kernel/tracing; echo > kprobe_events; echo > uprobe_events", timeout=30)
        if headline(host.splats) is not None:       # the kernel complained during the run
            return kernel_finding(lines, str(headline(host.splats)), host.splats)
        if left.strip():
            return Finding(lines, "crash", f"probes left in the guest: {left.strip()}",
                           "crash:left-behind")
        if res.agrees:      # an empty run (nothing fired) agrees: it is no finding
            self.stats.agreed_runs += 1
            self.stats.events += res.total_matched
            return None
        d = res.divergences[0]
        kind = "registration" if d.field == "registration" else "events"
        # The class: which construct diverged (the argument as written, numbers blurred),
        # not which values: two different fetches that both differ are two findings.
        what = d.field
        if d.field.startswith("arg:"):
            for spec in specs:
                for a in spec.args:
                    if a.name == d.field[4:]:
                        what = "arg:" + _shape(a.comm or d.field[4:]) + (":" + a.type)
        sig = f"{kind}:{what}:{_shape(d.a_value)}|{_shape(d.b_value)}"
        for pattern, why in KNOWN:
            if re.search(pattern, sig):
                self.stats.known[why] = self.stats.known.get(why, 0) + 1
                return None
        return Finding(lines, kind, d.describe(res.a_side, res.b_side), sig)


def _events_left(vm: Machine) -> str:
    """The guest's ``kprobe_events`` and ``uprobe_events`` after a run, through the
    agent's file API: no guest process (an exec is ~15 ms under TCG). A file the kernel
    lacks (no uprobe events) is empty, as ``cat`` of it printed nothing."""
    out = []
    for f in ("kprobe_events", "uprobe_events"):
        try:
            out.append(vm.pull(f"/sys/kernel/tracing/{f}", timeout=30).decode("utf-8", "replace"))
        except GuestAgentError:
            pass
    return "".join(out)


def kernel_finding(lines: tuple[str, ...], verdict: str, splats: Any) -> Finding:
    """A run the kernel complained about (``harness.kernel.splat``): kind ``hang`` for
    ``HANG``, else ``kernel``; its class is the verdict and the first splat's title."""
    now = during(splats)
    title = now[0].title if now else verdict
    return Finding(lines, "hang" if verdict == "HANG" else "kernel", findings_text(splats),
                   f"kernel:{verdict}:{_shape(title)}")


def _shape(text: str) -> str:
    """A value with its numbers and names blurred: what makes two findings one class."""
    text = re.sub(r"0x[0-9a-f]+", "0xN", str(text))
    text = re.sub(r"\d+", "N", text)
    return re.sub(r"'[^']*'", "'S'", text)[:120]


def _where(exc: BaseException) -> str:
    tb = traceback.extract_tb(exc.__traceback__)
    last = tb[-1] if tb else None
    return f"{Path(last.filename).name}:{last.name}" if last else "?"


def repro_line(f: Finding, *, image: str | None = None, guest: str = "events",
               workload: str = DEFAULT_WORKLOAD) -> str:
    """The ``kph diff`` one-liner that shows ``f`` again."""
    opts = (f" --image {image}" if image else "") + (f" --guest {guest}" if guest != "events" else "") \
        + (" --refusals" if f.kind == "parse" else "")     # the host refuses the line
    # "--" first: a -: line would read as an option
    return "kph diff" + opts + f" --run {shlex.quote(workload)} -- " + \
        " ".join(shlex.quote(ln) for ln in f.lines)


# -- running ----------------------------------------------------------------------------

class _Found(Exception):
    def __init__(self, finding: Finding) -> None:
        super().__init__(finding.detail)
        self.finding = finding


def db_dir() -> Path:
    return C.cache_dir() / "fuzz" / "db"


def run(vm: Machine, *, examples: int, seed: int, guest: str = "events",
        workload: str = DEFAULT_WORKLOAD, time_budget: float | None = None,
        progress: Callable[[str], None] | None = None, database: bool = True,
        reboot: Callable[[], Any] | None = None,
        tick: Callable[[FuzzStats], None] | None = None) -> FuzzStats:
    """Fuzz ``examples`` examples (or until ``time_budget`` seconds) on ``vm``.

    ``reboot`` makes a fresh machine after a crash or a hang (the old one is closed and
    the run goes on there; the caller closes the last one, ``stats.vm``). ``tick`` is
    called with the stats after each example (``kph fuzz -n``'s shards report with it).
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.database import DirectoryBasedExampleDatabase

    oracle = Oracle(vm, guest=guest, workload=workload)
    stats = oracle.stats
    stats.vm = vm
    # Examples past MAX_TRACE_ARGS are generated on purpose; the parser's warning about
    # them (one per example) is not news here.
    logging.getLogger("harness.kernel.grammar").setLevel(logging.ERROR)
    strat = strategies(symbol_pool(vm, workload), rules=vm.facts.rules, guest=guest)
    known: set[str] = set()
    t0 = time.monotonic()
    say = progress or (lambda s: None)
    db = DirectoryBasedExampleDatabase(str(db_dir())) if database else None

    def body(lines: tuple[str, ...]) -> None:
        if time_budget is not None and time.monotonic() - t0 > time_budget:
            return
        stats.examples += 1
        if stats.examples % 25 == 0:
            say(f"fuzz: {stats.examples} examples, {len(stats.findings)} finding(s), "
                f"{60 * stats.examples / max(1e-9, time.monotonic() - t0):.0f}/min")
        f = oracle.judge(lines)
        if tick is not None:
            tick(stats)
        if f is not None and f.signature not in known:
            raise _Found(f)

    rounds = 0
    while stats.examples < examples and rounds < 50:
        if time_budget is not None and time.monotonic() - t0 > time_budget:
            break
        rounds += 1
        left = examples - stats.examples
        test = settings(max_examples=left, database=db, deadline=None, derandomize=False,
                        suppress_health_check=list(HealthCheck),
                        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                        report_multiple_bugs=False)(given(strat)(body))
        test = hseed(seed + rounds - 1)(test)
        try:
            with grammar_only():
                test()
            break
        except BaseException as exc:  # noqa: BLE001 - _Found, or Hypothesis's flaky group
            found = _found_in(exc)
            if found is None:
                raise
            f = found.finding
            if _is_flaky(exc):
                # The oracle's verdict changed when Hypothesis replayed the example: the
                # guest's execution is not the same twice (timing, other tasks). Kept, and
                # said so, with the example as first seen (not shrunk further).
                f = Finding(f.lines, f.kind, f.detail + " (did not repeat on replay)",
                            f.signature, f.repro, flaky=True)
            known.add(f.signature)
            stats.findings.append(f)
            say(f"fuzz: finding {len(stats.findings)} ({f.kind}): {f.lines[0][:100]}: "
                f"{f.detail.splitlines()[0][:160]}")
            if f.kind in ("crash", "timeout", "kernel", "hang") and reboot is not None:
                # The machine may be wedged after a crash or a hang: go on with a new one.
                try:
                    oracle.vm.close()
                except HarnessError:
                    pass
                oracle.vm = stats.vm = reboot()
                say("fuzz: a fresh machine after that finding")
    stats.seconds = time.monotonic() - t0
    return stats


def _found_in(exc: BaseException) -> "_Found | None":
    """The ``_Found`` in ``exc``, or in the exception group Hypothesis raised around it."""
    if isinstance(exc, _Found):
        return exc
    for sub in getattr(exc, "exceptions", ()) or ():
        got = _found_in(sub)
        if got is not None:
            return got
    cause = exc.__cause__ or exc.__context__
    return _found_in(cause) if isinstance(cause, BaseException) and cause is not exc else None


def _is_flaky(exc: BaseException) -> bool:
    from hypothesis.errors import Flaky

    return isinstance(exc, Flaky)


def list_examples(pool: list[str], *, examples: int, seed: int,
                  rules: Any = None, guest: str = "events") -> list[tuple[str, ...]]:
    """The examples a run with ``seed`` draws first on a kernel of ``rules`` (no database,
    nothing judged): the same list every time."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out: list[tuple[str, ...]] = []

    def body(lines: tuple[str, ...]) -> None:
        out.append(lines)

    test = settings(max_examples=examples, database=None, deadline=None,
                    suppress_health_check=list(HealthCheck), phases=[Phase.generate])(
        given(strategies(pool, rules=rules, guest=guest))(body))
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


# -- findings on disk -------------------------------------------------------------------

#: The suite replays every file here (tests/vm/test_fuzz.py): one example per file, its
#: lines one per line, ``#`` comments (the finding, the fix, the kernel source).
REGRESSIONS = Path(__file__).resolve().parents[2] / "tests" / "data" / "fuzz"


def regression_name(f: Finding) -> str:
    return hashlib.sha256(f.signature.encode()).hexdigest()[:12] + ".txt"


def write_regression(f: Finding, directory: Path = REGRESSIONS,
                     kernel: str | None = None) -> Path:
    """The finding as a case the suite replays (it must agree once the class is fixed);
    ``kernel``: the series it was found on, when not the default image's (a
    ``# kernel: SERIES`` line: the suite replays it on that kernel)."""
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / regression_name(f)
    p.write_text(f"# kph fuzz finding ({f.kind}): {f.detail.splitlines()[0][:300]}\n"
                 + (f"# kernel: {kernel}\n" if kernel else "")
                 + f"# signature: {f.signature}\n" + "".join(ln + "\n" for ln in f.lines))
    return p


_KERNEL_LINE = re.compile(r"^# kernel: (\S+)\s*$", re.M)


def read_regressions(directory: Path = REGRESSIONS) -> list[tuple[str, tuple[str, ...]]]:
    """(file name, lines) of every case (see :func:`regression_kernel` for its kernel)."""
    out = []
    for p in sorted(directory.glob("*.txt")) if directory.is_dir() else []:
        lines = tuple(ln for ln in p.read_text().splitlines() if ln.strip() and not ln.startswith("#"))
        if lines:
            out.append((p.name, lines))
    return out


def regression_kernel(name: str, directory: Path = REGRESSIONS) -> str | None:
    """The series a case names (``# kernel: 6.12``), None for the default image."""
    m = _KERNEL_LINE.search((directory / name).read_text())
    return m[1] if m else None
