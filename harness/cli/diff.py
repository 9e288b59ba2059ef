"""``kph diff``: run a probe set on both sides of one execution and report the first
divergence (``--host both``: the gdbstub engine, the plugin engine and the guest)."""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import MAX_RING_MIB, SetupError
from . import ci
from .common import (booted, ci_group, examples, exit_for, kernel_group, load_specs, machine,
                     qemu_group, spec_args, sub, verdict_group, verdict_opts, workload_ran)
from .common import kernel_report
from .output import Output, check_output

NAME = "diff"
#: --guest-buffer's bound (MiB): the events side takes it on each CPU, the module twice
MAX_BUFFER_MIB = 1024


def buffer_mib(text: str) -> int:
    """``--guest-buffer``'s value: whole MiB, 1 to :data:`MAX_BUFFER_MIB`."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_BUFFER_MIB:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in MiB from 1 to "
                                         f"{MAX_BUFFER_MIB} (e.g. --guest-buffer 64)")
    return n


def ring_mib(text: str) -> int:
    """``--host-buffer``'s value: MiB, a power of two from 1 to :data:`MAX_RING_MIB` (the
    plugin takes a ring of a power of two, probes/plugin/control.c: cmd_ring)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_RING_MIB or n & (n - 1):
        raise argparse.ArgumentTypeError(f"{text!r} is not a power of two of MiB from 1 to "
                                         f"{MAX_RING_MIB} (e.g. --host-buffer 64)")
    return n


EXAMPLES = ["kph diff 'p:open do_sys_openat2 path=+0(%si):ustring' "
            "'r:openret do_sys_openat2 ret=$retval:s64' --run 'cat /proc/version'",
            "kph diff -f probes/examples/open.spec --run 'cat /proc/version' --json "
            "--html open.html",
            "kph diff --image 6.12 'p:k kernel_clone' --trigger k=stacktrace "
            "--run 'ls / >/dev/null; ls /'"]


def add_parser(subparsers: Any) -> None:
    df = sub(subparsers, NAME, help="Run a probe set on both sides and report the first divergence",
             description="Place the specs in the guest (--guest) and host-side on "
             "top, observing one execution of --run; compare every hit field by "
             "field. Exit 0 equivalent, 1 divergent (or, with --strict, a normalization "
             "not allowed), 2 usage or setup error or a host engine that could not read "
             "(never a value), 3 the VM was lost (QEMU died), 4 empty: no probe both sides "
             "armed fired on either side, nothing was compared (--expect-empty: 0), 5 the "
             "kernel reported a splat during the run (WARNING, BUG, Oops, panic, KASAN, "
             "lockdep, RCU stall: whatever the comparison said), 6 the guest hung.",
             epilog=examples(EXAMPLES))
    spec_args(df)
    df.add_argument("--guest", choices=("events", "module"), default="events",
                    help="the in-guest side (default: tracefs kprobe_events)")
    df.add_argument("--host", choices=("gdbstub", "plugin", "both"), default="gdbstub",
                    help="the host-side engine: gdbstub (default), plugin, or both (three "
                    "worlds on one execution, every pair compared)")
    df.add_argument("--post-handler", action="store_true",
                    help="with --guest module: give each kprobe a post_handler (as "
                    "register_kprobe() takes one; it is then never optimized) and check "
                    "where it saw the probed instruction go against the instruction's own "
                    "outcome (its bytes, and the flags for a Jcc the kernel emulates): a "
                    "difference is field post-ip (docs/diff.md)")
    df.add_argument("--raw-kprobes", action="store_true",
                    help="with --guest module: register each kprobe line as a kernel module "
                    "does, register_kprobe() alone (samples/kprobes/kprobe_example.c), on "
                    "both sides: none of trace_kprobe's own checks around it (a function "
                    "without an ftrace location is not refused), so register_kprobe()'s "
                    "own refusals (blacklist, CFI preamble, instruction boundary) are what "
                    "is compared (docs/diff.md)")
    df.add_argument("--guest-buffer", type=buffer_mib, metavar="MIB",
                    help="the in-guest side's record buffer in MiB: each CPU's ring buffer "
                    "(buffer_size_kb) with --guest events, kph_kprobes.ko's bufsize with "
                    "--guest module (default: 16 each). A run whose records do not fit is "
                    "not compared (exit 2), and its error gives the size that would hold "
                    "them")
    df.add_argument("--host-buffer", type=ring_mib, metavar="MIB",
                    help="with --host plugin or both: the plugin engine's record ring per "
                    "vCPU in MiB, a power of two (default: 16). The host drains it every "
                    "2 ms while the workload runs; a hot probe whose records outrun the "
                    "drain has them dropped, the run is not compared (exit 2), and its "
                    "error gives the ring that would have held them")
    df.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    df.add_argument("--trigger", metavar="EVENT=stacktrace[:N]", action="append", default=[],
                    help="put a stacktrace trigger on an event of the lines (GROUP/EVENT or "
                    "EVENT), as `echo stacktrace > events/GROUP/EVENT/trigger` does, N times "
                    "at most: the guest's trace takes a stack trace after each record, the "
                    "host takes regs.stack_trace() at the hit, and the two are compared "
                    "frame for frame from the probed function down (docs/diff.md). "
                    "Repeatable; the gdbstub engine and --guest events")
    df.add_argument("--refusals", action="store_true",
                    help="a line the host's parser refuses is asked of the guest too, not "
                    "stopped at with exit 2: written to its tracefs, the guest's errno, "
                    "error_log message and caret are compared with the host's (exit 0 "
                    "when both refuse alike, 1 when the guest accepts it or refuses "
                    "otherwise). How kph fuzz and kph hunt judge a refusal; their "
                    "reproducers of one pass it")
    df.add_argument("--writers", type=int, default=1, metavar="N",
                    help="with --refusals: then write the lines refused alike from N "
                    "writers at once (a shell loop each, over rounds), and check that "
                    "every error_log entry is one line's own, as each logged it alone; "
                    "the kernel parses one command at a time (dyn_event_ops_mutex), so "
                    "a message against another writer's command is a finding (exit 1). "
                    "Give --smp 2 for writers on two CPUs (docs/diff.md)")
    verdict_group(df)
    kernel_group(df)
    qemu_group(df)
    ci_group(df)


