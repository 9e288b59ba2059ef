"""``kph``: the command line. The only module that prints or configures logging."""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any, Callable, Sequence

from .errors import (HarnessError, NotMirroredError, ProbeSpecError, ScenarioError, SetupError,
                     VMError)

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE, EXIT_INFRA = 0, 1, 2, 3

DESCRIPTION = """\
kprobe-harness: boot a real x86_64 Linux kernel under QEMU and probe it with kprobe
semantics, from the host through QEMU's gdbstub and inside the guest as real kprobes.

With no kernel named, every command uses the embedded default image (the current Debian
cloud kernel with a busybox initramfs), built by `kph image build` into $KPH_CACHE
(default ~/.cache/kprobe-harness).
"""

EPILOG = """\
first steps:
  kph doctor                              what QEMU, gdb and image will be used
  kph image build                         provision the default image (idempotent)
  kph boot --run 'uname -r'               boot it, run a command, power off
  kph probe 'p:open do_sys_openat2 dfd=%di:s32' --run 'cat /proc/version'
  kph diff  'p:open do_sys_openat2 path=+0(%si):ustring' --run 'cat /proc/version'
exit status: 0 success, 1 divergence or failed command, 2 usage/setup error,
3 the VM was lost (panic, QEMU died, timeout)."""


