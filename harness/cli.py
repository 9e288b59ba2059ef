"""``kph``: the command line. The only module that prints or configures logging.

One output convention for every verb (docs/cli.md):

- ``--json``: the verb's result as one JSON document on stdout, and nothing else there;
- ``-o FILE`` / ``--json-file FILE``: the same document written to FILE;
- human text (reports, verdicts, tables, progress, warnings, errors) goes to stderr, and
  ``-q`` silences it (errors excepted). The one thing on stdout without ``--json`` is the
  guest's own output of ``kph boot --run CMD``;
- progress of long work is one live line on a terminal, plain lines otherwise;
- exit status 0 success, 1 divergence / not met / failed command, 2 usage or setup error,
  3 the VM was lost, 4 nothing measured (``kph diff``: no armed probe fired), 130
  interrupted.

Why over 1,000 lines: the parser (``make_parser``, which is also the help the docs quote)
and each verb's output handling sit together, so the one convention above is visible in
one file; the work itself is in the library (runner, repro, trapflow, report).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import typing
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

from .errors import (EngineReadError, HarnessError, NotMirroredError, PluginRecordError,
                     ProbeSpecError, ScenarioError, SetupError, VMError)

EXIT_OK, EXIT_DIVERGED, EXIT_USAGE, EXIT_INFRA, EXIT_EMPTY = 0, 1, 2, 3, 4

DESCRIPTION = """\
kprobe-harness: boot a real x86_64 Linux kernel under QEMU and probe it with kprobe
semantics, from the host through QEMU's gdbstub and inside the guest as real kprobes.

With no kernel named, every command uses the embedded default image (the current Debian
cloud kernel with a busybox initramfs), built by `kph image build` into $KPH_CACHE
(default ~/.cache/kprobe-harness).

Output: human text and progress go to stderr (-q silences them); --json puts the result
on stdout as JSON and nothing else; -o FILE writes that JSON to FILE. The options
--json, -o, -q and --log-level go before or after the command.
"""

EPILOG = """\
first steps:
  kph doctor                              what QEMU, gdb and image will be used
  kph image build                         provision the default image (idempotent)
  kph boot --run 'uname -r'               boot it, run a command, power off
  kph probe 'p:open do_sys_openat2 dfd=%di:s32' --run 'cat /proc/version'
  kph diff  'p:open do_sys_openat2 path=+0(%si):ustring' --run 'cat /proc/version'
every command has examples in its --help (kph COMMAND --help).
exit status: 0 success, 1 divergence or failed command, 2 usage/setup error,
3 the VM was lost (panic, QEMU died, timeout), 4 empty (kph diff: nothing measured),
130 interrupted."""

#: Every verb's --help examples, pasted and run by tests/vm/test_help_examples.py from a
#: directory holding the checkout's probes/ (paths are relative to the checkout).
#: An example that cannot run on one machine says so after "# not run:".
EXAMPLES: dict[str, list[str]] = {
    "boot": ["kph boot --run 'uname -r' --run 'cat /proc/cmdline'",
             "kph boot --cold --run true",
             "kph boot --json --run 'cat /proc/version'"],
    "probe": ["kph probe 'p:open do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring' "
              "--run 'cat /proc/version'",
              "kph probe 'r:openret do_sys_openat2 ret=$retval:s64' --backend events "
              "--run 'cat /proc/version' --json"],
    "diff": ["kph diff 'p:open do_sys_openat2 path=+0(%si):ustring' "
             "'r:openret do_sys_openat2 ret=$retval:s64' --run 'cat /proc/version'",
             "kph diff -f probes/examples/open.spec --run 'cat /proc/version' --json "
             "--html open.html"],
    "matrix": ["kph matrix -f probes/examples/matrix.spec --run 'sh -c \"true & wait\"' "
               "--kernels 6.1,6.12,7.3"],
    "repro": ["kph repro probes/scenarios/blacklisted.toml",
              "kph repro probes/scenarios/blacklisted.toml --out bundle --json"],
    "demo": ["kph demo trap-flow --variants int3",
             "kph demo trap-flow --variants int3,kretprobe --html flow.html"],
    "doctor": ["kph doctor", "kph doctor --json"],
    "image": ["kph image build", "kph image list", "kph image info --json"],
    "qemu": ["kph qemu which", "kph qemu which --json"],
    "fuzz": ["kph fuzz --list --examples 5 --seed 7",
             "kph fuzz --examples 10 --seed 7 --out fuzz-run"],
    "worker": ["kph worker identity --kernels default --json",
               "kph worker prepare root@build2 --dir /srv/kph --kernels 6.12,7.3  "
               "# not run: needs a second machine reachable over SSH"],
}


def _examples(verb: str, extra: str = "") -> str:
    lines = [f"  {ex}" for ex in EXAMPLES[verb]]
    return ((extra + "\n") if extra else "") + "examples:\n" + "\n".join(lines)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kprobe-harness")
    except PackageNotFoundError:
        return "unknown (not installed)"


# ------------------------------------------------------------------------ output and progress

class Progress:
    """Progress for people, on stderr: on a terminal one live line rewritten in place
    (phases and live counters), otherwise a plain line per phase (live counters at most
    every ``plain_every`` seconds). Silent with ``-q``. A ``harness.progress`` sink."""

    def __init__(self, stream: Any = None, *, quiet: bool = False, live: bool | None = None,
                 plain_every: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        if live is None:
            live = self.stream.isatty() and os.environ.get("TERM", "") != "dumb"
        self.live = live
        self.plain_every = plain_every
        self._shown = False
        self._last_plain = 0.0
        self._lock = threading.Lock()

    def __call__(self, text: str) -> None:
        """A phase."""
        if self.quiet:
            return
        with self._lock:
            if self.live:
                self._draw(text)
            else:
                print(text, file=self.stream, flush=True)
                self._last_plain = time.monotonic()

    def transient(self, text: str) -> None:
        """A live update (hit counts while the workload runs)."""
        if self.quiet:
            return
        with self._lock:
            if self.live:
                self._draw(text)
            elif time.monotonic() - self._last_plain >= self.plain_every:
                print(text, file=self.stream, flush=True)
                self._last_plain = time.monotonic()

    def _draw(self, text: str) -> None:
        width = max(20, shutil.get_terminal_size((100, 20)).columns - 1)
        self.stream.write("\r\x1b[K" + text[:width])
        self.stream.flush()
        self._shown = True

    def clear(self) -> None:
        """Erase the live line (before other text is written)."""
        with self._lock:
            if self._shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
                self._shown = False


class Output:
    """Where a verb's result and text go (the convention in the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.json = bool(getattr(args, "json", False))
        self.json_file: str | None = getattr(args, "json_file", None)
        self.quiet = bool(getattr(args, "quiet", False))
        self.progress = Progress(quiet=self.quiet)
        _current.append(self)

    def text(self, s: str = "") -> None:
        """Human text: stderr, unless -q."""
        if self.quiet:
            return
        self.progress.clear()
        sys.stderr.write(s if s.endswith("\n") else s + "\n")
        sys.stderr.flush()

    def warn(self, s: str) -> None:
        self.text(f"warning: {s}")

    def data(self, s: str) -> None:
        """Data that is stdout's without --json (kph boot's guest output)."""
        if not self.json:
            self.progress.clear()
            sys.stdout.write(s)
            sys.stdout.flush()

    def result(self, doc: Any) -> None:
        """The machine-readable result: stdout with --json, the file with -o."""
        text = json.dumps(doc, indent=2, default=str) + "\n"
        if self.json_file:
            with open(self.json_file, "w") as f:
                f.write(text)
        if self.json:
            self.progress.clear()
            sys.stdout.write(text)
            sys.stdout.flush()


