"""``kph upstream``: the kernel findings of docs/upstream.md as patch series to send
(``harness.apps.upstream``)."""
from __future__ import annotations

import argparse
from typing import Any

from .common import ci_group, examples, sub
from .output import EXIT_DIVERGED, EXIT_OK, Output

NAME = "upstream"
EXAMPLES = ["kph upstream export btf-char-ptr --tree 6.12 --out series-1",
            "kph upstream export 2 --tree 7.3 --signoff --out series-2",
            "kph upstream verify 1 --tree 6.12 --kernels stock  # the series' selftest under "
            "ftracetest"]
VERIFY_EXAMPLES = [EXAMPLES[-1],
                   "kph upstream verify 1 --tree 6.12 --others  # every other case too; builds "
                   "the two kernels when missing (docs/upstream.md)"]


def _finding(p: argparse.ArgumentParser) -> None:
    p.add_argument("finding", metavar="FINDING", help="btf-char-ptr (1), "
                   "non-unique-symbol-errno (2) or second-kretprobe-ret-ip (3)")


def add_parser(subparsers: Any) -> None:
    u = sub(subparsers, NAME, help="Export a kernel finding (docs/upstream.md) as a git "
            "format-patch series: the fix and a kselftest case", epilog=examples(EXAMPLES))
    usub = u.add_subparsers(dest="upstream_cmd", metavar="ACTION")
    e = sub(usub, "export", help="Write the series against Debian's source of a series, "
            "then run the tree's checkpatch.pl --strict on each patch and git am the series "
            "on a clean checkout. Exit 0 when both pass, 1 when a check fails, 2 on a setup "
            "error (no git identity, no tree)", epilog=examples(EXAMPLES))
    _finding(e)
    e.add_argument("--tree", default="6.12", choices=("6.12", "7.3"),
                   help="Debian's linux-source of this series (default 6.12), fetched when "
                   "missing; its git copy is made once in $KPH_CACHE/upstream (about 1.5 min)")
    e.add_argument("--out", metavar="DIR", help="where the patches go (default "
                   "$KPH_CACHE/upstream/series/FINDING-SERIES); its *.patch are replaced")
    e.add_argument("--signoff", "-s", action="store_true", help="add Signed-off-by: of "
                   "git config user.name/user.email, as git format-patch -s does (you "
                   "certify the DCO)")
    e.add_argument("--no-check", action="store_true", help="skip checkpatch.pl and git am")
    v = sub(usub, "verify", help="Run the series' own kselftest case under the kernel's "
            "ftracetest (-K, KTAP read by the tree's kunit.py parse) on the kernel with the "
            "bug and on the same source with the series' fix. Exit 0 when it fails on stock "
            "and source and passes on patched, 1 otherwise, 2 on a setup error",
            epilog=examples(VERIFY_EXAMPLES))
    _finding(v)
    v.add_argument("--tree", default="6.12", choices=("6.12", "7.3"),
                   help="the series made against this tree (default 6.12): "
                   "probes/patches/upstream/FINDING/SERIES/")
    v.add_argument("--kernels", default="stock,source,patched", metavar="K,...",
                   help="stock (Debian's kernel), source (its source built small), patched "
                   "(that source with the series' fix); images are built when missing "
                   "(1 to 6 min each)")
    v.add_argument("--others", action="store_true", help="run every case of "
                   "test.d/kprobe and test.d/dynevent too, and require each other case's "
                   "result to be the same on the patched kernel as on the one with the bug "
                   "(source when it runs, else stock; about 1.5 min on each of the two; a "
                   "third kernel runs the series' case alone)")
    ci_group(v)