def _kernel_group(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Kernel selection (default: the embedded default image)")
    g.add_argument("--kernel", metavar="F", help="a bzImage, or a kernel build directory")
    g.add_argument("--initrd", metavar="F", help="an initramfs (default: the image's)")
    g.add_argument("--vmlinux", metavar="F", help="the kernel's ELF with symbols (default: the "
                   "image's kallsyms, or the guest's /proc/kallsyms)")
    g.add_argument("--image", metavar="VERSION|DIR", help="an image in the cache other than the default")


def _qemu_group(p: argparse.ArgumentParser) -> None:
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


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kph", description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--log-level", default="WARNING",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="library log level")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    img = sub.add_parser("image", help="Build, list or show the images (one per kernel)")
    isub = img.add_subparsers(dest="image_cmd", metavar="ACTION")
    b = isub.add_parser("build", help="Provision an image: kernel, initramfs, kernel facts, "
                        "module, ready snapshot",
                        description="Build the image of a Debian cloud kernel: its packages, "
                        "a busybox initramfs with qemu-ga, the test programs and kph_kprobes.ko "
                        "(built with that kernel's own compiler), its kernel facts (kallsyms, "
                        "blacklist, BTF, ...) harvested on a first boot, and its ready snapshot.")
    b.add_argument("--kernel", metavar="SERIES|ABI", default=None,
                   help="which kernel: a series (6.1, 6.12, 7.3: what Debian 12, Debian 13 "
                   "and Debian 13 backports ship today) or a full ABI such as "
                   "6.12.117+deb13-cloud-amd64; default: Debian 12's, the default image")
    b.add_argument("--force", action="store_true", help="rebuild even when the cache is current")
    b.add_argument("--qemu", metavar="PATH", help="QEMU for the harvesting boot and the snapshot")
    b.add_argument("--no-snapshot", action="store_true",
                   help="do not make the ready snapshot (the first boot makes it)")
    inf = isub.add_parser("info", help="Print an image's manifest and its snapshots (JSON)")
    inf.add_argument("--image", metavar="SERIES|ABI|DIR", help="the image (default: the default)")
    isub.add_parser("list", help="List the images in the cache")

    q = sub.add_parser("qemu", help="Provision or show the QEMU the harness uses")
    qsub = q.add_subparsers(dest="qemu_cmd", metavar="ACTION")
    pv = qsub.add_parser("provision", help="Unpack QEMU >= 10.2 from Debian 13 backports "
                         "into the cache (skipped when the system QEMU is new enough)")
    pv.add_argument("--force", action="store_true", help="provision even if one exists")
    qsub.add_parser("which", help="Print the QEMU that would be used and why")

    bt = sub.add_parser("boot", help="Boot the default image (or --kernel/--initrd) and run commands",
                        description="Boot, run each --run command in the guest printing its "
                        "output, power off. Exit status: that of the last command.")
    bt.add_argument("--run", action="append", default=[], metavar="CMD",
                    help="a shell command to run in the guest (repeatable)")
    bt.add_argument("--timeout", type=float, default=60.0, metavar="S",
                    help="limit for each command (default 60)")
    bt.add_argument("--console", action="store_true", help="print the guest console at the end")
    _kernel_group(bt)
    _qemu_group(bt)

    pr = sub.add_parser("probe", help="Place SPEC on one side (--backend), run a workload, "
                        "print events", description="Place kprobe_events specs host-side "
                        "(through the gdbstub) or in the guest (tracefs or the kph module), "
                        "run --run, print the events as the trace file would.",
                        epilog="SPEC example: 'p:open do_sys_openat2 dfd=%%di:s32 "
                        "path=+0(%%si):ustring' or 'r:openret do_sys_openat2 ret=$retval:s64'")
    _spec_args(pr)
    pr.add_argument("--backend", choices=("host", "events", "module"), default="host",
                    help="where the probes go (default host)")
    pr.add_argument("--host", choices=("gdbstub", "plugin"), default="gdbstub",
                    help="the host-side engine: gdbstub (default, the reference) or the QEMU "
                    "plugin (microseconds per hit, vCPUs not stopped)")
    pr.add_argument("--json", action="store_true", help="print the hits as JSON")
    _kernel_group(pr)
    _qemu_group(pr)

    df = sub.add_parser("diff", help="Run a probe set on both sides and report the first divergence",
                        description="Place the specs in the guest (--guest) and host-side on "
                        "top, observing one execution of --run; compare every hit field by "
                        "field. Exit 0 equivalent, 1 divergent, 2 usage or setup error.")
    _spec_args(df)
    df.add_argument("--guest", choices=("events", "module"), default="events",
                    help="the in-guest side (default: tracefs kprobe_events)")
    df.add_argument("--host", choices=("gdbstub", "plugin", "both"), default="gdbstub",
                    help="the host-side engine: gdbstub (default), plugin, or both (three "
                    "worlds on one execution, every pair compared)")
    df.add_argument("--json", metavar="FILE", help="write the result as JSON")
    df.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    _kernel_group(df)
    _qemu_group(df)

    mx = sub.add_parser("matrix", help="Run a probe set on several kernels; show where they differ",
                        description="For each kernel (--kernels), boot its image (built first "
                        "if missing), place the specs host-side and in the guest on one "
                        "execution of --run and compare them (as kph diff); then compare the "
                        "kernels' guests with each other: registration, probe mode, event "
                        "counts and the printed fields. Exit 0 when host and guest agree on "
                        "every kernel, 1 otherwise, 2 on usage or setup errors.",
                        epilog="example: kph matrix -f probes/examples/matrix.spec --run "
                        "'sh -c \"true & wait\"' --kernels 6.1,6.12,7.3")
    _spec_args(mx)
    mx.add_argument("--kernels", default="6.1,6.12,7.3", metavar="K,K,...",
                    help="kernel series or ABIs, comma-separated (default 6.1,6.12,7.3)")
    mx.add_argument("--guest", choices=("events", "module"), default="events",
                    help="the in-guest side (default: tracefs kprobe_events)")
    mx.add_argument("--json", metavar="FILE", help="write the result as JSON")
    mx.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    mx.add_argument("--qemu", metavar="PATH", help="qemu-system-x86_64 to use")

    wk = sub.add_parser("worker", help="Prepare a host over SSH as a pytest-xdist worker",
                        description="Scale the differential suite out to other machines "
                        "with pytest-xdist's SSH gateways (see docs: running across machines).")
    wsub = wk.add_subparsers(dest="worker_cmd", metavar="ACTION")
    wp = wsub.add_parser("prepare", help="Send this commit to HOST, run setup.sh there, build "
                         "the images, check it is identical, print the --tx spec",
                         epilog="example: kph worker prepare root@build2 --dir /srv/kph "
                         "--kernels 6.12,7.3, then: pytest -d --tx <printed spec> --tx popen "
                         "--dist loadgroup")
    wp.add_argument("target", metavar="[USER@]HOST", help="an ssh target (or a Host of --ssh-config)")
    wp.add_argument("--dir", required=True, metavar="PATH", help="the worker's checkout on HOST")
    wp.add_argument("--commit", default="HEAD", metavar="REV", help="what to check out (default HEAD)")
    wp.add_argument("--kernels", default="", metavar="K,K,...",
                    help="images to build there besides the default (e.g. 6.12,7.3)")
    wp.add_argument("--cache", metavar="DIR", help="KPH_CACHE on HOST (default: its own default)")
    wp.add_argument("--ssh-config", metavar="FILE", help="an ssh_config for the connection")
    wi = wsub.add_parser("identity", help="Print this checkout's identity as JSON (commit, "
                         "QEMU, images, cores): what prepare compares")
    wi.add_argument("--kernels", default="", metavar="K,K,...", help="only these images")

    rp = sub.add_parser("repro", help="Reproduce a probe bug and keep the evidence",
                        description="Run a scenario file (probes/scenarios/*.toml), decide "
                        "whether its expectation is met and write an evidence bundle. Exit 0 "
                        "met, 1 not met, 2 for a bad scenario (the key at fault is named).")
    rp.add_argument("scenario", metavar="SCENARIO.toml", nargs="?",
                    help="the scenario (optional with --replay: the bundle holds its own)")
    rp.add_argument("--out", metavar="DIR", help="bundle directory (default repro-NAME-TIME)")
    rp.add_argument("--record", action="store_true",
                    help="run under QEMU record/replay (-icount rr=record, one vCPU, in-guest "
                    "probes only); the bundle then holds the replay log")
    rp.add_argument("--replay", metavar="DIR", help="replay a --record bundle to its end and "
                    "check the console and the final registers are identical")
    rp.add_argument("--gdb", action="store_true",
                    help="with --replay: stay stopped at the end with the gdbstub open for "
                    "reverse-stepi / reverse-continue; Ctrl-C ends QEMU")
    rp.add_argument("--qemu", metavar="PATH", help="qemu-system-x86_64 to use")

    dm = sub.add_parser("demo", help="Walk through a real kprobe trap, step by step")
    dsub = dm.add_subparsers(dest="demo_cmd", metavar="DEMO")
    tf = dsub.add_parser("trap-flow", help="A real in-guest kprobe fires; the host watches every step",
                         description="Load an int3-based kprobe with pre and post handlers in the "
                         "guest (the harness's module) and watch, with silent host breakpoints, "
                         "the int3, the exception entry, kprobes core, the handlers, the "
                         "out-of-line slot and the return; then the same probe ftrace-based, "
                         "jump-optimized, and a kretprobe. The guest is left as it was.")
    tf.add_argument("--symbol", default="do_sys_openat2+5", metavar="SYM[+OFF]",
                    help="where the int3 probe goes, not a function entry (default "
                         "do_sys_openat2+5); the ftrace and kretprobe variants use SYM")
    tf.add_argument("--run", default="cat /proc/version", metavar="CMD",
                    help="the guest command that makes it fire (default: cat /proc/version)")
    tf.add_argument("--variants", default="int3,ftrace,optimized,kretprobe",
                    help="comma-separated subset of int3,ftrace,optimized,kretprobe,uprobe,"
                         "uretprobe (the last two: a uprobe_events probe on kph_add in "
                         "/usr/bin/kph-loop, the XOL slot, the uretprobe trampoline)")
    tf.add_argument("--html", metavar="FILE", help="write a self-contained page with a "
                    "sequence diagram and the step table")
    tf.add_argument("--step", action="store_true", help="wait for Enter between steps")

    sub.add_parser("doctor", help="Report QEMU, gdb, KVM, the image cache and what to fix")
    return p