_current: list[Output] = []


class _LogHandler(logging.StreamHandler):
    """Log records on stderr, on a line of their own (the live progress line is erased
    first, and redrawn by the next update)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        if _current:
            _current[-1].progress.clear()
        super().emit(record)


def _output_options(p: argparse.ArgumentParser, *, top: bool) -> None:
    """-q, --log-level, --json, -o: on the top parser (with defaults) and on every
    command (defaults suppressed, so that a value given before the command stays)."""
    kw: dict[str, Any] = {} if top else {"default": argparse.SUPPRESS}
    g = p.add_argument_group("Output")
    g.add_argument("--json", action="store_true",
                   help="write the result as JSON to stdout, and nothing else", **kw)
    g.add_argument("-o", "--json-file", metavar="FILE",
                   help="write the result as JSON to FILE", **kw)
    g.add_argument("-q", "--quiet", action="store_true",
                   help="no text on stderr but errors (no progress, no report)", **kw)
    g.add_argument("--log-level", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="the library's log level, on stderr (default WARNING)",
                   **({"default": "WARNING"} if top else kw))


def _sub(sub: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
    kw.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    p = sub.add_parser(name, **kw)
    _output_options(p, top=False)
    return p


def _verdict_group(p: argparse.ArgumentParser) -> None:
    from .diff import NORMALIZATIONS

    g = p.add_argument_group("Verdict", "what may make two sides equivalent "
                             "(docs/diff.md lists every normalization)")
    g.add_argument("--strict", action="store_true",
                   help="no normalization except those --allow names: any other applied "
                   "is exit 1, named with its count")
    g.add_argument("--allow", metavar="RULE,...", default="",
                   help="with --strict, the normalizations to accept: "
                   + ", ".join(NORMALIZATIONS))
    g.add_argument("--expect-empty", action="store_true",
                   help="a run in which no armed probe fires on either side is the "
                   "expected result (exit 0, not 4)")


def _verdict_opts(args: argparse.Namespace) -> dict[str, Any]:
    """compare()'s verdict options from --strict/--allow/--expect-empty; a rule that does
    not exist is a usage error before anything boots."""
    from .diff import NORMALIZATIONS

    allow = tuple(r.strip() for r in args.allow.split(",") if r.strip())
    bad = [r for r in allow if r not in NORMALIZATIONS]
    if bad:
        raise SetupError(f"--allow {','.join(bad)}: no such normalization",
                         f"choose from {', '.join(NORMALIZATIONS)}")
    if allow and not args.strict:
        raise SetupError("--allow without --strict allows nothing more",
                         "add --strict (without it every documented normalization applies)")
    return {"strict": args.strict, "allow": allow, "expect_empty": args.expect_empty}


def _exit_for(res: Any) -> int:
    """0 equivalent, 1 diverged or not strict, 4 empty (nothing measured)."""
    word = res.verdict_word
    return {"equivalent": EXIT_OK, "empty": EXIT_EMPTY}.get(word, EXIT_DIVERGED)


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


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2), naming the way to the help."""

    def error(self, message: str) -> "typing.NoReturn":  # type: ignore[name-defined]
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kph", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kph (kprobe-harness) {_version()}")
    _output_options(p, top=True)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")

    img = _sub(sub, "image", help="Build, list or show the images (one per kernel)",
               epilog=_examples("image"))
    isub = img.add_subparsers(dest="image_cmd", metavar="ACTION")
    b = _sub(isub, "build", help="Provision an image: kernel, initramfs, kernel facts, "
             "module, ready snapshot",
             description="Build the image of a Debian cloud kernel: its packages, "
             "a busybox initramfs with qemu-ga, the test programs and kph_kprobes.ko "
             "(built with that kernel's own compiler), its kernel facts (kallsyms, "
             "blacklist, BTF, ...) harvested on a first boot, and its ready snapshot.",
             epilog=_examples("image"))
    b.add_argument("--kernel", metavar="SERIES|ABI", default=None,
                   help="which kernel: a series (6.1, 6.12, 7.3: what Debian 12, Debian 13 "
                   "and Debian 13 backports ship today) or a full ABI such as "
                   "6.12.117+deb13-cloud-amd64; default: Debian 12's, the default image")
    b.add_argument("--force", action="store_true", help="rebuild even when the cache is current")
    b.add_argument("--qemu", metavar="PATH", help="QEMU for the harvesting boot and the snapshot")
    b.add_argument("--no-snapshot", action="store_true",
                   help="do not make the ready snapshot (the first boot makes it)")
    inf = _sub(isub, "info", help="Show an image's manifest and its snapshots",
               epilog=_examples("image"))
    inf.add_argument("--image", metavar="SERIES|ABI|DIR", help="the image (default: the default)")
    _sub(isub, "list", help="List the images in the cache", epilog=_examples("image"))

    q = _sub(sub, "qemu", help="Provision or show the QEMU the harness uses",
             epilog=_examples("qemu"))
    qsub = q.add_subparsers(dest="qemu_cmd", metavar="ACTION")
    pv = _sub(qsub, "provision", help="Unpack QEMU >= 10.2 from Debian 13 backports "
              "into the cache (skipped when the system QEMU is new enough)")
    pv.add_argument("--force", action="store_true", help="provision even if one exists")
    _sub(qsub, "which", help="Show the QEMU that would be used and why", epilog=_examples("qemu"))

    bt = _sub(sub, "boot", help="Boot the default image (or --kernel/--initrd) and run commands",
              description="Boot, run each --run command in the guest, power off. The "
              "commands' output is passed through (their stdout on stdout); with --json "
              "it is in the JSON document instead. Exit status: that of the last command.",
              epilog=_examples("boot"))
    bt.add_argument("--run", action="append", default=[], metavar="CMD",
                    help="a shell command to run in the guest (repeatable)")
    bt.add_argument("--timeout", type=float, default=60.0, metavar="S",
                    help="limit for each command (default 60)")
    bt.add_argument("--console", action="store_true", help="show the guest console at the end")
    _kernel_group(bt)
    _qemu_group(bt)

    pr = _sub(sub, "probe", help="Place SPEC on one side (--backend), run a workload, "
              "show the events", description="Place kprobe_events specs host-side "
              "(through the gdbstub) or in the guest (tracefs or the kph module), "
              "run --run, show the events as the trace file would. Exit 0, or 2 when a "
              "spec is refused.", epilog=_examples("probe"))
    _spec_args(pr)
    pr.add_argument("--backend", choices=("host", "events", "module"), default="host",
                    help="where the probes go (default host)")
    pr.add_argument("--host", choices=("gdbstub", "plugin"), default="gdbstub",
                    help="the host-side engine: gdbstub (default, the reference) or the QEMU "
                    "plugin (microseconds per hit, vCPUs not stopped)")
    _kernel_group(pr)
    _qemu_group(pr)

    df = _sub(sub, "diff", help="Run a probe set on both sides and report the first divergence",
              description="Place the specs in the guest (--guest) and host-side on "
              "top, observing one execution of --run; compare every hit field by "
              "field. Exit 0 equivalent, 1 divergent (or, with --strict, a normalization "
              "not allowed), 2 usage or setup error or a host engine that could not read "
              "(never a value), 3 the VM was lost, 4 empty: no probe both sides armed "
              "fired on either side, nothing was compared (--expect-empty: 0).",
              epilog=_examples("diff"))
    _spec_args(df)
    df.add_argument("--guest", choices=("events", "module"), default="events",
                    help="the in-guest side (default: tracefs kprobe_events)")
    df.add_argument("--host", choices=("gdbstub", "plugin", "both"), default="gdbstub",
                    help="the host-side engine: gdbstub (default), plugin, or both (three "
                    "worlds on one execution, every pair compared)")
    df.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    _verdict_group(df)
    _kernel_group(df)
    _qemu_group(df)

    mx = _sub(sub, "matrix", help="Run a probe set on several kernels; show where they differ",
              description="For each kernel (--kernels), boot its image (built first "
              "if missing), place the specs host-side and in the guest on one "
              "execution of --run and compare them (as kph diff); then compare the "
              "kernels' guests with each other: registration, probe mode, event "
              "counts and the printed fields. Exit 0 when host and guest agree on "
              "every kernel, 1 otherwise, 2 on usage or setup errors.",
              epilog=_examples("matrix"))
    _spec_args(mx)
    mx.add_argument("--kernels", default="6.1,6.12,7.3", metavar="K,K,...",
                    help="kernel series or ABIs, comma-separated (default 6.1,6.12,7.3)")
    mx.add_argument("--guest", choices=("events", "module"), default="events",
                    help="the in-guest side (default: tracefs kprobe_events)")
    mx.add_argument("--html", metavar="FILE", help="write a self-contained HTML report")
    mx.add_argument("--qemu", metavar="PATH", help="qemu-system-x86_64 to use")

    fz = _sub(sub, "fuzz", help="Generate probe definitions from the grammar; host against "
              "guest; shrink every divergence to one line",
                        description="Draw kprobe_events lines (Hypothesis, seeded) from the "
                        "grammar the harness mirrors and from the functions the workload calls, "
                        "run each on both sides of one execution (or compare the guest's "
                        "error_log with the host's parse error), and shrink each divergence to "
                        "a minimal definition. Findings are written as kph diff one-liners "
                        "and as regression cases (tests/data/fuzz/) the suite replays. Exit 0 "
                        "with no finding, 1 with findings, 2 on bad input.",
                        epilog=_examples("fuzz"))
    fz.add_argument("--image", metavar="SERIES|ABI|DIR", help="the kernel (default: the default image)")
    fz.add_argument("--host", choices=("gdbstub", "plugin"), default="gdbstub",
                    help="host-side engine (default gdbstub)")
    fz.add_argument("--guest", choices=("events", "module"), default="events",
                    help="in-guest side (default events)")
    fz.add_argument("--examples", type=int, default=100, metavar="N", help="examples (default 100)")
    fz.add_argument("--seed", type=int, default=0, metavar="S", help="seed (default 0)")
    fz.add_argument("--time-budget", type=float, metavar="SEC", help="stop after SEC seconds")
    fz.add_argument("-n", dest="workers", type=int, default=1, metavar="W",
                    help="workers (pytest-xdist), each with its own machine (default 1)")
    fz.add_argument("--workload", metavar="CMD", help="the guest workload (default: opens, "
                    "reads, a fork and a sleep)")
    fz.add_argument("--list", action="store_true", help="show the examples the seed draws; run nothing")
    fz.add_argument("--out", metavar="DIR", help="where findings go (default kph-runs/fuzz-TIME)")


    wk = _sub(sub, "worker", help="Prepare a host over SSH as a pytest-xdist worker",
              description="Scale the differential suite out to other machines "
              "with pytest-xdist's SSH gateways (docs/remote.md).",
              epilog=_examples("worker"))
    wsub = wk.add_subparsers(dest="worker_cmd", metavar="ACTION")
    wp = _sub(wsub, "prepare", help="Send this commit to HOST, run setup.sh there, build "
              "the images, check it is identical, show the --tx spec",
              epilog=_examples("worker", "then: pytest -d --tx <the --tx spec> --tx popen "
                               "--dist loadgroup"))
    wp.add_argument("target", metavar="[USER@]HOST", help="an ssh target (or a Host of --ssh-config)")
    wp.add_argument("--dir", required=True, metavar="PATH", help="the worker's checkout on HOST")
    wp.add_argument("--commit", default="HEAD", metavar="REV", help="what to check out (default HEAD)")
    wp.add_argument("--kernels", default="", metavar="K,K,...",
                    help="images to build there besides the default (e.g. 6.12,7.3)")
    wp.add_argument("--cache", metavar="DIR", help="KPH_CACHE on HOST (default: its own default)")
    wp.add_argument("--ssh-config", metavar="FILE", help="an ssh_config for the connection")
    wi = _sub(wsub, "identity", help="Show this checkout's identity (commit, QEMU, images, "
              "cores): what prepare compares", epilog=_examples("worker"))
    wi.add_argument("--kernels", default="", metavar="K,K,...", help="only these images")

    rp = _sub(sub, "repro", help="Reproduce a probe bug and keep the evidence",
              description="Run a scenario file (probes/scenarios/*.toml), decide "
              "whether its expectation is met and write an evidence bundle (--out DIR, "
              "default kph-runs/repro-NAME-TIME/). Exit 0 met, 1 not met, 2 for a bad "
              "scenario (the key at fault is named).", epilog=_examples("repro"))
    rp.add_argument("scenario", metavar="SCENARIO.toml", nargs="?",
                    help="the scenario (optional with --replay: the bundle holds its own)")
    rp.add_argument("--out", metavar="DIR", help="bundle directory (default "
                    "kph-runs/repro-NAME-TIME)")
    rp.add_argument("--record", action="store_true",
                    help="run under QEMU record/replay (-icount rr=record, one vCPU, in-guest "
                    "probes only); the bundle then holds the replay log")
    rp.add_argument("--replay", metavar="DIR", help="replay a --record bundle to its end and "
                    "check the console and the final registers are identical")
    rp.add_argument("--gdb", action="store_true",
                    help="with --replay: stay stopped at the end with the gdbstub open for "
                    "reverse-stepi / reverse-continue; Ctrl-C ends QEMU")
    rp.add_argument("--qemu", metavar="PATH", help="qemu-system-x86_64 to use")

    dm = _sub(sub, "demo", help="Walk through a real kprobe trap, step by step",
              epilog=_examples("demo"))
    dsub = dm.add_subparsers(dest="demo_cmd", metavar="DEMO")
    tf = _sub(dsub, "trap-flow", help="A real in-guest kprobe fires; the host watches every step",
              description="Load an int3-based kprobe with pre and post handlers in the "
              "guest (the harness's module) and watch, with silent host breakpoints, "
              "the int3, the exception entry, kprobes core, the handlers, the "
              "out-of-line slot and the return; then the same probe ftrace-based, "
              "jump-optimized, and a kretprobe. The guest is left as it was.",
              epilog=_examples("demo"))
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
    tf.add_argument("--step", action="store_true", help="wait for Enter after each step "
                    "(on a terminal; with stdin not a terminal, the steps are not paused)")

    _sub(sub, "doctor", help="Report QEMU, gdb, KVM, the image cache and what to fix",
         description="Check what the harness would use. Exit 0 when nothing fails, 2 "
         "otherwise (each failure names its fix).", epilog=_examples("doctor"))
    return p