def run(args: argparse.Namespace, out: Output) -> int:
    from ..apps.upstream import export
    from ..errors import SetupError

    if getattr(args, "upstream_cmd", None) == "verify":
        return _verify(args, out)
    if getattr(args, "upstream_cmd", None) != "export":
        raise SetupError("kph upstream needs an action", "try `kph upstream export 1` or "
                         "`kph upstream verify 1`")
    e = export(args.finding, args.tree, args.out, signoff=args.signoff,
               check=not args.no_check, progress=out.progress)
    out.progress.clear()
    rows = []
    for i, p in enumerate(e.patches):
        c = e.checkpatch[i] if e.checkpatch else None
        verdict = ("not run" if c is None else
                   f"{c.errors} errors, {c.warnings} warnings, {c.checks} checks"
                   + (f" ({', '.join(c.types)})" if c.types else ""))
        out.text(f"{p}\n  {e.subjects[i]}\n  checkpatch --strict: {verdict}")
        rows.append({"patch": str(p), "subject": e.subjects[i],
                     "checkpatch": None if c is None else {
                         "errors": c.errors, "warnings": c.warnings, "checks": c.checks,
                         "types": c.types, "accepted": c.clean(e.accepted)}})
    if e.applied:
        out.text(f"git am on a clean checkout of linux-source-{e.tree.version}: applied\n"
                 + "".join(f"  {ln}\n" for ln in e.applied.splitlines()).rstrip())
    if not args.signoff:
        out.text("no Signed-off-by: (pass --signoff to add yours)")
    out.result({"finding": e.finding.name, "tree": e.tree.version, "base": e.tree.base,
                "branch": e.branch, "patches": rows, "git_am": bool(e.applied),
                "ok": e.ok if e.checkpatch else None})
    return EXIT_OK if (e.ok or args.no_check) else EXIT_DIVERGED


def _verify(args: argparse.Namespace, out: Output) -> int:
    from ..apps.upstream_verify import verify

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    from ..apps.upstream_verify import changed, compared

    runs = verify(args.finding, args.tree, kernels, others=args.others, progress=out.progress)
    out.progress.clear()
    moved = changed(runs) if args.others else {}
    for r in runs:
        said = r.why or r.line or "(no result line)"
        out.text(f"{r.kernel:8s} {'as expected' if r.ok else 'NOT as expected':16s} "
                 f"{r.result} (expected {r.expected})  {said}")
    if args.others:
        for r in runs:
            if not r.others:
                out.text(f"{r.kernel:8s} the series' case alone (--others compares "
                         f"{' and '.join(compared(kernels))})")
                continue
            tally: dict[str, int] = {}
            for st in r.cases.values():
                tally[st] = tally.get(st, 0) + 1
            out.text(f"{r.kernel:8s} {len(r.cases)} cases: " + ", ".join(
                f"{n} {st}" for st, n in sorted(tally.items())))
        out.text("other cases: " + ("the same on the patched kernel" if not moved else
                                    f"{len(moved)} changed") + "".join(
            f"\n  {n}: {a} -> {b}" for n, (a, b) in moved.items()))
    ok = all(r.ok for r in runs) and not moved
    both = {r.kernel for r in runs} & {"stock", "source"} and any(r.kernel == "patched"
                                                                 for r in runs)
    out.text("verified: the selftest fails without the fix and passes with it" if ok and both
             else "as expected on " + ", ".join(r.kernel for r in runs) + "; a verification "
             "needs a kernel with the bug and the patched one" if ok else "not verified")
    from ..diff import ktap
    from . import ci
    from ..apps.upstream import finding
    ci.emit(args, ktap.upstream_verify_cases(finding(args.finding).name, runs,
                                             moved if args.others else None),
            verb=f"{NAME} verify")
    out.result({"finding": args.finding, "tree": args.tree, "ok": ok,
                "verified": bool(ok and both),
                "changed": {n: list(v) for n, v in moved.items()},
                "runs": [{"kernel": r.kernel, "image": r.selector, "expected": r.expected,
                          "result": r.result, "ok": r.ok, "why": r.why, "ktap": r.ktap,
                          "test": r.test, "cases": r.cases} for r in runs]})
    return EXIT_OK if ok else EXIT_DIVERGED