def _spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Probes")
    g.add_argument("specs", nargs="*", metavar="SPEC", help="a kprobe_events line (repeatable)")
    g.add_argument("-f", dest="spec_file", metavar="FILE", help="read specs, one per line (# comments)")
    g.add_argument("--run", required=True, metavar="CMD", help="the guest workload (a shell command)")
    g.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="limit for the workload (default 120)")


def _boot(args: argparse.Namespace) -> int:
    from .vmctl import Machine

    opts: dict[str, Any] = dict(kernel=args.kernel, initrd=args.initrd, vmlinux=args.vmlinux,
                                smp=args.smp,
                                accel=args.accel, memory=args.memory, append=args.append,
                                qemu=args.qemu)
    if args.dry_run:  # the cold command line; a restore adds -incoming and the RAM file
        print(Machine.prepare(args.image, **opts).dry_run())
        return EXIT_OK
    status = EXIT_OK
    vm = Machine.boot(args.image, fresh=not args.cold, **opts)
    with vm:
        if not args.quiet and vm.start_mode == "snapshot":
            _progress(f"boot: restored from {vm.snapshot.dir} in {vm.boot_seconds:.2f} s")
        elif not args.quiet and vm.cold_reason:
            _progress(f"boot: cold ({vm.cold_reason}) in {vm.boot_seconds:.2f} s")
        _warn_slow_qemu(vm.qemu, args)
        for cmd in args.run:
            r = vm.run(cmd, timeout=args.timeout)
            sys.stdout.write(r.stdout)
            sys.stderr.write(r.stderr)
            sys.stdout.flush()
            status = r.status
        if args.console:
            print(vm.console_text(), end="")
    return status