@ci.reported(NAME)
def run(args: argparse.Namespace, out: Output) -> int:
    from ..diff import ktap, report
    from ..diff.verdict import compare
    from ..diff.runner import run_differential, trampoline_text

    check_output("-o", out.json_file)
    check_output("--html", args.html)
    from ..backends.triggers import check_counts, parse_triggers

    verdict = verdict_opts(args)
    if args.writers != 1 and not args.refusals:
        raise SetupError(f"--writers {args.writers} without --refusals: the writers write "
                         "refused lines", "add --refusals")
    if args.writers < 1:
        raise SetupError(f"--writers {args.writers}: no writer", "give 1 or more")
    refused: list[str] | None = [] if args.refusals else None
    specs = load_specs(args, refused)
    if refused:
        if specs:
            raise SetupError(f"--refusals: {refused[0]!r} is refused by the host's parser and "
                             f"{len(specs)} other line(s) are not",
                             "run the refused lines and the others as two kph diff commands")
        return run_refusals(args, refused, out)
    triggers = parse_triggers(args.trigger)
    check_counts(triggers, specs)
    if triggers and (args.host != "gdbstub" or args.guest != "events"):
        raise SetupError("--trigger compares the gdbstub engine with --guest events (the "
                         "plugin's records hold no stack; triggers are event triggers)",
                         "use --host gdbstub --guest events with --trigger")
    if args.guest == "module" and any(s.is_uprobe for s in specs):
        raise SetupError("the module backend has kprobes only; these specs include uprobes",
                         "use --guest events (uprobe_events) for uprobe lines")
    if args.post_handler and args.guest != "module":
        raise SetupError("--post-handler is the module backend's (a kprobe_events probe has "
                         "no post_handler)", "add --guest module")
    if args.raw_kprobes and args.guest != "module":
        raise SetupError("--raw-kprobes is the module backend's (kprobe_events always runs "
                         "trace_kprobe's checks)", "add --guest module")
    if args.host_buffer and args.host == "gdbstub":
        raise SetupError(f"--host-buffer {args.host_buffer}: the ring is the plugin engine's "
                         "(the gdbstub engine records at each stop)",
                         "add --host plugin (or --host both)")
    if (args.post_handler or args.raw_kprobes) and args.host == "both":
        raise SetupError("--post-handler and --raw-kprobes with --host both are not "
                         "supported",
                         "use --host gdbstub or --host plugin")
    if args.host == "both":
        return run_three(args, specs, out, verdict)
    out.progress("booting" + (" cold (--cold)" if args.cold else ""))
    with machine(args) as vm:
        booted(vm, args, out)
        runs = run_differential(vm, specs, args.run, guest=args.guest, timeout=args.timeout,
                                progress=out.progress, triggers=triggers,
                                post_handler=args.post_handler,
                                raw_kprobes=args.raw_kprobes, buffer_mib=args.guest_buffer)
        tramp = trampoline_text(vm)
        kernel = ci.kernel_of(vm)
    workload_ran(runs[0], args.run)
    out.progress("comparing the two sides")
    res = compare(*runs, trampoline=tramp, **verdict)
    out.progress.clear()
    out.text(report.text(res, workload=args.run, status=runs[0].workload_status,
                         stderr=runs[0].workload_stderr))
    kernel_report(runs[0].splats, out)
    out.result(lambda: dict(report.json_doc(res, runs),
                            kernel=report.findings_json(runs[0].splats)))
    ci.emit(args, ktap.diff_cases(res, kernel=kernel, findings=[
        s.headline() for s in runs[0].splats if not s.before]), verb=NAME, kernel=kernel)
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.to_html(res, runs, workload=args.run))
        out.text(f"wrote {args.html}")
    return exit_for(res, runs[0].splats)