def _spec_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Probes")
    g.add_argument("specs", nargs="*", metavar="SPEC", help="a kprobe_events line (repeatable)")
    g.add_argument("-f", dest="spec_file", metavar="FILE", help="read specs, one per line (# comments)")
    g.add_argument("--run", required=True, metavar="CMD", help="the guest workload (a shell command)")
    g.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="limit for the workload (default 120)")



def _boot(args: argparse.Namespace, out: Output) -> int:
    from .vmctl import Machine

    opts: dict[str, Any] = dict(kernel=args.kernel, initrd=args.initrd, vmlinux=args.vmlinux,
                                smp=args.smp,
                                accel=args.accel, memory=args.memory, append=args.append,
                                qemu=args.qemu)
    if args.dry_run:  # the cold command line; a restore adds -incoming and the RAM file
        import shlex

        line = Machine.prepare(args.image, **opts).dry_run()
        out.result({"command": line, "argv": shlex.split(line)})
        if not out.json:
            print(line)     # the command line is data: stdout, as --dry-run promises
        return EXIT_OK
    status = EXIT_OK
    vm = Machine.boot(args.image, fresh=not args.cold, **opts)
    doc: dict[str, Any] = {"commands": []}
    with vm:
        how = _started(vm, args)
        doc["start"] = {"mode": vm.start_mode, "seconds": round(vm.boot_seconds, 3),
                        "reason": how}
        out.text(f"boot: {how}")
        _warn_slow_qemu(vm.qemu, out)
        for cmd in args.run:
            r = vm.run(cmd, timeout=args.timeout)
            doc["commands"].append({"command": cmd, "status": r.status, "stdout": r.stdout,
                                    "stderr": r.stderr})
            out.data(r.stdout)
            if not out.json:
                sys.stderr.write(r.stderr)
                sys.stderr.flush()
            status = r.status
        if args.console:
            doc["console"] = vm.console_text()
            out.text(doc["console"])
    doc["status"] = status
    out.result(doc)
    return status