def _warn_slow_qemu(q: Any, args: argparse.Namespace) -> None:
    if not q.fast_gdbstub and not args.quiet:
        print(f"warning: QEMU {q.version_str} flushes its translation cache on every "
              "breakpoint hit (~70 ms); ./setup.sh provisions QEMU >= 10.2", file=sys.stderr)


def _image(args: argparse.Namespace) -> int:
    from .imagebuild import build_image
    from .images import default_image

    if args.image_cmd == "build":
        build_image(kernel=args.kernel, force=args.force, qemu=args.qemu,
                    snapshot=not args.no_snapshot,
                    progress=(lambda s: None) if args.quiet else _progress)
        return EXIT_OK
    if args.image_cmd == "list":
        from .images import _read_default, built_images, image_is_current
        from .snapshot import snapshots_of

        imgs = built_images()
        if not imgs:
            print("no images; run `kph image build` (or --kernel 6.12, 7.3)", file=sys.stderr)
            return EXIT_OK
        default = _read_default()
        print(f"{'series':7s} {'kernel':32s} {'built':26s} {'state':8s} snapshots")
        for i in imgs:
            state = "current" if image_is_current(i) else "stale"
            mark = " (default)" if i.version == default else ""
            print(f"{i.series:7s} {i.version:32s} {i.manifest.get('built', '?'):26s} {state:8s} "
                  f"{len(snapshots_of(i))}{mark}")
        return EXIT_OK
    if args.image_cmd == "info":
        import json
        from .snapshot import snapshots_of

        img = default_image(args.image)
        snaps = [dict(s.meta, dir=str(s.dir)) for s in snapshots_of(img)]
        print(json.dumps(dict(img.manifest, dir=str(img.dir), snapshots=snaps), indent=2))
        return EXIT_OK
    raise SetupError("kph image needs an action", "try `kph image build`")


