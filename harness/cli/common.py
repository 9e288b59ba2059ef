"""What several verbs share: their option groups (kernel selection, QEMU, probes, verdict)
and the steps around a run (parse the specs before booting, boot, check the workload ran).

The library is imported inside the functions that use it, as in every verb module:
``kph --help`` and a Ctrl-C during start-up must not wait for QEMU's, GDB's and the
probe grammar's modules.
"""
from __future__ import annotations

import argparse
import errno as _errno
import os
import sys
from typing import Any, TYPE_CHECKING

from ..errors import ProbeSpecError, SetupError
from .output import EXIT_DIVERGED, EXIT_EMPTY, EXIT_KERNEL, EXIT_OK, Output, output_options

if TYPE_CHECKING:   # the CLI and the pytest plugin load the machine only when used
    from ..vmctl import Machine


def examples(lines: list[str], extra: str = "") -> str:
    """A verb's ``--help`` epilog: its examples (run as written by the docs tests)."""
    shown = [f"  {ex}" for ex in lines]
    return ((extra + "\n") if extra else "") + "examples:\n" + "\n".join(shown)


def sub(subparsers: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
    """A (sub)command's parser, with the output options every command takes."""
    kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    p = subparsers.add_parser(name, **kw)
    output_options(p, top=False)
    return p


def kernel_group(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kernel selection (default: the embedded default image)")
    g.add_argument("--kernel", metavar="F", help="a bzImage, or a kernel build directory")
    g.add_argument("--initrd", metavar="F", help="an initramfs (default: the image's)")
    g.add_argument("--vmlinux", metavar="F", help="the kernel's ELF with symbols (default: the "
                   "image's kallsyms, or the guest's /proc/kallsyms)")
    g.add_argument("--image", metavar="SERIES|ABI|DIR|tree:TREE",
                   help="an image other than the default: a series (6.12; Debian's kernel "
                   "of it, its image built first when missing), an ABI, an image directory, "
                   "or tree:TREE[+PATCH...] (a kernel tree's image, built first: kph image "
                   "build --tree)")


def qemu_group(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("QEMU")
    g.add_argument("--qemu", metavar="PATH", help="qemu-system-x86_64 to use (also $KPH_QEMU)")
    g.add_argument("--smp", type=int, default=1, metavar="N", help="virtual CPUs (default 1)")
    g.add_argument("--memory", default="512M", metavar="SIZE", help="guest memory (default 512M)")
    g.add_argument("--accel", choices=("tcg", "kvm"), default="tcg",
                   help="tcg (default, tested) or kvm where /dev/kvm works")
    g.add_argument("--append", metavar="ARGS", help="kernel command line (replaces the default)")
    g.add_argument("--cold", action="store_true", help="boot cold, not from the image's ready "
                   "snapshot (also $KPH_COLD=1)")
    g.add_argument("--dry-run", action="store_true", help="print the QEMU command line and exit")


def spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Probes")
    g.add_argument("specs", nargs="*", metavar="SPEC", help="a kprobe_events line (repeatable)")
    g.add_argument("-f", dest="spec_file", metavar="FILE", help="read specs, one per line (# comments)")
    g.add_argument("--run", required=True, metavar="CMD", help="the guest workload (a shell command)")
    g.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="limit for the workload (default 120)")


def verdict_group(p: argparse.ArgumentParser) -> None:
    from ..diff.verdict import NORMALIZATIONS

    g = p.add_argument_group("Verdict", "what may make two sides equivalent "
                             "(docs/diff.md lists every normalization)")
    g.add_argument("--strict", action="store_true",
                   help="no normalization except those --allow names: any other applied "
                   "is exit 1, named with its count")
    g.add_argument("--allow", metavar="RULE,...", default="", action=_AllowAction,
                   help="with --strict, the normalizations to accept: "
                   + ", ".join(NORMALIZATIONS) + " (--allow help: each rule with its "
                   "kernel reason and the evidence it needs)")
    g.add_argument("--expect-empty", action="store_true",
                   help="a run in which no armed probe fires on either side is the "
                   "expected result (exit 0, not 4)")


def ci_group(p: argparse.ArgumentParser) -> None:
    """--ktap, --ktap-file, --kcidb: the result for kernel CI (harness.cli.ci, docs/ci.md)."""
    g = p.add_argument_group("CI results", "the result as KTAP v1 and KCIDB (docs/ci.md)")
    g.add_argument("--ktap", action="store_true",
                   help="write the result as KTAP v1 to stdout, and nothing else (not with --json)")
    g.add_argument("--ktap-file", metavar="FILE", help="write the result as KTAP v1 to FILE")
    g.add_argument("--kcidb", metavar="FILE",
                   help="write the result as KCIDB I/O JSON (schema v5.3) to FILE")
    g.add_argument("--kcidb-origin", metavar="NAME", default="kph",
                   help="the KCIDB origin of the ids (default kph; a CI submits as its own)")


class _AllowAction(argparse.Action):
    """``--allow help`` prints the rule registry (``harness.diff.rules``) and exits 0, as
    ``--help`` does; any other value is kept for :func:`verdict_opts`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if values == "help":
            from ..diff.rules import help_text
            print(help_text())
            parser.exit(0)
        setattr(namespace, self.dest, values)


def verdict_opts(args: argparse.Namespace) -> dict[str, Any]:
    """compare()'s verdict options from --strict/--allow/--expect-empty; a rule that does
    not exist is a usage error before anything boots."""
    from ..diff.verdict import NORMALIZATIONS

    allow = tuple(r.strip() for r in args.allow.split(",") if r.strip())
    bad = [r for r in allow if r not in NORMALIZATIONS]
    if bad:
        raise SetupError(f"--allow {','.join(bad)}: no such normalization",
                         f"choose from {', '.join(NORMALIZATIONS)}")
    if allow and not args.strict:
        raise SetupError("--allow without --strict allows nothing more",
                         "add --strict (without it every documented normalization applies)")
    return {"strict": args.strict, "allow": allow, "expect_empty": args.expect_empty}


def exit_for(res: Any, splats: Any = ()) -> int:
    """0 equivalent, 1 diverged or not strict, 4 empty (nothing measured); 5 whatever the
    comparison said when the kernel reported a splat during the run (``splats``)."""
    if kernel_verdict(splats) is not None:
        return EXIT_KERNEL
    word = res.verdict_word
    return {"equivalent": EXIT_OK, "empty": EXIT_EMPTY}.get(word, EXIT_DIVERGED)


def kernel_verdict(splats: Any) -> str | None:
    """The run's kernel verdict (``KERNEL-WARNING``...), None without a splat in its window."""
    if not splats:
        return None
    from ..kernel.splat import headline
    return headline(splats)


def kernel_report(splats: Any, out: Output, *, full_text: str | None = None) -> None:
    """The kernel's splats of a run, for people (nothing when there were none); with
    ``full_text`` (the file holding them) only their headlines."""
    if splats:
        from ..diff.report import findings_text
        out.text(findings_text(splats, full_text=full_text))


def spec_file_lines(path: str) -> list[str]:
    """The spec lines of ``-f FILE`` (blank lines and # comments left out)."""
    try:
        text = open(path).read()
    except OSError as exc:
        raise SetupError(f"cannot read {path}: {exc.strerror}", "check the path") from exc
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def load_specs(args: argparse.Namespace, refused: list[str] | None = None) -> list[Any]:
    """Parse every spec, with the image's symbols where the kernel's parser uses them
    (``kprobe_on_func_entry()``, ``number_of_same_symbols()``), before booting: what the
    kernel refuses while parsing a line is refused here, in its order and words. With
    ``refused`` (a list), such a line is put there instead, for the caller to ask the
    guest (``kph diff --refusals``)."""
    from ..kernel.grammar import parse

    def parsed(ln: str, **kw: Any) -> Any:
        try:
            return parse(ln, **kw)
        except ProbeSpecError:
            if refused is None:
                raise
            refused.append(ln)
            return None

    lines = list(args.specs)
    if args.spec_file:
        lines += spec_file_lines(args.spec_file)
    if not lines:
        raise SetupError("no probe spec given", "pass SPEC arguments or -f FILE")
    if all(ln.lstrip().startswith("-") for ln in lines):
        raise SetupError(f"{lines[0]!r} deletes probes, and no line defines one",
                         "give the definitions the -: lines delete (after `--`), e.g. "
                         "kph diff --run true -- 'p:e do_sys_openat2' '-:e'")
    if args.kernel is not None:
        # no facts before boot: the grammar of the newest rules; the booted kernel's own
        # rules, BTF and symbols decide at registration (harness.backends.tracelayer)
        from ..kernel.rules import SERIES
        from ..kernel.grammar import KernelView
        newest = KernelView(list(SERIES.values())[-1])
        return [x for ln in lines if (x := parsed(ln, kernel=newest)) is not None]
    from ..machine.image.facts import kernel_view
    from ..machine.image.store import default_image

    # the image's kernel: its series' rules, its BTF, its symbols
    view = kernel_view(default_image(args.image).facts)
    return [x for ln in lines if (x := parsed(ln, kernel=view)) is not None]


def workload_ran(r: Any, workload: str) -> None:
    """126/127 from the workload's shell: the command was not run (not found, not
    executable). That is a usage error, not a result."""
    if r.workload_status in (126, 127):
        said = " | ".join(ln for ln in r.workload_stderr.strip().splitlines() if ln.strip())
        raise SetupError(f"the workload {workload!r} did not run (exit {r.workload_status}"
                         + (f": {said})" if said else ")"),
                         "check the command exists in the guest image (busybox applets, "
                         "/usr/bin/kph-*)")


def machine(args: argparse.Namespace, *, gdb: bool | None = None) -> Any:
    """The machine of a verb that places probes (``--host plugin``/``both``: the plugin's).
    ``gdb``: whether the verb attaches GDB (its start then overlaps the boot:
    ``Machine.boot(early_gdb=True)``); by default, where ``--host`` is gdbstub or both."""
    from ..vmctl import Machine

    kind = getattr(args, "host", "gdbstub")
    host = "plugin" if kind in ("plugin", "both") else "gdbstub"
    if gdb is None:
        gdb = kind in ("gdbstub", "both")
    vm = Machine.boot(args.image, kernel=args.kernel, initrd=args.initrd, vmlinux=args.vmlinux,
                      smp=args.smp, accel=args.accel, memory=args.memory, append=args.append,
                      qemu=args.qemu, fresh=not args.cold, host=host, early_gdb=gdb)
    # read when the plugin engine starts, at its first use (kph diff --host-buffer)
    vm.plugin_ring_mib = getattr(args, "host_buffer", None)
    return vm


def started(vm: Machine, args: argparse.Namespace) -> str:
    """How a machine started, in words: restored from which snapshot, or cold and why."""
    if vm.start_mode == "snapshot":
        return f"restored from {vm.snapshot.dir} in {vm.boot_seconds:.2f} s"
    why = vm.cold_reason or ("--cold" if getattr(args, "cold", False) else
                             "$KPH_COLD is set" if os.environ.get("KPH_COLD") else "no snapshot")
    return f"cold boot ({why}) in {vm.boot_seconds:.2f} s"


def booted(vm: Machine, args: argparse.Namespace, out: Output) -> None:
    out.progress(f"booted: {started(vm, args)}")
    rules_note(vm, out)


def rules_note(vm: Machine, out: Output) -> None:
    """For a kernel not of Debian's images (a tree's image, ``--kernel``): which series'
    rules the host side mirrors."""
    own = vm.image is None or vm.image.manifest.get("kernel_origin") == "tree"
    if own and vm.facts is not None:
        out.text(f"kernel {vm.facts.release}: the host side uses Linux "
                 f"{vm.facts.rules.series}'s probe-event rules (the nearest series at or "
                 "below it)")


def warn_slow_qemu(q: Any, out: Output) -> None:
    if not q.fast_gdbstub:
        out.warn(f"QEMU {q.version_str} flushes its translation cache on every "
                 "breakpoint hit (~70 ms); ./setup.sh provisions QEMU >= 10.2")


def refusals(outcomes: list[Any], out: Output | None = None) -> int:
    """One ``error:`` line per refused spec (errors: shown with -q too)."""
    if out is not None:
        out.progress.clear()
    bad = 0
    for o in outcomes:
        if not o.accepted:
            bad += 1
            why = o.message if not o.reason or o.reason == o.message else \
                f"{o.message}: {o.reason}" if o.message else o.reason
            print(f"error: probe {o.probe} refused: {_errno.errorcode.get(o.errno, o.errno)} "
                  f"({why})", file=sys.stderr)
    return bad