def _started(vm: Any, args: argparse.Namespace) -> str:
    """How a machine started, in words: restored from which snapshot, or cold and why."""
    if vm.start_mode == "snapshot":
        return f"restored from {vm.snapshot.dir} in {vm.boot_seconds:.2f} s"
    why = vm.cold_reason or ("--cold" if getattr(args, "cold", False) else
                             "$KPH_COLD is set" if os.environ.get("KPH_COLD") else "no snapshot")
    return f"cold boot ({why}) in {vm.boot_seconds:.2f} s"


def _warn_slow_qemu(q: Any, out: Output) -> None:
    if not q.fast_gdbstub:
        out.warn(f"QEMU {q.version_str} flushes its translation cache on every "
                 "breakpoint hit (~70 ms); ./setup.sh provisions QEMU >= 10.2")


def _image(args: argparse.Namespace, out: Output) -> int:
    from .imagebuild import build_image
    from .images import default_image

    if args.image_cmd == "build":
        img = build_image(kernel=args.kernel, force=args.force, qemu=args.qemu,
                          snapshot=not args.no_snapshot, progress=out.progress)
        out.progress.clear()
        out.result(_image_doc(img))
        return EXIT_OK
    if args.image_cmd == "list":
        from .images import read_default, built_images, image_is_current
        from .snapshot import snapshots_of

        imgs = built_images()
        default = read_default()
        rows = [{"series": i.series, "kernel": i.version, "built": i.manifest.get("built", "?"),
                 "state": "current" if image_is_current(i) else "stale",
                 "snapshots": len(snapshots_of(i)), "default": i.version == default,
                 "dir": str(i.dir)} for i in imgs]
        out.result({"images": rows})
        if not imgs:
            out.text("no images; run `kph image build` (or --kernel 6.12, 7.3)")
            return EXIT_OK
        out.text(f"{'series':7s} {'kernel':32s} {'built':26s} {'state':8s} snapshots")
        for r in rows:
            out.text(f"{r['series']:7s} {r['kernel']:32s} {r['built']:26s} {r['state']:8s} "
                     f"{r['snapshots']}{' (default)' if r['default'] else ''}")
        return EXIT_OK
    if args.image_cmd == "info":
        img = default_image(args.image)
        doc = _image_doc(img)
        out.result(doc)
        out.text(f"image {img.version} ({img.series}) in {img.dir}")
        out.text(f"  built {img.manifest.get('built', '?')}, recipe {img.manifest.get('recipe', '?')}")
        for name, a in sorted(img.manifest.get("artifacts", {}).items()):
            out.text(f"  {name:18s} sha256 {a.get('sha256', '?')[:16]}...  {a.get('size', '')}")
        for s in doc["snapshots"]:
            out.text(f"  snapshot {s['dir']}")
        return EXIT_OK
    raise SetupError("kph image needs an action", "try `kph image build`, `list` or `info`")


def _image_doc(img: Any) -> dict[str, Any]:
    from .snapshot import snapshots_of

    snaps = [dict(s.meta, dir=str(s.dir)) for s in snapshots_of(img)]
    return dict(img.manifest, dir=str(img.dir), snapshots=snaps)