def _qemu_cmd(args: argparse.Namespace) -> int:
    from .qemu import find_qemu, provision_private_qemu, system_qemu, why_chosen

    if args.qemu_cmd == "provision":
        s = system_qemu()
        if s and s.fast_gdbstub and not args.force:
            _progress(f"qemu: system QEMU {s.version_str} is >= 10.2; nothing to provision")
            return EXIT_OK
        provision_private_qemu(progress=_progress, force=args.force)
        return EXIT_OK
    if args.qemu_cmd == "which":
        q = find_qemu()
        print(f"QEMU {q.version_str}: {q.argv[-1]} ({why_chosen(q)})")
        return EXIT_OK
    raise SetupError("kph qemu needs an action", "try `kph qemu provision` or `kph qemu which`")


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import run_checks

    bad = 0
    for c in run_checks():
        print(f"[{c.mark:4s}] {c.name:12s} {c.detail}")
        if c.ok is False:
            bad += 1
            if c.fix:
                print(f"       {'':12s} fix: {c.fix}")
    return EXIT_OK if not bad else EXIT_USAGE


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _load_specs(args: argparse.Namespace) -> list[Any]:
    """Parse every spec, with the image's symbols where the kernel's parser uses them
    (``kprobe_on_func_entry()``, ``number_of_same_symbols()``), before booting: what the
    kernel refuses while parsing a line is refused here, in its order and words."""
    from .probespec import parse

    lines = list(args.specs)
    if args.spec_file:
        try:
            text = open(args.spec_file).read()
        except OSError as exc:
            raise SetupError(f"cannot read {args.spec_file}: {exc.strerror}", "check the path") from exc
        lines += [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise SetupError("no probe spec given", "pass SPEC arguments or -f FILE")
    for ln in lines:
        if ln.lstrip().startswith("-"):
            raise SetupError(f"{ln!r} deletes probes; kph places the probe definitions it is "
                             "given", "leave '-:' lines out (the guest's events are removed "
                             "after the run)")
    if args.kernel is not None:
        # no facts before boot: the grammar of the newest rules; the booted kernel's own
        # rules, BTF and symbols decide at registration (harness.backends.tracelayer)
        from .kernelrules import SERIES
        from .probespec import KernelView
        newest = KernelView(list(SERIES.values())[-1])
        return [parse(ln, kernel=newest) for ln in lines]
    from .facts import kernel_view
    from .images import default_image

    # the image's kernel: its series' rules, its BTF, its symbols
    view = kernel_view(default_image(args.image).facts)
    return [parse(ln, kernel=view) for ln in lines]


def _check_output(option: str, path: str | None) -> None:
    """An output file must be writable before any VM boots (a one-line usage error)."""
    import os
    from pathlib import Path

    if not path:
        return
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    why = ("it is a directory" if p.is_dir() else
           f"the directory {parent} does not exist" if not parent.is_dir() else
           f"the directory {parent} is not writable" if not os.access(parent, os.W_OK) else
           "the file is not writable" if p.exists() and not os.access(p, os.W_OK) else None)
    if why:
        raise SetupError(f"cannot write {option} {path}: {why}",
                         f"give {option} a file in an existing, writable directory")


def _workload_ran(r: Any, workload: str) -> None:
    """126/127 from the workload's shell: the command was not run (not found, not
    executable). That is a usage error, not a result."""
    if r.workload_status in (126, 127):
        said = " | ".join(ln for ln in r.workload_stderr.strip().splitlines() if ln.strip())
        raise SetupError(f"the workload {workload!r} did not run (exit {r.workload_status}"
                         + (f": {said})" if said else ")"),
                         "check the command exists in the guest image (busybox applets, "
                         "/usr/bin/kph-*)")


def _machine(args: argparse.Namespace) -> Any:
    from .vmctl import Machine

    host = "plugin" if getattr(args, "host", "gdbstub") in ("plugin", "both") else "gdbstub"
    return Machine.boot(args.image, kernel=args.kernel, initrd=args.initrd, vmlinux=args.vmlinux,
                        smp=args.smp, accel=args.accel, memory=args.memory, append=args.append,
                        qemu=args.qemu, fresh=not args.cold, host=host)


def _refusals(outcomes: list[Any]) -> int:
    import errno as _e

    bad = 0
    for o in outcomes:
        if not o.accepted:
            bad += 1
            why = o.message if not o.reason or o.reason == o.message else \
                f"{o.message}: {o.reason}" if o.message else o.reason
            print(f"error: probe {o.probe} refused: {_e.errorcode.get(o.errno, o.errno)} "
                  f"({why})", file=sys.stderr)
    return bad


def _probe(args: argparse.Namespace) -> int:
    from . import report
    from .runner import run_single

    specs = _load_specs(args)
    backend = "plugin" if args.backend == "host" and args.host == "plugin" else args.backend
    with _machine(args) as vm:
        res = run_single(vm, backend, specs, args.run, timeout=args.timeout)
    _workload_ran(res, args.run)
    if _refusals(res.outcomes):
        return EXIT_USAGE
    if args.json:
        sys.stdout.write(report.hits_json(res.hits))
    else:
        for h in res.hits:
            print(h.line())
    counts = ", ".join(f"{p} {c.nhit} hits/{c.nmissed} missed" for p, c in res.counters.items())
    if not args.quiet:
        print(f"{backend}: {len(res.hits)} events; {counts}; workload "
              f"{report.workload_status(res.workload_status, res.workload_stderr)}",
              file=sys.stderr)
    return EXIT_OK


def _diff(args: argparse.Namespace) -> int:
    from . import report
    from .diff import compare
    from .runner import run_differential, trampoline_text

    _check_output("--json", args.json)
    _check_output("--html", args.html)
    specs = _load_specs(args)
    if args.guest == "module" and any(s.is_uprobe for s in specs):
        raise SetupError("the module backend has kprobes only; these specs include uprobes",
                         "use --guest events (uprobe_events) for uprobe lines")
    if args.host == "both":
        return _diff_three(args, specs)
    with _machine(args) as vm:
        runs = run_differential(vm, specs, args.run, guest=args.guest, timeout=args.timeout)
        tramp = trampoline_text(vm)
    _workload_ran(runs[0], args.run)
    res = compare(*runs, trampoline=tramp)
    sys.stdout.write(report.text(res, workload=args.run, status=runs[0].workload_status,
                                 stderr=runs[0].workload_stderr))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.to_json(res, runs))
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.to_html(res, runs, workload=args.run))
    return EXIT_OK if res.equivalent else EXIT_DIVERGED


