"""``kph image``: build, list or show the images (one per kernel)."""
from __future__ import annotations

import argparse
from typing import Any

from ..errors import SetupError
from .common import examples, sub
from .output import EXIT_OK, Output

NAME = "image"
EXAMPLES = ["kph image build", "kph image list", "kph image info --json",
            "kph image build --tree 6.12 --patch probes/patches/btf-char-ptr-needs-a-pointer.patch"
            "  # not run: builds a kernel (minutes); tests/vm/test_kbuild.py does"]


def add_parser(subparsers: Any) -> None:
    img = sub(subparsers, NAME, help="Build, list or show the images (one per kernel)",
              epilog=examples(EXAMPLES))
    isub = img.add_subparsers(dest="image_cmd", metavar="ACTION")
    b = sub(isub, "build", help="Provision an image: kernel, initramfs, kernel facts, "
            "module, ready snapshot",
            description="Build the image of a Debian cloud kernel: its packages, "
            "a busybox initramfs with qemu-ga, the test programs and kph_kprobes.ko "
            "(built with that kernel's own compiler), its kernel facts (kallsyms, "
            "blacklist, BTF, ...) harvested on a first boot, and its ready snapshot.",
            epilog=examples(EXAMPLES))
    b.add_argument("--kernel", metavar="SERIES|ABI", default=None,
                   help="which kernel: a series (6.1, 6.12, 7.3: what Debian 12, Debian 13 "
                   "and Debian 13 backports ship today) or a full ABI such as "
                   "6.12.117+deb13-cloud-amd64; default: Debian 12's, the default image")
    b.add_argument("--tree", metavar="TREE", default=None,
                   help="an image of a kernel built from source instead: a source tree (a git "
                   "checkout, a stable tree), a series (6.12: Debian's linux-source of it, "
                   "fetched first) or a build directory built already. The tree is "
                   "configured small and built (kph kernel build), kph_kprobes.ko is built "
                   "against it, and the image is named tree-<release>-<key>")
    b.add_argument("--patch", metavar="FILE", action="append", default=[],
                   help="with --tree: apply this patch (-p1) to a copy of the tree before "
                   "building; repeatable, in order; the image records each")
    b.add_argument("--out", "-O", metavar="DIR", help="with --tree: the build directory "
                   "(default: $KPH_CACHE/kbuild/<tree>-<hash>)")
    b.add_argument("--debug", action="store_true", help="with --tree: build it with the "
                   "debug options (images/kernel-debug.config: lockdep with PROVE_RCU, "
                   "DEBUG_ATOMIC_SLEEP, KASAN) in a build directory of its own; an image "
                   "of its own (its config keys it)")
    b.add_argument("-j", "--jobs", type=int, metavar="N", help="with --tree: parallel jobs "
                   "(default: the host's CPUs)")
    b.add_argument("--force", action="store_true", help="rebuild even when the cache is current")
    b.add_argument("--qemu", metavar="PATH", help="QEMU for the harvesting boot and the snapshot")
    b.add_argument("--no-snapshot", action="store_true",
                   help="do not make the ready snapshot (the first boot makes it)")
    inf = sub(isub, "info", help="Show an image's manifest and its snapshots",
              epilog=examples(EXAMPLES))
    inf.add_argument("--image", metavar="SERIES|ABI|DIR", help="the image (default: the default)")
    sub(isub, "list", help="List the images in the cache", epilog=examples(EXAMPLES))


def run(args: argparse.Namespace, out: Output) -> int:
    from ..machine.image.build import build_image
    from ..machine.image.store import default_image

    if args.image_cmd == "build":
        if args.tree is None:
            for opt, val in (("--patch", args.patch), ("--out", args.out), ("-j", args.jobs),
                             ("--debug", args.debug)):
                if val:
                    raise SetupError(f"{opt} is for an image of a kernel tree",
                                     "add --tree TREE (a source tree, a series, a build directory)")
            img = build_image(kernel=args.kernel, force=args.force, qemu=args.qemu,
                              snapshot=not args.no_snapshot, progress=out.progress)
        else:
            from ..machine.image.build import build_tree_image
            if args.kernel:
                raise SetupError("--kernel and --tree name two kernels", "pass one of them")
            if args.jobs is not None and args.jobs < 1:
                raise SetupError(f"-j {args.jobs}: the jobs must be 1 or more", "pass -j 2")
            img = build_tree_image(args.tree, patches=args.patch, out=args.out, jobs=args.jobs,
                                   force=args.force, qemu=args.qemu, debug=args.debug,
                                   snapshot=not args.no_snapshot, progress=out.progress)
        out.progress.clear()
        out.result(image_doc(img))
        if img.manifest.get("kernel_origin") == "tree":
            out.text(f"{img.dir}\nkernel {img.version}, kernel-series rules "
                     f"{img.manifest.get('rules')}; use it with --image {img.dir.name}")
        return EXIT_OK
    if args.image_cmd == "list":
        from ..machine.image.store import built_images, image_is_current, read_default
        from ..machine.snapshot import snapshots_of

        imgs = built_images()
        default = read_default()
        rows = [{"series": i.series, "kernel": i.version, "built": i.manifest.get("built", "?"),
                 "state": "current" if image_is_current(i) else "stale",
                 "snapshots": len(snapshots_of(i)), "default": i.version == default,
                 "dir": str(i.dir), "name": i.dir.name,
                 "patches": [p["name"] for p in i.manifest.get("tree", {}).get("patches", [])]}
                for i in imgs]
        out.result({"images": rows})
        if not imgs:
            out.text("no images; run `kph image build` (or --kernel 6.12, 7.3)")
            return EXIT_OK
        out.text(f"{'series':7s} {'kernel':32s} {'built':26s} {'state':8s} snapshots")
        for r in rows:
            tree = "" if r["name"] == r["kernel"] else \
                f"  {r['name']}" + "".join(f" +{p}" for p in r["patches"])
            out.text(f"{r['series']:7s} {r['kernel']:32s} {r['built']:26s} {r['state']:8s} "
                     f"{r['snapshots']}{' (default)' if r['default'] else ''}{tree}")
        return EXIT_OK
    if args.image_cmd == "info":
        img = default_image(args.image)
        doc = image_doc(img)
        out.result(doc)
        out.text(f"image {img.version} ({img.series}) in {img.dir}")
        out.text(f"  built {img.manifest.get('built', '?')}, recipe {img.manifest.get('recipe', '?')}")
        for name, a in sorted(img.manifest.get("artifacts", {}).items()):
            out.text(f"  {name:18s} sha256 {a.get('sha256', '?')[:16]}...  {a.get('size', '')}")
        for s in doc["snapshots"]:
            out.text(f"  snapshot {s['dir']}")
        return EXIT_OK
    raise SetupError("kph image needs an action", "try `kph image build`, `list` or `info`")


def image_doc(img: Any) -> dict[str, Any]:
    """An image's manifest, its directory and its snapshots (the JSON of build and info)."""
    from ..machine.snapshot import snapshots_of

    snaps = [dict(s.meta, dir=str(s.dir)) for s in snapshots_of(img)]
    return dict(img.manifest, dir=str(img.dir), snapshots=snaps)