def _qemu_cmd(args: argparse.Namespace, out: Output) -> int:
    from .qemu import find_qemu, provision_private_qemu, system_qemu, why_chosen

    if args.qemu_cmd == "provision":
        s = system_qemu()
        if s and s.fast_gdbstub and not args.force:
            out.text(f"qemu: system QEMU {s.version_str} is >= 10.2; nothing to provision")
            q = s
        else:
            q = provision_private_qemu(progress=out.progress, force=args.force)
            out.progress.clear()
        out.result({"version": q.version_str, "path": q.argv[-1], "why": why_chosen(q)})
        return EXIT_OK
    if args.qemu_cmd == "which":
        q = find_qemu()
        why = why_chosen(q)
        out.result({"version": q.version_str, "path": q.argv[-1], "why": why,
                    "fast_gdbstub": q.fast_gdbstub})
        out.text(f"QEMU {q.version_str}: {q.argv[-1]} ({why})")
        return EXIT_OK
    raise SetupError("kph qemu needs an action", "try `kph qemu provision` or `kph qemu which`")


def _doctor(args: argparse.Namespace, out: Output) -> int:
    from .doctor import run_checks

    checks = run_checks()
    bad = 0
    for c in checks:
        out.text(f"[{c.mark:4s}] {c.name:12s} {c.detail}")
        if c.ok is False:
            bad += 1
            if c.fix:
                out.text(f"       {'':12s} fix: {c.fix}")
    out.result({"ok": not bad, "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail,
                                          "fix": c.fix} for c in checks]})
    return EXIT_OK if not bad else EXIT_USAGE


def _progress(msg: str) -> None:
    """Progress for code without an Output (kept for callers of the old name)."""
    (_current[-1].progress if _current else Progress())(msg)


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
    if all(ln.lstrip().startswith("-") for ln in lines):
        raise SetupError(f"{lines[0]!r} deletes probes, and no line defines one",
                         "give the definitions the -: lines delete (after `--`), e.g. "
                         "kph diff --run true -- 'p:e do_sys_openat2' '-:e'")
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


def _refusals(outcomes: list[Any], out: Output | None = None) -> int:
    """One ``error:`` line per refused spec (errors: shown with -q too)."""
    import errno as _e

    if out is not None:
        out.progress.clear()
    bad = 0
    for o in outcomes:
        if not o.accepted:
            bad += 1
            why = o.message if not o.reason or o.reason == o.message else \
                f"{o.message}: {o.reason}" if o.message else o.reason
            print(f"error: probe {o.probe} refused: {_e.errorcode.get(o.errno, o.errno)} "
                  f"({why})", file=sys.stderr)
    return bad




def _old_json_form(argv: list[str]) -> str | None:
    """``--json FILE`` was the old form of ``kph diff``/``matrix`` (a file); ``--json`` is
    now a flag and FILE would be taken for a stray argument. Returns FILE if used so."""
    for i, a in enumerate(argv[:-1]):
        nxt = argv[i + 1]
        if a == "--json" and nxt.lower().endswith(".json") and " " not in nxt:
            return nxt
    return None


def _booted(vm: Any, args: argparse.Namespace, out: Output) -> None:
    out.progress(f"booted: {_started(vm, args)}")


def _probe(args: argparse.Namespace, out: Output) -> int:
    import dataclasses

    from . import report
    from .runner import run_single

    _check_output("-o", out.json_file)
    specs = _load_specs(args)
    backend = "plugin" if args.backend == "host" and args.host == "plugin" else args.backend
    out.progress("booting" + (" cold (--cold)" if args.cold else ""))
    with _machine(args) as vm:
        _booted(vm, args, out)
        res = run_single(vm, backend, specs, args.run, timeout=args.timeout,
                         progress=out.progress)
    out.progress.clear()
    _workload_ran(res, args.run)
    refused = _refusals(res.outcomes, out)
    doc = {"side": res.side, "workload": {"command": args.run, "status": res.workload_status,
                                          "stderr": res.workload_stderr},
           "outcomes": [dataclasses.asdict(o) for o in res.outcomes],
           "hits": json.loads(report.hits_json(res.hits)),
           "counters": {p: dataclasses.asdict(c) for p, c in res.counters.items()}}
    out.result(doc)
    if refused:
        return EXIT_USAGE
    for h in res.hits:
        out.text(h.line())
    counts = ", ".join(f"{p} {c.nhit} hits/{c.nmissed} missed" for p, c in res.counters.items())
    out.text(f"{backend}: {len(res.hits)} events; {counts}; workload "
             f"{report.workload_status(res.workload_status, res.workload_stderr)}")
    return EXIT_OK


def _diff(args: argparse.Namespace, out: Output) -> int:
    from . import report
    from .diff import compare
    from .runner import run_differential, trampoline_text

    _check_output("-o", out.json_file)
    _check_output("--html", args.html)
    verdict = _verdict_opts(args)
    specs = _load_specs(args)
    if args.guest == "module" and any(s.is_uprobe for s in specs):
        raise SetupError("the module backend has kprobes only; these specs include uprobes",
                         "use --guest events (uprobe_events) for uprobe lines")
    if args.host == "both":
        return _diff_three(args, specs, out, verdict)
    out.progress("booting" + (" cold (--cold)" if args.cold else ""))
    with _machine(args) as vm:
        _booted(vm, args, out)
        runs = run_differential(vm, specs, args.run, guest=args.guest, timeout=args.timeout,
                                progress=out.progress)
        tramp = trampoline_text(vm)
    _workload_ran(runs[0], args.run)
    out.progress("comparing the two sides")
    res = compare(*runs, trampoline=tramp, **verdict)
    out.progress.clear()
    out.text(report.text(res, workload=args.run, status=runs[0].workload_status,
                         stderr=runs[0].workload_stderr))
    out.result(json.loads(report.to_json(res, runs)))
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.to_html(res, runs, workload=args.run))
        out.text(f"wrote {args.html}")
    return _exit_for(res)


def _matrix(args: argparse.Namespace, out: Output) -> int:
    from . import report
    from .runner import run_matrix

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if not kernels:
        raise SetupError("--kernels names no kernel", "e.g. --kernels 6.1,6.12,7.3")
    for path in (out.json_file, args.html):
        _check_writable(path)
    lines = list(args.specs)
    if args.spec_file:
        lines += _spec_file_lines(args.spec_file)
    if not lines:
        raise SetupError("no probe spec given", "pass SPEC arguments or -f FILE")
    _check_kernels(kernels)
    specs = _matrix_specs(kernels, lines)
    res = run_matrix(kernels, specs, args.run, guest=args.guest, timeout=args.timeout,
                     qemu=args.qemu, progress=out.progress)
    out.progress.clear()
    out.text(report.matrix_text(res))
    out.result(json.loads(report.matrix_json(res)))
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.matrix_html(res))
        out.text(f"wrote {args.html}")
    return EXIT_OK if res.all_equivalent else EXIT_DIVERGED


