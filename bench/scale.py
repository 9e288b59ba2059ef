#!/usr/bin/env python3
"""Cost curves for the number of probes (issue 39 item 3): how registration, the cost of
a hit, memory and a whole ``kph diff`` grow with 1, 10, 100, 1,000 ... probes.

For each N, ``p:`` lines on N distinct functions (the workload's own hot functions
first, so that hits happen, then functions of ``available_filter_functions`` outside the
kprobe blacklist, in address order) are placed by each side alone, on one fresh machine
per side and N (``harness.diff.runner.run_single``, whose progress marks the phases):

- ``events``: the guest's tracefs ``kprobe_events`` (kph-reader writes the lines, one
  request: ``Machine.reader_writes``);
- ``events-shell``: the same, the lines written by one guest shell script instead (what
  ``events`` did before 2026-12-02; ``EventsBackend.shell_writes``);
- ``host``: the gdbstub engine (a breakpoint per line);
- ``plugin``: the TCG plugin engine (a site per line).

It prints, per side and N: registration seconds, the workload's seconds, the hits, the
added microseconds per hit against the unprobed workload of the same machine, the
collection seconds, the harness's peak RSS and QEMU's RSS after the run; then, per side,
the growth of registration from each N to the next (the ratio of seconds over the ratio
of N: 1.0 is linear). ``--fprobe`` adds ``f:`` globs matching about N functions (6.12+).
``--whole`` also times a whole ``kph diff`` command (both sides, compared) per N.

Measured on one machine in one run, interleaved by N; run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness import Machine  # noqa: E402
from harness.backends.events import EventsBackend  # noqa: E402
from harness.diff.runner import run_single  # noqa: E402
from harness.errors import HarnessError  # noqa: E402
from harness.kernel.grammar import parse  # noqa: E402
from harness.machine.image.facts import kernel_view  # noqa: E402
from harness.machine.image.store import default_image  # noqa: E402

#: the workload: opens, reads and a few processes, the same for every N
WORKLOAD = ("i=0; while [ $i -lt 20 ]; do cat /proc/version > /dev/null; "
            "head -c 20 /proc/cpuinfo > /dev/null; i=$((i+1)); done")
HOT = ("do_sys_openat2", "vfs_read", "ksys_read", "do_filp_open", "path_openat",
       "kernel_clone", "do_exit", "vfs_write", "filp_close", "fput")
SIDES = {"events": ("events", "gdbstub"), "events-shell": ("events", "gdbstub"),
         "host": ("host", "gdbstub"), "plugin": ("plugin", "plugin")}


def traceable(vm: Machine) -> list[str]:
    """The core kernel's functions in ``available_filter_functions`` (what ftrace, and an
    ``f:`` glob, can attach to), one entry a line."""
    listed = vm.run("cat /sys/kernel/tracing/available_filter_functions", timeout=120,
                    check=True).stdout.split("\n")
    return [ln.split(" ", 1)[0] for ln in listed if ln and "[" not in ln]


def glob_prefix(names: list[str], n: int) -> tuple[str, int]:
    """A prefix of 3 to 8 characters whose functions number nearest ``n`` (the shorter
    on a tie), and that number: ``f:fg PREFIX*`` then attaches about ``n`` functions."""
    counts = Counter(nm[:k] for nm in set(names) for k in range(3, 9) if len(nm) > k)
    return min(counts.items(), key=lambda kv: (abs(kv[1] - n), len(kv[0])))


def functions(vm: Machine, n: int, names: list[str] | None = None) -> list[str]:
    """N functions a kprobe can take: the hot ones, then traceable ones outside the
    blacklist, one name each (names defined twice are left out: a p: line on one
    is refused as not unique)."""
    names = names if names is not None else traceable(vm)
    seen: dict[str, int] = {}
    for nm in names:
        seen[nm] = seen.get(nm, 0) + 1
    bl = vm.blacklist
    view = kernel_view(vm.facts)

    def takes(nm: str) -> bool:
        try:        # the kernel's parser: a name kallsyms holds twice is refused
            parse(f"p:x {nm}", kernel=view)
            return bl.find(vm.symbols.lookup(nm).addr) is None
        except HarnessError:
            return False
    out = [h for h in HOT if seen.get(h) == 1 and takes(h)]
    for nm in names:
        if len(out) >= n:
            break
        if seen[nm] != 1 or nm in out or nm.startswith(("__", "trace_", "kprobe", "ftrace")):
            continue
        if takes(nm):
            out.append(nm)
    return out[:n]


def rss_kib(pid: int) -> int:
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            if ln.startswith("VmRSS:"):
                return int(ln.split()[1])
    except OSError:
        pass
    return 0


def one(img, side: str, lines: list[str], engine: str) -> dict:
    backend = SIDES[side][0]
    marks: list[tuple[float, str]] = []
    EventsBackend.shell_writes = side == "events-shell"
    with Machine.boot(img, host=engine) as vm:
        t = time.monotonic()
        vm.run(WORKLOAD, timeout=600, check=True)
        bare = time.monotonic() - t
        view = kernel_view(vm.facts)
        specs = [parse(ln, kernel=view) for ln in lines]
        t0 = time.monotonic()
        res = run_single(vm, backend, specs, WORKLOAD, timeout=1800,
                         progress=lambda s: marks.append((time.monotonic(), s)))
        end = time.monotonic()
        qemu_rss = rss_kib(vm.proc.pid) if vm.proc is not None else 0    # after the run

    def at(word: str) -> float:
        return next((t for t, s in marks if s.startswith(word)), end)
    reg = at("workload running") - at("registering")
    work = at("collecting") - at("workload running")
    hits = len(res.hits)
    refused = sum(1 for o in res.outcomes if not o.accepted)
    return {"side": side, "n": len(lines), "register_s": reg, "workload_s": work,
            "bare_s": bare, "hits": hits, "refused": refused,
            "added_us_per_hit": (work - bare) / hits * 1e6 if hits else float("nan"),
            "collect_s": end - at("collecting"), "total_s": end - t0,
            "kph_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "qemu_rss_mib": qemu_rss / 1024}


def whole(image: str | None, side: str, lines: list[str]) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        host = "plugin" if side == "plugin" else "gdbstub"
        argv = [sys.executable, "-m", "harness.cli", "diff", "-q", "--host", host, "-f", f.name,
                "--run", WORKLOAD, "--timeout", "1800"] + (["--image", image] if image else [])
        t = time.monotonic()
        subprocess.run(argv, capture_output=True, timeout=3600)
        return time.monotonic() - t


def growth(rows: list[dict], key: str) -> str:
    out = []
    for a, b in zip(rows, rows[1:]):
        if a[key] > 0 and b["n"] > a["n"]:
            out.append(f"{a['n']}->{b['n']}: {(b[key] / a[key]) / (b['n'] / a['n']):.2f}")
    return ", ".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image", help="the kernel (default: 6.12, which has f: lines)",
                    default="6.12")
    ap.add_argument("--sizes", default="1,10,100,1000",
                    help="numbers of probes, comma-separated (default 1,10,100,1000)")
    ap.add_argument("--sides", default="events,host,plugin",
                    help="events, events-shell, host (gdbstub), plugin (default events, "
                    "host, plugin)")
    ap.add_argument("--fprobe", action="store_true", help="also f: globs of about N functions")
    ap.add_argument("--whole", action="store_true", help="also a whole kph diff per N")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    sides = [s for s in args.sides.split(",") if s]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        ap.error(f"--sides: unknown {', '.join(bad)}; use {', '.join(SIDES)}")
    img = default_image(args.image)
    with Machine.boot(img) as vm:
        names = traceable(vm)
        funcs = functions(vm, max(sizes), names)
    print(f"# {img.version}; {len(funcs)} functions available for the largest N; "
          f"workload: {WORKLOAD}")
    rows: dict[str, list[dict]] = {s: [] for s in sides}
    fields = ("register_s", "workload_s", "bare_s", "hits", "refused", "added_us_per_hit",
              "collect_s", "total_s", "kph_rss_mib", "qemu_rss_mib")
    print("side         N      " + "  ".join(f"{f:>16}" for f in fields)
          + ("  whole_kph_diff_s" if args.whole else ""))
    for n in sizes:
        lines = [f"p:s{i} {fn}" for i, fn in enumerate(funcs[:n])]
        for side in sides:
            try:
                r = one(img, side, lines, SIDES[side][1])
            except HarnessError as exc:     # printed in its own words, the curve goes on
                print(f"{side:12s} {n:<6d} failed: {str(exc).splitlines()[0]}", flush=True)
                continue
            rows[side].append(r)
            w = f"  {whole(args.image, side, lines):16.1f}" if args.whole and \
                not side.startswith("events") else ""
            print(f"{side:12s} {n:<6d} " + "  ".join(
                f"{r[f]:16.3f}" if isinstance(r[f], float) else f"{r[f]:16d}" for f in fields)
                + w, flush=True)
        if args.fprobe:
            # f: globs: a prefix whose matches are about n functions
            prefix, matched = glob_prefix(names, n)
            glob = [f"f:fg {prefix}*"]
            for side in sides:
                try:
                    r = one(img, side, glob, SIDES[side][1])
                except HarnessError as exc:     # a limit of the side, in its own words
                    print(f"{side + ' f:':8s} {n:<6d} refused: {exc}", flush=True)
                    continue
                print(f"{side + ' f:':8s} {n:<6d} register {r['register_s']:.3f} s, "
                      f"{r['hits']} hits, total {r['total_s']:.3f} s "
                      f"({glob[0]}: {matched} functions listed)", flush=True)
    print("\n# growth of registration (ratio of seconds / ratio of N; 1.0 = linear)")
    for side in sides:
        print(f"{side:12s} {growth(rows[side], 'register_s')}")
    print("# growth of the whole side's time")
    for side in sides:
        print(f"{side:12s} {growth(rows[side], 'total_s')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
