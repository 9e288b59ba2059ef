#!/usr/bin/env python3
"""What one ``kph`` process costs before and around its guest work: the same small
``kph diff`` (one ``p:`` line, ``cat /proc/version``) as a process of its own, in three
set-ups, interleaved, N rounds each, medians:

  as set up     harness' bytecode written (setup.sh) and the facts a process keeps
                beside the image's kallsyms and BTF (``.kallsyms.table.kept``,
                ``.btf.index.kept``: harness.machine.image.facts ``_derived``);
  first after   the kept facts removed before each run: the first process after an
  a build       image build parses kallsyms and BTF and keeps them;
  no bytecode   what a process pays where PYTHONDONTWRITEBYTECODE is set and nothing
                wrote harness' bytecode: each of its modules compiled (harness'
                ``__pycache__`` removed for the run, written again after it);
  shutdown      as set up, but the objects ``kph`` leaves out of the interpreter's
  collected     shutdown collections (``harness.cli.main._freeze_for_exit``) given back
                to them (``gc.unfreeze()`` in an ``atexit`` hook): what the exit cost
                before;
  loaded after  as set up, but the image's BTF and the disassembler loaded when first
  the start     asked for, after the guest's start, not in a thread beside it
                (``harness.vmctl.Machine._warm_host_side`` made a no-op): what the
                start cost before.

``--image`` picks the image (default: the default image).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.machine.image.facts import KEPT  # noqa: E402
from harness.machine.image.store import default_image  # noqa: E402

LINE = "p:o do_sys_openat2 dfd=%di:s32 path=+0(%si):ustring"


#: ``python -m harness.cli`` with the freeze at its end undone: the hook is registered
#: first, so it runs after main() froze (atexit runs its hooks last in, first out)
UNFROZEN = ("import atexit, gc, runpy, sys; atexit.register(gc.unfreeze); sys.argv[0] = 'kph'; "
            "runpy.run_module('harness.cli', run_name='__main__')")
#: the same with nothing loaded beside the guest's start
UNWARMED = ("import runpy, sys; import harness.vmctl as v; "
            "v.Machine._warm_host_side = lambda self: None; sys.argv[0] = 'kph'; "
            "runpy.run_module('harness.cli', run_name='__main__')")


def one(kernel: str | None, env: dict[str, str], *, prelude: str | None = None) -> float:
    argv = [sys.executable, "-m", "harness.cli", "diff", "-q", LINE, "--run", "cat /proc/version"]
    if prelude:
        argv[1:3] = ["-c", prelude]
    if kernel:
        argv[4:4] = ["--image", kernel]
    t0 = time.monotonic()
    r = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=300, check=False)
    took = time.monotonic() - t0
    if r.returncode != 0:
        sys.exit(f"kph diff exited {r.returncode}: {r.stderr.strip()[-500:]}")
    return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=5, help="rounds (default 5)")
    ap.add_argument("--image", help="the image (a series such as 7.3; default: the default image)")
    args = ap.parse_args()
    img = default_image(args.image)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "harness"], cwd=ROOT, check=True)
    base = dict(os.environ)
    base.pop("PYTHONPYCACHEPREFIX", None)
    one(args.image, base)                  # the snapshot and the kept facts exist now
    times: dict[str, list[float]] = {"as set up": [], "first after a build": [],
                                     "no bytecode": [], "shutdown collected": [],
                                     "loaded after the start": []}
    for _ in range(args.n):
        times["as set up"].append(one(args.image, base))
        times["shutdown collected"].append(one(args.image, base, prelude=UNFROZEN))
        times["loaded after the start"].append(one(args.image, base, prelude=UNWARMED))
        for p in img.dir.glob(f".*{KEPT}"):
            p.unlink()
        times["first after a build"].append(one(args.image, base))
        for d in (ROOT / "harness").rglob("__pycache__"):
            shutil.rmtree(d)
        try:
            times["no bytecode"].append(one(args.image, dict(base, PYTHONDONTWRITEBYTECODE="1")))
        finally:
            subprocess.run([sys.executable, "-m", "compileall", "-q", "harness"], cwd=ROOT,
                           check=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"kph diff {LINE!r} --run 'cat /proc/version' on {img.version}, "
          f"medians of {args.n} rounds, interleaved")
    for k, v in med.items():
        print(f"  {k:22s} {v:6.2f} s   x{v / med['as set up']:.2f}   "
              f"(min {min(times[k]):.2f}, max {max(times[k]):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