def _check_kernels(kernels: list[str]) -> None:
    """Every kernel named has an image or exists in the archives, before any machine boots
    (``kph matrix --kernels 6.1,9.9`` once ran 6.1 first and only then said 9.9 does not
    exist). :raise SetupError: the first one that does not, listing what is available."""
    from .images import default_image
    from .kernels import resolve

    for k in kernels:
        try:
            default_image(k)
        except SetupError:
            resolve(k)


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


def _fuzz(args: argparse.Namespace, out: Output) -> int:
    import subprocess
    import tempfile
    import time
    from pathlib import Path

    from . import fuzz

    if args.examples < 1:
        raise SetupError(f"--examples {args.examples}: nothing to run", "give 1 or more")
    if args.workers < 1:
        raise SetupError(f"-n {args.workers} is not a worker count", "use -n 1 or more")
    if args.time_budget is not None and args.time_budget <= 0:
        raise SetupError("--time-budget must be positive", "give seconds, e.g. --time-budget 600")
    from .images import default_image
    img = default_image(args.image)                        # an unknown image: one line, exit 2
    workload = args.workload or fuzz.DEFAULT_WORKLOAD
    say = out.progress
    if args.list:
        from .vmctl import Machine
        say(f"fuzz: booting {img.version} to list the functions the workload calls")
        with Machine.boot(img) as vm:
            pool = fuzz.symbol_pool(vm, workload)
        listed = [list(ex) for ex in fuzz.list_examples(pool, examples=args.examples,
                                                         seed=args.seed * 1000,
                                                         rules=img.facts.rules,
                                                         guest=args.guest)]
        out.progress.clear()
        for ex in listed:
            out.text("  |  ".join(ex))
        out.result({"seed": args.seed, "examples": listed})
        return EXIT_OK
    runs = Path(args.out or f"kph-runs/fuzz-{time.strftime('%Y%m%d-%H%M%S')}")
    runs.mkdir(parents=True, exist_ok=True)
    cfg = {"image": str(img.dir), "host": args.host, "guest": args.guest, "seed": args.seed,
           "examples": args.examples, "workers": args.workers, "workload": workload,
           "time_budget": args.time_budget, "out": str(runs.resolve())}
    t0 = time.monotonic()
    say(f"fuzz: {args.examples} examples on {img.version}, seed {args.seed}, "
        f"{args.workers} worker(s), host {args.host}, guest {args.guest}; findings in {runs}")
    if args.workers == 1:
        from .vmctl import Machine
        vm = Machine.boot(img, host=args.host)
        try:
            st = fuzz.run(vm, examples=args.examples, seed=args.seed * 1000, guest=args.guest,
                          workload=workload, time_budget=args.time_budget, progress=say,
                          reboot=lambda: Machine.boot(img, host=args.host))
            vm = st.vm
        finally:
            vm.close()
        shards = [{"examples": st.examples, "seconds": st.seconds, "agreed_runs": st.agreed_runs,
                   "agreed_refusals": st.agreed_refusals, "not_mirrored": st.not_mirrored,
                   "events": st.events, "findings": [f.as_dict() for f in st.findings]}]
    else:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as tmp:
            json.dump(cfg, tmp)
        env = dict(os.environ, KPH_FUZZ_CONFIG=tmp.name)
        for old in runs.glob("shard-*.*"):
            old.unlink()
        log = runs / "pytest.log"
        with open(log, "w") as logf:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p",
                                     "no:cacheprovider", "-p", "no:randomly", "--pyargs",
                                     "harness.fuzzshard", "-n", str(args.workers), "-o",
                                     "timeout=0"], env=env, stdout=logf,
                                    stderr=subprocess.STDOUT, text=True)
            try:
                while proc.poll() is None:
                    time.sleep(2)
                    _fuzz_progress(runs, args.examples, time.monotonic() - t0,
                                   out.progress.transient)
            finally:
                if proc.poll() is None:             # an interrupt: the shards go with it
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                os.unlink(tmp.name)
        r = subprocess.CompletedProcess(proc.args, proc.returncode, log.read_text(), "")
        shards = [json.loads(p.read_text()) for p in sorted(runs.glob("shard-*.json"))]
        for p in runs.glob("shard-*.progress"):
            p.unlink()
        if len(shards) != args.workers:
            why = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("E ")][:1]
            raise SetupError(f"{args.workers - len(shards)} fuzz worker(s) failed"
                             + (f": {why[0][2:].strip()[:300]}" if why else ""),
                             f"the workers' output is in {runs / 'pytest.log'}")
    wall = time.monotonic() - t0
    examples = sum(s["examples"] for s in shards)
    seen: dict[str, fuzz.Finding] = {}
    for s in shards:
        for d in s["findings"]:
            f = fuzz.Finding(**{**d, "lines": tuple(d["lines"])})
            seen.setdefault(f.signature, f)
    findings = list(seen.values())
    report_lines = []
    for f in findings:
        repro = fuzz.repro_line(f, image=args.image, guest=args.guest, workload=workload)
        # In a checkout, straight into the suite's regression cases; else beside the run.
        # One that did not repeat on replay is no case a suite can rely on: beside the run.
        in_checkout = (fuzz.REGRESSIONS.parent.parent / "vm").is_dir()
        kernel = img.series if args.image else None
        case = fuzz.write_regression(f, kernel=kernel) if in_checkout and not f.flaky \
            else fuzz.write_regression(f, runs / "regressions", kernel=kernel)
        report_lines.append(f"- {f.kind}: {f.detail.splitlines()[0]}\n  {repro}\n  case: {case}")
    doc = {"config": cfg, "examples": examples, "wall_seconds": wall,
           "findings": [f.as_dict() for f in findings]}
    (runs / "findings.json").write_text(json.dumps(doc, indent=1))
    (runs / "findings.md").write_text("\n".join(report_lines) + "\n")
    rate = 60 * examples / wall if wall else 0.0
    out.progress.clear()
    out.text(f"kph fuzz: {examples} examples in {wall:.0f} s ({rate:.0f}/min, {args.workers} "
             f"worker(s)); {sum(s['agreed_runs'] for s in shards)} agreed on events, "
             f"{sum(s['agreed_refusals'] for s in shards)} on refusals; "
             + (f"{unmirrored} not mirrored by this host engine or guest side; "
                if (unmirrored := sum(s.get('not_mirrored', 0) for s in shards)) else "")
             + f"{len(findings)} finding(s); in {runs}")
    for ln in report_lines:
        out.text(ln)
    out.result({**doc, "dir": str(runs)})
    return EXIT_OK if not findings else EXIT_DIVERGED