def _matrix(args: argparse.Namespace) -> int:
    from . import report
    from .probespec import parse
    from .runner import run_matrix

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels:
        raise SetupError("--kernels names no kernel", "e.g. --kernels 6.1,6.12,7.3")
    for path in (args.json, args.html):
        _check_writable(path)
    lines = list(args.specs)
    if args.spec_file:
        lines += _spec_file_lines(args.spec_file)
    if not lines:
        raise SetupError("no probe spec given", "pass SPEC arguments or -f FILE")
    specs = _matrix_specs(kernels, lines)
    res = run_matrix(kernels, specs, args.run, guest=args.guest, timeout=args.timeout,
                     qemu=args.qemu, progress=None if args.quiet else _progress)
    sys.stdout.write(report.matrix_text(res))
    if args.json:
        with open(args.json, "w") as f:
            f.write(report.matrix_json(res))
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.matrix_html(res))
    return EXIT_OK if res.all_equivalent else EXIT_DIVERGED


def _matrix_specs(kernels: list[str], lines: list[str]) -> list[Any]:
    """Each line parsed with the grammar of every kernel named (its series' rules, no BTF
    yet): a line no kernel parses is a usage error, one some kernel parses goes on (each
    kernel's own parse at registration refuses it where it must, a per-kernel result)."""
    from .errors import NotMirroredError, ProbeSpecError
    from .kernelrules import rules_for
    from .probespec import KernelView, parse

    views = [KernelView(rules_for(k if k[:1].isdigit() else None)) for k in kernels]
    out = []
    for ln in lines:
        first: ProbeSpecError | None = None
        for v in views:
            try:
                out.append(parse(ln, kernel=v))
                break
            except NotMirroredError:
                raise
            except ProbeSpecError as exc:
                first = first or exc
        else:
            assert first is not None
            raise first
    return out


def _check_writable(path: str | None) -> None:
    """A report path that cannot be written is a usage error before anything boots."""
    import os

    if path is None:
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise SetupError(f"cannot write {path}: no writable directory {d}",
                         "give a path in an existing, writable directory")