def run_three(args: argparse.Namespace, specs: list[Any], out: Output,
              verdict: dict[str, Any]) -> int:
    """``kph diff --host both``: gdbstub, plugin and guest on one execution (harness.diff.worlds)."""
    from ..diff import ktap, report
    from ..diff.worlds import run_three as three_worlds

    out.progress("booting" + (" cold (--cold)" if args.cold else ""))
    with machine(args) as vm:
        booted(vm, args, out)
        out.progress("three worlds: registering, running the workload, collecting")
        three = three_worlds(vm, specs, args.run, guest=args.guest, timeout=args.timeout,
                             buffer_mib=args.guest_buffer, **verdict)
        kernel = ci.kernel_of(vm)
    workload_ran(three.runs[0], args.run)       # as plain kph diff: 126/127 is exit 2
    out.progress.clear()
    for res in three.pairs:
        out.text(report.text(res, workload=args.run, status=three.runs[0].workload_status))
    first = three.first_divergence()
    out.text(f"three worlds: {'EQUIVALENT' if first is None else first.verdict_word.upper()}"
             + ("" if first is None else f" first between {first.a_side} and {first.b_side}"))
    which = ((0, 2), (1, 2), (0, 1))
    kernel_report(three.runs[0].splats, out)
    out.result(lambda: {"equivalent": first is None,
                        "kernel": report.findings_json(three.runs[0].splats),
                        "pairs": [report.json_doc(r, (three.runs[i], three.runs[j]))
                                  for r, (i, j) in zip(three.pairs, which, strict=True)]})
    ci.emit(args, ktap.three_cases(three.pairs, kernel=kernel), verb=NAME, kernel=kernel)
    if args.html:
        k = three.pairs.index(first) if first is not None else 0
        i, j = which[k]
        with open(args.html, "w") as f:
            f.write(report.to_html(three.pairs[k], (three.runs[i], three.runs[j]), workload=args.run))
    return exit_for(first or three.pairs[0], three.runs[0].splats)


def run_refusals(args: argparse.Namespace, lines: list[str], out: Output) -> int:
    """``kph diff --refusals`` with lines the host's parser refuses: each is written to
    the guest's tracefs by the fuzzer's oracle (harness.apps.fuzz.Oracle: the kernel's
    text of a uprobe place, the errno, the last error_log entry and its caret), which
    reports where the two refusals differ."""
    from ..apps.fuzz import WRITER_ROUNDS, Oracle, concurrent_writers
    from ..diff.ktap import Case
    from .output import EXIT_DIVERGED, EXIT_HANG, EXIT_KERNEL, EXIT_OK

    out.progress("booting" + (" cold (--cold)" if args.cold else ""))
    rows = []
    with machine(args, gdb=False) as vm:
        booted(vm, args, out)
        oracle = Oracle(vm, guest=args.guest, workload=args.run, timeout=args.timeout)
        kernel = ci.kernel_of(vm)
        for ln in lines:
            out.progress(f"asking the guest: {ln[:60]}")
            got = oracle.judge((ln,))
            rows.append((ln, got))
        alike = tuple(ln for ln, got in rows if got is None)
        if args.writers > 1 and alike:
            out.progress(f"{args.writers} writers at once, {len(alike)} line(s), "
                         f"{WRITER_ROUNDS} rounds")
            rows.append((f"(the {len(alike)} line(s) above from {args.writers} writers at "
                         "once)", concurrent_writers(vm, alike, args.writers)))
    out.progress.clear()
    for ln, got in rows:
        out.text(f"  {ln}\n    " + ("both refused alike (errno, error_log message, caret)"
                                     if got is None else f"DIVERGENT ({got.kind}): {got.detail}"))
    bad = [r for r in rows if r[1] is not None]
    out.text(f"result: {'divergent' if bad else 'both refused'}: {len(rows) - len(bad)} of "
             f"{len(rows)} line(s) refused alike")
    out.result(lambda: {"equivalent": not bad, "refusals": [
        {"line": ln, "agrees": got is None, "kind": got.kind if got else "",
         "detail": got.detail if got else ""} for ln, got in rows]})
    ci.emit(args, [Case.parent("refusals", [
        Case(ln, "pass" if got is None else "fail", got.detail if got else "")
        for ln, got in rows], kernel=kernel)], verb=NAME, kernel=kernel)
    kinds = {got.kind for _, got in bad}
    return EXIT_HANG if "hang" in kinds else EXIT_KERNEL if "kernel" in kinds else \
        EXIT_DIVERGED if bad else EXIT_OK