def _fuzz_progress(runs: Any, total: int, elapsed: float, say: Any) -> None:
    """One progress line from the shards' ``shard-*.progress`` files."""
    done = found = 0
    for p in runs.glob("shard-*.progress"):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        done += d.get("examples", 0)
        found += d.get("findings", 0)
    if not done:
        say(f"fuzz: booting the workers' machines ({elapsed:.0f} s)")
        return
    rate = 60 * done / elapsed
    left = (total - done) / (done / elapsed) if done < total else 0
    say(f"fuzz: {done}/{total} examples, {found} finding(s), {rate:.0f}/min, "
        f"about {left / 60:.0f} min left")


def _worker(args: argparse.Namespace, out: Output) -> int:
    from . import remote

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    if args.worker_cmd == "identity":
        ident = remote.local_identity(kernels or None)
        out.result(ident)
        out.text(f"{ident['host']}: commit {ident['commit'][:12]}"
                 f"{' (dirty)' if ident['dirty'] else ''}, QEMU {ident['qemu']}, "
                 f"{ident['cores']} cores")
        for series, i in ident["images"].items():
            out.text(f"  {series:6s} {i['abi']} ({'current' if i['current'] else 'stale'})")
        return EXIT_OK
    if args.worker_cmd == "prepare":
        info = remote.prepare(args.target, directory=args.dir, commit=args.commit,
                              kernels=kernels, cache=args.cache, ssh_config=args.ssh_config,
                              progress=out.progress)
        out.progress.clear()
        out.result(info)
        out.text(f"--tx {info['tx']}")
        return EXIT_OK
    raise SetupError("kph worker needs an action", "try `kph worker prepare HOST --dir PATH`")


def _diff_three(args: argparse.Namespace, specs: list[Any], out: Output,
                verdict: dict[str, Any]) -> int:
    """``kph diff --host both``: gdbstub, plugin and guest on one execution (harness.worlds)."""
    from . import report
    from .worlds import run_three

    out.progress("booting" + (" cold (--cold)" if args.cold else ""))
    with _machine(args) as vm:
        _booted(vm, args, out)
        out.progress("three worlds: registering, running the workload, collecting")
        three = run_three(vm, specs, args.run, guest=args.guest, timeout=args.timeout,
                          **verdict)
    out.progress.clear()
    for res in three.pairs:
        out.text(report.text(res, workload=args.run, status=three.runs[0].workload_status))
    first = three.first_divergence()
    out.text(f"three worlds: {'EQUIVALENT' if first is None else first.verdict_word.upper()}"
             + ("" if first is None else f" first between {first.a_side} and {first.b_side}"))
    which = ((0, 2), (1, 2), (0, 1))
    out.result({"equivalent": first is None,
                "pairs": [json.loads(report.to_json(r, (three.runs[i], three.runs[j])))
                          for r, (i, j) in zip(three.pairs, which)]})
    if args.html:
        k = three.pairs.index(first) if first is not None else 0
        i, j = which[k]
        with open(args.html, "w") as f:
            f.write(report.to_html(three.pairs[k], (three.runs[i], three.runs[j]), workload=args.run))
    return EXIT_OK if first is None else _exit_for(first)


def _repro(args: argparse.Namespace, out: Output) -> int:
    from pathlib import Path

    from . import repro, scenario

    if args.record and args.replay:
        raise SetupError("--record and --replay together", "record first, then replay the bundle")
    if args.gdb and not args.replay:
        raise SetupError("--gdb goes with --replay DIR", "kph repro --replay DIR --gdb")
    if args.scenario is None and not args.replay:
        raise SetupError("kph repro needs a scenario file", "kph repro probes/scenarios/NAME.toml")
    _check_output("-o", out.json_file)
    scn = scenario.load(args.scenario) if args.scenario else None
    if args.replay:
        return _replay(scn, args, out)
    assert scn is not None
    if args.record:
        from . import repro_rr

        res = repro_rr.record_scenario(scn, out_dir=Path(args.out) if args.out else None,
                                       qemu=args.qemu, progress=out.progress)
    else:
        res = repro.run(scn, out_dir=Path(args.out) if args.out else None, qemu=args.qemu,
                        progress=out.progress)
    out.progress.clear()
    out.text(f"{'MET' if res.met else 'NOT MET'}: {scn.name}" + (" (recorded)" if args.record else ""))
    out.text(f"  cause: {res.cause}")
    for r in res.reasons:
        out.text(f"  - {r}")
    out.text(f"  evidence: {res.bundle}/summary.md")
    doc = {"met": res.met, "scenario": scn.name, "file": str(scn.path), "cause": res.cause,
           "reasons": list(res.reasons), "bundle": str(res.bundle),
           "summary": f"{res.bundle}/summary.md"}
    if args.record:
        out.text(f"  replay:   kph repro --replay {res.bundle}")
        doc["replay"] = f"kph repro --replay {res.bundle}"
    out.result(doc)
    return EXIT_OK if res.met else EXIT_DIVERGED


def _replay(scn: Any, args: argparse.Namespace, out: Output) -> int:
    """``kph repro --replay DIR [--gdb]``: 0 when the replay is identical to the recording."""
    from pathlib import Path

    from .repro_rr import replay_scenario

    bundle = Path(args.replay)
    if scn is not None and (bundle / "scenario.toml").is_file() and \
            (bundle / "scenario.toml").read_text() != scn.text:
        raise SetupError(f"{bundle} recorded another scenario than {scn.path}",
                         f"run `kph repro --replay {bundle}` without the scenario")
    rep = replay_scenario(bundle, qemu=args.qemu, keep=args.gdb, progress=out.progress)
    res = rep.result
    same = rep.same_console and rep.same_registers is not False
    regs = {True: "identical", False: "DIFFERENT", None: "not compared (the run did not end in a panic)"}
    end = res.end.value if res.end else "?"
    console_same = res.console == res.recorded.console
    out.progress.clear()
    out.text(f"{'REPLAYED' if same else 'DIVERGED'}: end {end} (recorded {res.recorded.end.value}) at "
             f"instruction {res.icount} (recorded {res.recorded.icount}), console "
             f"{'identical' if console_same else 'DIFFERENT'} "
             f"({len(res.console)} of {len(res.recorded.console)} chars), registers at the end "
             f"{regs[rep.same_registers]}")
    for r in rep.reasons:
        out.text(f"  - {r}")
    out.text(f"  stack at the end: {bundle}/replay-stack.txt")
    doc = {"replayed": same, "met": rep.met, "end": end, "recorded_end": res.recorded.end.value,
           "icount": res.icount, "recorded_icount": res.recorded.icount,
           "console_identical": console_same, "registers_identical": rep.same_registers,
           "reasons": list(rep.reasons), "stack": f"{bundle}/replay-stack.txt"}
    if args.gdb:
        with res:
            doc["gdb_socket"] = str(res.gdb_socket)
            out.result(doc)
            out.text(f"gdb is welcome: gdb -ex 'target remote {res.gdb_socket}' "
                     "(reverse-stepi, reverse-continue; `monitor quit` or Ctrl-C here ends QEMU)")
            old = signal.signal(signal.SIGTERM, signal.default_int_handler)
            try:
                res.wait()
            except KeyboardInterrupt:
                pass
            finally:
                signal.signal(signal.SIGTERM, old)
    else:
        out.result(doc)
    return EXIT_OK if same and rep.met else EXIT_DIVERGED