def _spec_file_lines(path: str) -> list[str]:
    try:
        text = open(path).read()
    except OSError as exc:
        raise SetupError(f"cannot read {path}: {exc.strerror}", "check the path") from exc
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def _worker(args: argparse.Namespace) -> int:
    import json

    from . import remote

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if args.worker_cmd == "identity":
        print(json.dumps(remote.local_identity(kernels or None), indent=1))
        return EXIT_OK
    if args.worker_cmd == "prepare":
        info = remote.prepare(args.target, directory=args.dir, commit=args.commit,
                              kernels=kernels, cache=args.cache, ssh_config=args.ssh_config,
                              progress=(lambda s: None) if args.quiet else _progress)
        print(f"--tx {info['tx']}")
        return EXIT_OK
    raise SetupError("kph worker needs an action", "try `kph worker prepare HOST --dir PATH`")


def _diff_three(args: argparse.Namespace, specs: list[Any]) -> int:
    """``kph diff --host both``: gdbstub, plugin and guest on one execution (harness.worlds)."""
    import json

    from . import report
    from .worlds import run_three

    with _machine(args) as vm:
        three = run_three(vm, specs, args.run, guest=args.guest, timeout=args.timeout)
    for res in three.pairs:
        sys.stdout.write(report.text(res, workload=args.run, status=three.runs[0].workload_status))
    first = three.first_divergence()
    print(f"three worlds: {'EQUIVALENT' if first is None else 'DIVERGED'}"
          + ("" if first is None else f" first between {first.a_side} and {first.b_side}"))
    which = ((0, 2), (1, 2), (0, 1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"equivalent": first is None,
                       "pairs": [json.loads(report.to_json(r, (three.runs[i], three.runs[j])))
                                 for r, (i, j) in zip(three.pairs, which)]}, f, indent=1)
    if args.html:
        k = three.pairs.index(first) if first is not None else 0
        i, j = which[k]
        with open(args.html, "w") as f:
            f.write(report.to_html(three.pairs[k], (three.runs[i], three.runs[j]), workload=args.run))
    return EXIT_OK if first is None else EXIT_DIVERGED


def _repro(args: argparse.Namespace) -> int:
    from pathlib import Path

    from . import repro, scenario

    if args.record and args.replay:
        raise SetupError("--record and --replay together", "record first, then replay the bundle")
    if args.gdb and not args.replay:
        raise SetupError("--gdb goes with --replay DIR", "kph repro --replay DIR --gdb")
    if args.scenario is None and not args.replay:
        raise SetupError("kph repro needs a scenario file", "kph repro probes/scenarios/NAME.toml")
    scn = scenario.load(args.scenario) if args.scenario else None
    if args.record or args.replay:
        from . import repro_rr

        return repro_rr.main(scn, args, progress=(lambda s: None) if args.quiet else _progress)
    assert scn is not None
    res = repro.run(scn, out_dir=Path(args.out) if args.out else None, qemu=args.qemu,
                    progress=(lambda s: None) if args.quiet else _progress)
    print(f"{'MET' if res.met else 'NOT MET'}: {scn.name}")
    print(f"  cause: {res.cause}")
    for r in res.reasons:
        print(f"  - {r}")
    print(f"  evidence: {res.bundle}/summary.md")
    return EXIT_OK if res.met else EXIT_DIVERGED


