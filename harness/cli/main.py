"""``kph``'s entry: the top parser, the verbs' registry, signals, and the one place that
maps what a verb raised to one line and an exit status (``harness.cli.output``)."""
from __future__ import annotations

import argparse
import gc
import logging
import signal
import sys
import typing
import warnings
from types import ModuleType
from typing import Any, Callable, Sequence

from . import boot, demo, diff, doctor, fuzz, image, kernel, matrix, probe, qemu, repro, worker
from . import upstream
from . import bisect, hunt
from ..errors import SetupError, StaleImageError
from .output import (EXIT_INTERRUPTED, EXIT_USAGE, LogHandler, Output, check_output,
                     clear_progress, current, output_options, report_crash, report_error)

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
3 the VM was lost (QEMU died, QMP silent), 4 empty (kph diff: nothing measured),
5 a kernel splat during the run (WARNING, BUG, Oops, panic, ...), 6 the guest hung,
130 interrupted."""

#: Every verb, in the order ``kph --help`` lists them. A verb is one module with ``NAME``,
#: ``EXAMPLES``, ``add_parser(subparsers)`` and ``run(args, out) -> exit status``: adding
#: one is that module and a line here.
VERBS: tuple[ModuleType, ...] = (image, kernel, qemu, boot, probe, diff, matrix, fuzz, worker, repro,
                                 demo, doctor) + (upstream,)
VERBS += (hunt, bisect)

#: Every verb's --help examples, pasted and run by tests/vm/test_help_examples.py from a
#: directory holding the checkout's probes/ (paths are relative to the checkout).
#: An example that cannot run on one machine says so after "# not run:".
EXAMPLES: dict[str, list[str]] = {v.NAME: v.EXAMPLES for v in VERBS}

COMMANDS: dict[str, Callable[[argparse.Namespace, Output], int]] = {v.NAME: v.run for v in VERBS}


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kprobe-harness")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Version(argparse.Action):
    """``--version``, worked out when asked for: the package's metadata costs 26-42 ms,
    which every ``kph`` command paid to build its parser."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS,
                 help: str = "show the program's version number and exit") -> None:
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0,
                         help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"kph (kprobe-harness) {_version()}")
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2), naming the way to the help."""

    def error(self, message: str) -> "typing.NoReturn":  # type: ignore[name-defined]
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see `{self.prog} --help`)\n")


def make_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kph", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version)
    output_options(p, top=True)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND")
    for v in VERBS:
        v.add_parser(sub)
    return p


def _old_json_form(argv: list[str]) -> str | None:
    """``--json FILE`` was the old form of ``kph diff``/``matrix`` (a file); ``--json`` is
    now a flag and FILE would be taken for a stray argument. Returns FILE if used so."""
    for i, a in enumerate(argv[:-1]):
        nxt = argv[i + 1]
        if a == "--json" and nxt.lower().endswith(".json") and " " not in nxt:
            return nxt
    return None


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
    # Teardown after an interruption is quiet: what fails there fails because of it (a
    # coroutine made and not yet scheduled when the signal came, QMP's connect for one,
    # would print a RuntimeWarning as it is collected).
    logging.disable(logging.CRITICAL)
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited",
                            category=RuntimeWarning)
    vmctl = sys.modules.get("harness.vmctl")   # not loaded yet: no machine to abort
    if vmctl is not None:
        vmctl.abort_all()
    raise KeyboardInterrupt


def _on_unraisable(u: Any) -> None:
    """``sys.unraisablehook`` while ``main`` runs. The KeyboardInterrupt ``_on_signal``
    raises can land where Python cannot raise (an at-fork callback such as logging's
    ``_releaseLock``, a ``__del__``): Python would print it as "Exception ignored in" with
    a traceback and go on. Silent instead, and delivered again 10 ms later (SIGALRM), where
    it can unwind ``main``. Any other exception Python cannot raise after an interruption
    is silent too: it comes of the interruption (an object it left half made, such as an
    asyncio loop whose ``__init__`` it cut before ``_debug`` was set, fails in its
    ``__del__`` when collected: CI, 2026-12-04, a SIGTERM during ``kph diff``)."""
    if _interrupted:
        if u.exc_type is not None and issubclass(u.exc_type, KeyboardInterrupt) \
                and not _exiting:
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
    early = getattr(sys.modules.get(__package__ or ""), "early_signals", [])
    _interrupted.clear()
    _exiting.clear()
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _on_signal)
    alarm = signal.getsignal(signal.SIGALRM)
    unraisable, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    try:
        if early:                       # while the package was imported (cli/__init__.py)
            signum = early[0]
            early.clear()
            _on_signal(signum, None)
        parser = make_parser()
        argv = list(sys.argv[1:] if argv is None else argv)
        old = _old_json_form(argv)
        if old is not None:
            print(f"error: --json takes no file name ({old!r}): it writes the JSON to stdout; "
                  f"write a file with -o {old} (or --json-file {old})", file=sys.stderr)
            return EXIT_USAGE
        args = parser.parse_args(argv)
        logging.basicConfig(level=getattr(logging, args.log_level),
                            format="%(name)s: %(message)s", handlers=[LogHandler()])
        logging.getLogger("qemu.qmp").setLevel(max(logging.CRITICAL, logging.getLogger().level))
        if not args.cmd:
            parser.print_help(sys.stderr)
            return EXIT_USAGE
        return _dispatch(args)
    except BaseException as exc:  # noqa: BLE001 - an interruption wins over what it caused
        if _interrupted:
            return _interrupted_exit()
        if isinstance(exc, Exception):      # not SystemExit (--help, usage errors)
            return report_crash(exc)
        raise
    finally:
        program = getattr(sys.modules.get(__package__ or ""), "as_program", False)
        for s in (signal.SIGINT, signal.SIGTERM):   # the outcome is decided (cli/__init__.py)
            signal.signal(s, signal.SIG_IGN if program else
                          signal.SIG_DFL if s == signal.SIGTERM else signal.default_int_handler)
        # after an interruption the hook stays: what it left half made may be collected
        # after main returns, as the process ends
        sys.unraisablehook = _on_unraisable if _interrupted else unraisable
        if program:
            _freeze_for_exit()
        if signal.getsignal(signal.SIGALRM) is _on_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, alarm if alarm is not None else signal.SIG_DFL)


def _freeze_for_exit() -> None:
    """As the program, once its outcome is decided: every object alive is left out of the
    collections of the interpreter's shutdown (``gc.freeze()``), which walk them all just
    before the process ends, whether or not the collector is switched off (measured:
    ``gc.disable()`` alone left 0.12 s of the exit, the freeze 0.03): 0.1-0.15 s of a
    small ``kph diff``, 0.2 s of one holding 60,000 hits (``bench/startup.py``,
    ``bench/hot_path.py --whole``). Objects are still freed by their counts,
    ``atexit`` hooks (the machines' reaping: ``harness.vmctl``) and the flushing of stdout
    and stderr still run; what is left out is only the finalizers of objects in reference
    cycles, and nothing here cleans up in one (files are closed by ``with``, processes by
    pid). Imported as a library (``main([...])`` in a test), nothing is frozen."""
    gc.freeze()


def _interrupted_exit() -> int:
    _exiting.append(True)
    # CPython marks a KeyboardInterrupt that leaves a string ``exec``/``eval`` (a dataclass
    # or namedtuple being made while an import is interrupted) "unhandled" even once caught,
    # and under ``python -m`` Py_RunMain then ends the process with SIGINT (-2), not 130.
    # Every string eval clears that mark as it starts (Python/pythonrun.c: run_eval_code_obj).
    exec("pass", {})
    if signal.getsignal(signal.SIGALRM) is _on_alarm:
        signal.setitimer(signal.ITIMER_REAL, 0)
    clear_progress()
    name = signal.Signals(_interrupted[0]).name if _interrupted else "SIGINT"
    print(f"interrupted ({name})", file=sys.stderr)
    return EXIT_INTERRUPTED


def _image_first(args: argparse.Namespace, out: Output) -> None:
    """``--image`` in any verb names an image that is there when the verb runs:
    ``tree:TREE[+PATCH...]`` (a kernel tree's image) and a series of Debian's kernels not
    built yet, or built from another recipe than this kph's (``6.12``: ``kph image build
    --kernel 6.12``, with progress) are built, or found current, first; anything else is
    looked up as it is (an unknown name: one line, exit 2; a stale image: one line naming
    the command that rebuilds it, ``store.check_recipe``)."""
    sel = getattr(args, "image", None)
    if not isinstance(sel, str):
        return
    from ..machine.image.build import build_image, image_for
    from ..machine.image.ksource import is_series
    from ..machine.image.store import check_recipe, default_image

    if is_series(sel):
        try:
            check_recipe(default_image(sel))
            return
        except StaleImageError:                 # Debian's current kernel of the series
            out.progress(f"image: the {sel} image was built from another recipe than this "
                         "kph's: rebuilding")
            args.image = str(build_image(kernel=sel, qemu=getattr(args, "qemu", None),
                                         progress=out.progress).dir)
            out.progress.clear()
            return
        except SetupError:
            pass                                # not built yet: built below
    elif not sel.startswith("tree:"):
        return
    args.image = str(image_for(sel, qemu=getattr(args, "qemu", None),
                               progress=out.progress).dir)
    out.progress.clear()


def _dispatch(args: argparse.Namespace) -> int:
    try:
        out = Output(args)
        check_output("-o", out.json_file)       # before any work, for every command
        _image_first(args, out)
        return COMMANDS[args.cmd](args, out)
    except BaseException as exc:  # noqa: BLE001 - mapped to one line and an exit code
        if _interrupted or isinstance(exc, KeyboardInterrupt):
            return _interrupted_exit()
        if not isinstance(exc, Exception):     # SystemExit: argparse's own exits
            raise
        _finding_result(exc)
        code = report_error(exc)
        return report_crash(exc) if code is None else code


def _finding_result(exc: BaseException) -> None:
    """A run ended by a kernel finding (a panic, a hang) still has a result for programs:
    ``result`` ``kernel-finding``, ``verdict``, and the splats (``--json``, ``-o``)."""
    from ..kernel.splat import KernelFinding

    if isinstance(exc, KernelFinding) and current:
        from ..diff.report import findings_json
        doc = findings_json(exc.splats)
        current[-1].result({"result": "kernel-finding", "equivalent": False,
                            "verdict": exc.verdict, "kernel": doc})