def _demo(args: argparse.Namespace, out: Output) -> int:
    import dataclasses

    from . import report, trapflow
    from .vmctl import Machine

    if args.demo_cmd != "trap-flow":
        raise SetupError("kph demo needs a demo name", "try `kph demo trap-flow`")
    _check_output("--html", args.html)
    _check_output("-o", out.json_file)
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    for v in variants:
        if v not in ("int3", "ftrace", "optimized", "kretprobe", "uprobe", "uretprobe"):
            raise SetupError(f"unknown variant {v!r}",
                             "use int3, ftrace, optimized, kretprobe, uprobe, uretprobe")
    if "+" not in args.symbol or args.symbol.endswith("+0"):
        raise SetupError(f"--symbol {args.symbol} is a function entry (ftrace-based there)",
                         "give an offset into the function, e.g. do_sys_openat2+5")
    out.progress("demo: booting the default image")
    with Machine.boot() as vm:
        flows = []
        for v in variants:
            out.progress(f"demo: {v}: placing the in-guest probe and the host observers")
            flows += trapflow.demo(vm, target=args.symbol, workload=args.run, variants=(v,))
        left = vm.run("cat /sys/kernel/debug/kprobes/list; lsmod | grep -c kph_kprobes || true").stdout
    out.progress.clear()
    pause = args.step and not out.quiet
    for f in flows:
        blocks = report.trapflow_blocks(f)
        for i, block in enumerate(blocks):
            out.text(block)
            if pause and 1 <= i <= len(f.steps):     # after each step, not header or facts
                pause = _wait_enter()
    if left.strip() not in ("", "0"):
        out.warn(f"the guest still lists probes: {left.strip()}")
    out.result({"flows": [dataclasses.asdict(f) for f in flows],
                "guest_left_clean": left.strip() in ("", "0")})
    if args.html:
        with open(args.html, "w") as f:
            f.write(report.trapflow_html(flows))
        out.text(f"demo: wrote {args.html}")
    return EXIT_OK


def _wait_enter() -> bool:
    """Wait for Enter after a step; False (stop pausing) when stdin is not a terminal or
    has ended, so ``--step`` in a script or a pipe never blocks nor crashes."""
    if not sys.stdin or not sys.stdin.isatty():
        print("  (--step: stdin is not a terminal; not pausing)", file=sys.stderr)
        return False
    sys.stderr.write("  [Enter] ")
    sys.stderr.flush()
    return bool(sys.stdin.readline())     # "" at the end of input: stop pausing


COMMANDS: dict[str, Callable[[argparse.Namespace, Output], int]] = {
    "demo": _demo,
    "boot": _boot, "image": _image, "qemu": _qemu_cmd, "doctor": _doctor,
    "probe": _probe, "diff": _diff, "repro": _repro, "matrix": _matrix, "worker": _worker, "fuzz": _fuzz,
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


def _on_unraisable(u: Any) -> None:
    """``sys.unraisablehook`` while ``main`` runs. The KeyboardInterrupt ``_on_signal``
    raises can land where Python cannot raise (an at-fork callback such as logging's
    ``_releaseLock``, a ``__del__``): Python would print it as "Exception ignored in" with
    a traceback and go on. Silent instead, and delivered again 10 ms later (SIGALRM), where
    it can unwind ``main``."""
    if _interrupted and u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt):
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.01)
        return
    sys.__unraisablehook__(u)


def _on_alarm(signum: int, frame: object) -> None:
    if _interrupted and not _exiting:      # not once main is reporting the interruption
        raise KeyboardInterrupt


#: set when ``main`` reports an interruption (a late SIGALRM then raises nothing)
_exiting: list[bool] = []


def main(argv: Sequence[str] | None = None) -> int:
    _interrupted.clear()
    _exiting.clear()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    alarm = signal.getsignal(signal.SIGALRM)
    unraisable, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    try:
        parser = make_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        old = _old_json_form(argv)
        if old is not None:
            print(f"error: --json takes no file name ({old!r}): it writes the JSON to stdout; "
                  f"write a file with -o {old} (or --json-file {old})", file=sys.stderr)
            return EXIT_USAGE
        args = parser.parse_args(argv)
        logging.basicConfig(level=getattr(logging, args.log_level),
                            format="%(name)s: %(message)s", handlers=[_LogHandler()])
        logging.getLogger("qemu.qmp").setLevel(max(logging.CRITICAL, logging.getLogger().level))
        if not args.cmd:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return _dispatch(args)
    except BaseException:  # noqa: BLE001 - an interruption wins over what it caused
        if _interrupted:
            return _interrupted_exit()
        raise
    finally:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.default_int_handler)
        sys.unraisablehook = unraisable
        if signal.getsignal(signal.SIGALRM) is _on_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, alarm if alarm is not None else signal.SIG_DFL)


def _interrupted_exit() -> int:
    _exiting.append(True)
    if signal.getsignal(signal.SIGALRM) is _on_alarm:
        signal.setitimer(signal.ITIMER_REAL, 0)
    _clear_progress()
    name = signal.Signals(_interrupted[0]).name if _interrupted else "SIGINT"
    print(f"interrupted ({name})", file=sys.stderr)
    return 130


def _dispatch(args: argparse.Namespace) -> int:
    try:
        out = Output(args)
        _check_output("-o", out.json_file)       # before any work, for every command
        return COMMANDS[args.cmd](args, out)
    except BaseException as exc:  # noqa: BLE001 - mapped to one line and an exit code
        if _interrupted or isinstance(exc, KeyboardInterrupt):
            return _interrupted_exit()
        code = _report_error(exc)
        if code is None:
            raise
        return code


def _clear_progress() -> None:
    if _current:
        _current[-1].progress.clear()


def _report_error(exc: BaseException) -> int | None:
    """Print the one line for a harness error and return the exit status (None: not ours)."""
    from .errors import HandlerError

    _clear_progress()
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
    if isinstance(exc, (EngineReadError, PluginRecordError)):
        # never a value: the run is not compared; 3 when the VM was lost under it
        print(f"error: {exc}", file=sys.stderr)
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, VMError):
            cause = cause.__cause__
        return EXIT_INFRA if cause is not None else EXIT_USAGE
    if isinstance(exc, HarnessError):
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if isinstance(exc, OSError):    # the host refused something (disk full, permissions)
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INFRA
    return None


if __name__ == "__main__":
    sys.exit(main())