def _demo(args: argparse.Namespace) -> int:
    from . import report, trapflow
    from .vmctl import Machine

    if args.demo_cmd != "trap-flow":
        raise SetupError("kph demo needs a demo name", "try `kph demo trap-flow`")
    _check_output("--html", args.html)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    for v in variants:
        if v not in ("int3", "ftrace", "optimized", "kretprobe", "uprobe", "uretprobe"):
            raise SetupError(f"unknown variant {v!r}",
                             "use int3, ftrace, optimized, kretprobe, uprobe, uretprobe")
    if "+" not in args.symbol or args.symbol.endswith("+0"):
        raise SetupError(f"--symbol {args.symbol} is a function entry (ftrace-based there)",
                         "give an offset into the function, e.g. do_sys_openat2+5")
    if not args.quiet:
        _progress("demo: booting the default image")
    with Machine.boot() as vm:
        flows = []
        for v in variants:
            if not args.quiet:
                _progress(f"demo: {v}: placing the in-guest probe and the host observers")
            flows += trapflow.demo(vm, target=args.symbol, workload=args.run, variants=(v,))
        left = vm.run("cat /sys/kernel/debug/kprobes/list; lsmod | grep -c kph_kprobes || true").stdout
    for f in flows:
        text = report.trapflow_text([f])
        if args.step:
            for block in text.split("\n  "):
                print(block)
                input("  [Enter] ")
        else:
            print(text)
    if left.strip() not in ("", "0"):
        print(f"warning: the guest still lists probes: {left.strip()}", file=sys.stderr)
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.trapflow_html(flows))
        if not args.quiet:
            _progress(f"demo: wrote {args.html}")
    return EXIT_OK


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _demo,
    "boot": _boot, "image": _image, "qemu": _qemu_cmd, "doctor": _doctor,
    "probe": _probe, "diff": _diff, "repro": _repro, "matrix": _matrix, "worker": _worker,
}


_interrupted: list[int] = []


def _on_signal(signum: int, frame: object) -> None:
    """SIGINT or SIGTERM: from now on nothing talks to a guest (every live machine is
    aborted, its QEMU and gdb ended by pid during the unwinding), further signals are
    ignored so the teardown cannot be cut in half, and ``main`` exits 130 with one line."""
    if _interrupted:
        return
    _interrupted.append(signum)
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    # Teardown after an interruption is quiet: what fails there fails because of it.
    logging.disable(logging.CRITICAL)
    vmctl = sys.modules.get("harness.vmctl")   # not loaded yet: no machine to abort
    if vmctl is not None:
        vmctl.abort_all()
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    _interrupted.clear()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    try:
        parser = make_parser()
        args = parser.parse_args(argv)
        logging.basicConfig(level=getattr(logging, args.log_level),
                            format="%(name)s: %(message)s")
        logging.getLogger("qemu.qmp").setLevel(max(logging.CRITICAL, logging.getLogger().level))
        if not args.cmd:
            parser.print_help()
            return EXIT_USAGE
        return _dispatch(args)
    except BaseException:  # noqa: BLE001 - an interruption wins over what it caused
        if _interrupted:
            return _interrupted_exit()
        raise
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.default_int_handler)


def _interrupted_exit() -> int:
    name = signal.Signals(_interrupted[0]).name if _interrupted else "SIGINT"
    print(f"interrupted ({name})", file=sys.stderr)
    return 130


def _dispatch(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.cmd](args)
    except BaseException as exc:  # noqa: BLE001 - mapped to one line and an exit code
        if _interrupted or isinstance(exc, KeyboardInterrupt):
            return _interrupted_exit()
        code = _report_error(exc)
        if code is None:
            raise
        return code


def _report_error(exc: BaseException) -> int | None:
    """Print the one line for a harness error and return the exit status (None: not ours)."""
    from .errors import HandlerError

    if isinstance(exc, (SetupError, ScenarioError)):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, NotMirroredError):   # one line: not the kernel's error_log shape
        print(f"error: {exc}; {exc.hint or 'probe the function with a p: or r: line instead'}",
              file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, ProbeSpecError):
        from .probespec import format_error
        toks = exc.text.split()
        uprobe = len(toks) > 1 and "/" in toks[1]      # the file the kernel would log to
        print(format_error(exc, "trace_uprobe" if uprobe else "trace_kprobe").rstrip("\n"),
              file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, VMError):
        first = str(exc.args[0]) if exc.args else str(exc)
        where = f"; console kept in {exc.console_log}" if exc.console_log else ""
        print(f"error: {first}{where}", file=sys.stderr)
        return EXIT_INFRA
    if isinstance(exc, HandlerError):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INFRA
    if isinstance(exc, HarnessError):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, OSError):    # the host refused something (disk full, permissions)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INFRA
    return None


if __name__ == "__main__":
    sys.exit(main())
