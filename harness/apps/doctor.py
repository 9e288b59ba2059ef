"""``kph doctor``: what the harness would use, and what to do about anything missing."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

from ..constants import cache_dir
from ..errors import HarnessError
from ..machine.qemu import find_qemu, system_qemu, why_chosen
from ..vmctl import probe_accel
from ..machine.image.store import built_images, default_image, image_is_current, read_default
from ..machine.image.toolchain import compiler_version, tree_dir


@dataclass(frozen=True)
class Check:
    """One line of ``kph doctor``. ``ok`` None: an optional thing that is not there (not
    a failure: the harness works without it)."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""

    @property
    def mark(self) -> str:
        return {True: "ok", False: "FAIL", None: "no"}[self.ok]


def _qemu() -> list[Check]:
    try:
        q = find_qemu()
    except HarnessError as exc:
        return [Check("qemu", False, str(exc), "run ./setup.sh")]
    out = [Check("qemu", q.fast_gdbstub,
                 f"{q.version_str} at {q.argv[-1]} ({why_chosen(q)})",
                 "" if q.fast_gdbstub else "run ./setup.sh to provision QEMU >= 10.2")]
    try:
        s = system_qemu()
    except HarnessError:
        s = None
    if s is not None and q.source != "system":
        out.append(Check("system qemu", True, f"{s.version_str} at {s.argv[0]} (fallback, not used)"))
    return out


def _gdb() -> Check:
    gdb = shutil.which("gdb")
    if not gdb:
        return Check("gdb", False, "not found", "apt-get install gdb")
    v = subprocess.run([gdb, "--version"], capture_output=True, text=True, timeout=20).stdout
    return Check("gdb", True, f"{v.splitlines()[0] if v else '?'} at {gdb}")


def _kvm() -> Check:
    """Not whether /dev/kvm opens (it does on hosts where KVM guests spin for ever) but
    whether a Linux guest gets going under ``-accel kvm``: the kernel is run for a few
    seconds (``harness.vmctl.probe_accel``)."""
    if not os.path.exists("/dev/kvm"):
        return Check("kvm", True, "no /dev/kvm: TCG will be used (the tested default)")
    try:
        fd = os.open("/dev/kvm", os.O_RDWR)
        os.close(fd)
    except OSError as exc:
        return Check("kvm", True, f"/dev/kvm not usable ({exc.strerror}): TCG will be used")

    try:
        ok, detail = probe_accel(find_qemu(), "kvm")
    except HarnessError as exc:
        return Check("kvm", True, f"/dev/kvm opens; not tried ({exc}); TCG stays the default")
    if ok:
        return Check("kvm", True, f"usable: {detail}; TCG stays the default (--accel kvm to use it)")
    return Check("kvm", None, f"{detail}; TCG will be used, --accel kvm is refused")


def _image() -> list[Check]:
    try:
        img = default_image()
    except HarnessError as exc:
        return [Check("image", False, str(exc).split(";")[0], "run `kph image build`")]
    current = image_is_current(img)
    m = img.manifest
    return [Check("image", current,
                  f"{img.version} in {img.dir} (built {m.get('built', '?')}, "
                  f"{m.get('boot_seconds', '?')} s to agent-ready)",
                  "" if current else "run `kph image build` (recipe or artifacts changed)"),
            Check("kallsyms", img.kallsyms.exists(),
                  f"{sum(1 for _ in open(img.kallsyms))} symbols" if img.kallsyms.exists() else "missing",
                  "" if img.kallsyms.exists() else "run `kph image build --force`")]


def _tools() -> list[Check]:
    out = []
    for tool, pkg in (("cpio", "cpio"), ("/bin/busybox", "busybox-static"),
                      ("/usr/sbin/qemu-ga", "qemu-guest-agent")):
        found = shutil.which(tool) or (tool if os.path.exists(tool) else None)
        out.append(Check(tool.rsplit("/", 1)[-1], bool(found), found or "missing",
                         "" if found else f"apt-get install {pkg}"))
    return out


def rebuild_command(img: Any) -> str:
    """The command that makes ``img`` again: a Debian kernel's series, or a kernel tree
    with the patches it was built with."""
    tree = img.manifest.get("tree")
    if img.manifest.get("kernel_origin") == "tree" and isinstance(tree, dict) and tree.get("src"):
        src = str(tree["src"])
        # Debian's source in the cache, or its variant tree: the series names it
        where = img.series if src.startswith(str(cache_dir() / "src") + "/") else shlex.quote(src)
        return " ".join(["kph image build --tree", where]
                        + [f"--patch {shlex.quote(str(p['file']))}"
                           for p in tree.get("patches", []) if p.get("file")])
    return f"kph image build --kernel {img.series}"


def _matrix() -> list[Check]:
    """The other kernels' images, and the private compiler their modules are built with."""
    out = []
    default = read_default()
    for img in built_images():
        if img.version == default:
            continue
        ok = image_is_current(img)
        out.append(Check(f"image {img.series}", ok,
                         f"{img.version} (module built with "
                         f"{img.manifest.get('module_toolchain', '?')})",
                         "" if ok else f"run `{rebuild_command(img)}`"))
    tree = tree_dir() / "tree"
    if tree.exists():
        out.append(Check("toolchain", True, f"{compiler_version(tree) or 'gcc'} for Debian 13 "
                         f"kernels in {tree} (a chroot: the host's gcc-12 cannot build them)"))
    return out


def run_checks() -> list[Check]:
    return [*_qemu(), _gdb(), _kvm(), *_tools(),
            Check("cache", True, str(cache_dir())), *_image(), *_matrix()]
