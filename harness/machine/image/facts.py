"""``KernelFacts``: what the host side knows about a kernel, all of it on the host's disk
before any probe is armed.

Why this exists (issue 13): the host side reads kernel facts inside probe handlers, and
a handler runs while the guest is stopped at a breakpoint. A fact fetched there through
the guest agent can never arrive: the agent lives in the stopped guest. The first
version harvested BTF lazily on first use, which deadlocked on every empty cache. So
facts are harvested while the guest runs, once per kernel build, and afterwards they
are plain files:

==================  ======================================  =================================
file                harvested from (guest)                  used for
==================  ======================================  =================================
kallsyms            /proc/kallsyms                          symbols (Debian's System.map is
                                                            a stub); needs ``nokaslr`` to
                                                            stay valid across boots
kprobes_blacklist   /sys/kernel/debug/kprobes/blacklist     register_kprobe's EINVAL rule
btf                 /sys/kernel/btf/vmlinux                 struct layouts (task_struct.pid,
                                                            comm, mm; mm_struct.exe_file ...)
modules             /proc/modules after boot                the modules the initramfs loaded
release             uname -r                                which kernel this is
config              the kernel package's config-<abi>       CONFIG_* (image builds only)
==================  ======================================  =================================

Where they live: an image's own directory (``kph image build`` harvests them on its
first boot and records each file's sha256 in ``manifest.json``), or, for a kernel booted
with ``--kernel`` and no image, ``$KPH_CACHE/kernels/<kernel sha256>-<initrd sha256>/``,
harvested by ``Machine.boot()`` before it returns (per boot, in the run directory, when
the kernel runs with KASLR: its addresses change every boot).

Every ``kph`` process parses kallsyms and BTF (0.3-0.6 s together); what the first one
made of a file is kept beside it (``.kallsyms.table.kept``, ``.btf.index.kept``:
:func:`_derived`) and read back by the next for the same file, out of the manifest.

Nothing in this module talks to a guest except ``harvest``, which takes the running
machine as an argument; everything else reads files.
"""
from __future__ import annotations

import functools
import gzip
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar

from ...errors import SetupError
from ...kernel.rules import rules_for, series_of_release
from ...kernel.symbols import ARCH, Blacklist, SymbolTable, load_kallsyms_cached
from ...kernel.btf import BTF
from ...kernel.grammar import KernelView

log = logging.getLogger(__name__)
T = TypeVar("T")

#: (file name, guest path) harvested from a running guest, in this order.
GUEST_FILES = (
    ("kallsyms", "/proc/kallsyms"),
    ("kprobes_blacklist", "/sys/kernel/debug/kprobes/blacklist"),
    ("btf", "/sys/kernel/btf/vmlinux"),
    ("modules", "/proc/modules"),
)
#: Files every complete set of facts has (``config`` only where a package gave one).
REQUIRED = ("kallsyms", "kprobes_blacklist", "btf", "modules", "release")
#: The file that says a directory holds a complete harvest (written last).
DONE = ".harvested"
#: The ending of what a process keeps of a facts file for the next one (:func:`_derived`)
KEPT = ".kept"


@dataclass(frozen=True)
class KernelFacts:
    """The facts of one kernel build, read from ``dir`` (parsed on first access, cached).

    ``kallsyms_file`` overrides ``dir/kallsyms`` (a KASLR boot harvests its own).
    """

    dir: Path
    kallsyms_file: Path | None = None

    # -- files ------------------------------------------------------------------------------
    @property
    def kallsyms_path(self) -> Path:
        return self.kallsyms_file or self.dir / "kallsyms"

    @property
    def blacklist_path(self) -> Path:
        return self.dir / "kprobes_blacklist"

    @property
    def btf_path(self) -> Path:
        return self.dir / "btf"

    def missing(self) -> list[str]:
        """The required files that are not there (empty: complete)."""
        have = {n for n in REQUIRED if (self.dir / n).is_file()}
        if self.kallsyms_file is not None and self.kallsyms_file.is_file():
            have.add("kallsyms")
        return [n for n in REQUIRED if n not in have]

    # -- parsed values --------------------------------------------------------------------
    @property
    def release(self) -> str:
        """``uname -r`` of the kernel."""
        return self._text("release").strip()

    @property
    def series(self) -> str:
        """``6.1``, ``6.12``, ``7.3``: the kernel series (``harness.kernel.rules``)."""
        return series_of_release(self.release)

    @functools.cached_property
    def rules(self) -> Any:
        """This kernel's probe-event rules (``harness.kernel.rules.KernelRules``)."""
        return rules_for(self.release, self.config)

    @functools.cached_property
    def symbols(self) -> Any:
        """The kernel's ``harness.kernel.symbols.SymbolTable`` (a copy per KernelFacts),
        parsed once per file and kept beside it (:func:`_derived`)."""
        p = Path(self.kallsyms_path).expanduser()
        try:
            st = p.resolve().stat()
        except OSError:
            return load_kallsyms_cached(p)      # its SetupError names the file
        return _load_symbols(str(p.resolve()), st.st_mtime_ns, st.st_size, st.st_ino).copy()

    @functools.cached_property
    def blacklist(self) -> Any:
        """The kprobe blacklist (``harness.kernel.symbols.Blacklist``)."""
        return Blacklist(self._text("kprobes_blacklist"))

    @functools.cached_property
    def btf(self) -> Any:
        """The kernel's BTF (``harness.kernel.btf.BTF``): struct member offsets. One
        parsed table per file and process (~1-1.5 s to parse 6.1's or 6.12's ~100,000
        types), shared read-only by every machine of the kernel, as kallsyms are."""
        p = self.dir / "btf"
        try:
            st = p.stat()
        except OSError as exc:
            raise SetupError(f"kernel facts incomplete: cannot read {p} ({exc.strerror})",
                             "rebuild the image (`kph image build --force`)") from exc
        return _load_btf(str(p.resolve()), st.st_mtime_ns, st.st_size, st.st_ino)

    @functools.cached_property
    def modules(self) -> tuple[str, ...]:
        """Names of the modules loaded when the facts were harvested (``/proc/modules``)."""
        return tuple(line.split()[0] for line in self._text("modules").splitlines() if line.strip())

    @functools.cached_property
    def config(self) -> dict[str, str]:
        """``CONFIG_*`` -> value (``y``, ``m``, a number or a quoted string); empty when the
        facts come from a kernel without its package's config file."""
        p = self.dir / "config"
        if not p.is_file():
            return {}
        out = {}
        for line in p.read_text(errors="replace").splitlines():
            if line.startswith("CONFIG_") and "=" in line:
                k, v = line.split("=", 1)
                out[k] = v
        return out

    def _bytes(self, name: str) -> bytes:
        p = self.dir / name
        try:
            return p.read_bytes()
        except OSError as exc:
            raise SetupError(f"kernel facts incomplete: cannot read {p} ({exc.strerror})",
                             "rebuild the image (`kph image build --force`)") from exc

    def _text(self, name: str) -> str:
        return self._bytes(name).decode("utf-8", "replace")


def _derived(path: Path, kind: str, stamp: tuple[int, ...], build: Callable[[], T],
             load: Callable[[bytes], T | None], dump: Callable[[T], bytes]) -> T:
    """What ``build`` makes of the facts file ``path`` (parsed, indexed), kept beside it in
    ``.NAME.KIND.kept`` for the next process (never part of an image's manifest): every
    ``kph`` process parses kallsyms and BTF, 0.3-0.6 s a process that a kept copy cuts by
    half or more. The copy is read back only for the same file (``stamp``: its mtime,
    size and inode), format (``load`` gives None for another one) and Python (marshal's
    format is Python's); anything else, or a copy that cannot be read or written, is
    built again and kept anew, never an error."""
    keep = path.with_name(f".{path.name}.{kind}{KEPT}")
    head = f"kph {kind} {importlib.util.MAGIC_NUMBER.hex()} {' '.join(map(str, stamp))}\n".encode()
    try:
        data = keep.read_bytes()
    except OSError:
        data = b""
    if data.startswith(head):
        got = load(data[len(head):])
        if got is not None:
            return got
    value = build()
    # per thread: a machine loads its facts in a thread beside its start (vmctl)
    tmp = keep.with_name(f"{keep.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_bytes(head + dump(value))
        os.replace(tmp, keep)
    except (OSError, ValueError) as exc:
        log.debug("%s: not kept (%s)", keep, exc)
        tmp.unlink(missing_ok=True)
    return value


@functools.lru_cache(maxsize=4)
def _load_btf(path: str, mtime_ns: int, size: int, ino: int) -> BTF:
    def build() -> BTF:
        b = BTF(Path(path).read_bytes())
        b.index_bytes()             # the type table, worked out now to be kept
        return b
    def load(idx: bytes) -> BTF | None:
        b = BTF(Path(path).read_bytes(), idx)
        return b if b.indexed else None
    return _derived(Path(path), "index", (mtime_ns, size, ino), build, load, BTF.index_bytes)


@functools.lru_cache(maxsize=4)
def _load_symbols(path: str, mtime_ns: int, size: int, ino: int) -> SymbolTable:
    return _derived(Path(path), "table", (mtime_ns, size, ino),
                    lambda: load_kallsyms_cached(path), SymbolTable.from_bytes,
                    SymbolTable.to_bytes)


def kernel_view(facts: KernelFacts, symbols: Any = None, *, read: Any = None,
                loaded: Any = None, btf: bool = True) -> Any:
    """The :class:`harness.kernel.grammar.KernelView` of a kernel: its rules, BTF and symbols
    (``symbols``, default the facts' own; module symbols of the running guest when the
    caller merged them), ``read(addr, n)`` for kernel text (to find an ENDBR at a function
    start; without it ``SYM+4`` on an IBT kernel is taken for an entry), ``loaded(mod)``
    whether a module is loaded (default: the modules the facts were harvested with).
    ``btf=False`` parses BTF variables into placeholders."""
    syms = symbols if symbols is not None else facts.symbols
    rules = facts.rules
    ibt = facts.config.get("CONFIG_X86_KERNEL_IBT") == "y"

    def on_func_entry(name: str, offset: int) -> bool | None:
        # _kprobe_addr(): the symbol holding SYM+OFFS, then arch_adjust_kprobe_addr()
        sym = syms.get(name)
        hit = syms.symbolize(sym.addr + offset) if sym is not None else None
        if hit is None:
            return None
        base, off = hit[0].addr, hit[1]
        if off not in (0, 4) or not ibt:
            return off == 0
        if read is None:
            return True
        try:
            return ARCH.adjust_kprobe_addr(base, off, read(base, 4))[1]
        except Exception:  # noqa: BLE001 - unreadable: copy_from_kernel_nofault() fails
            return None

    def count_symbol(name: str) -> int:
        # number_of_same_symbols(NULL, name); 7.3 stops at vmlinux when it has the name
        core = syms.count_in(name, None)
        if rules.symbols_vmlinux_first and core:
            return core
        return syms.count(name)

    mods = loaded if loaded is not None else (lambda m: m in facts.modules)

    def module_count(mod: str, name: str) -> int | None:
        return syms.count_in(name, mod) if mods(mod) else None

    b = facts.btf if btf and rules.btf_args else None
    @functools.lru_cache(maxsize=None)
    def dentry() -> tuple[int, int] | None:
        if not rules.dentry_types:
            return None
        try:
            return (facts.btf.offset("dentry", "d_name.name"),
                    facts.btf.offset("file", "f_path.dentry"))
        except KeyError:
            return None
    return KernelView(rules, b, on_func_entry, count_symbol, module_count, dentry)


def percpu_offset(symbols: Any, btf: Any, var: str, hot: str | None = None) -> int | None:
    """The per-cpu offset of the value ``this_cpu_read(var)`` reads: the per-cpu variable
    ``var`` itself, or, where the kernel has none, member ``hot`` of the per-cpu ``struct
    pcpu_hot`` (6.2 to 6.14 gathered the hottest there: arch/x86/include/asm/current.h;
    ``current_task``, ``preempt_count``, ``hardirq_stack_ptr``). Decided by what the
    kernel has, not by its version number; None with neither."""
    sym = symbols.get(var)
    if sym is not None:
        return int(sym.addr)
    pcpu = symbols.get("pcpu_hot")
    if pcpu is None or hot is None:
        return None
    try:
        return int(pcpu.addr) + int(btf.offset("pcpu_hot", hot))
    except (KeyError, ValueError, AttributeError):
        return None


def percpu_current_task(symbols: Any, btf: Any) -> int | None:
    """The per-cpu offset of ``current`` (``get_current()``, arch/x86/include/asm/
    current.h). 6.1 and 7.3: the per-cpu variable ``current_task``; 6.2 to 6.14 (6.12
    here): the ``current_task`` member of the per-cpu ``struct pcpu_hot``."""
    return percpu_offset(symbols, btf, "current_task", "current_task")


def uaccess_offsets(symbols: Any, btf: Any) -> tuple[int, int] | None:
    """What ``nmi_uaccess_okay()`` compares (arch/x86/mm/tlb.c, 6.12 and 7.3; the 6.1
    guest refuses alike): ``current->mm`` against the per-cpu
    ``cpu_tlbstate.loaded_mm``, the page tables the CPU runs on. As
    (``task_struct.mm``'s offset, ``cpu_tlbstate.loaded_mm``'s per-cpu offset); None
    when the kernel has neither the symbol nor the BTF to place them."""
    sym = symbols.get("cpu_tlbstate")
    if sym is None or btf is None:
        return None
    try:
        return int(btf.offset("task_struct", "mm")), \
            int(sym.addr) + int(btf.offset("tlb_state", "loaded_mm"))
    except (KeyError, ValueError, AttributeError):
        return None


def percpu_preempt_count(symbols: Any, btf: Any) -> int | None:
    """The per-cpu offset of ``preempt_count()`` (arch/x86/include/asm/preempt.h): the
    per-cpu ``__preempt_count`` (6.1, 7.3), ``pcpu_hot.preempt_count`` (6.2 to 6.14)."""
    return percpu_offset(symbols, btf, "__preempt_count", "preempt_count")


def harvest(vm: Any, dest: Path, *, only: tuple[str, ...] | None = None) -> None:
    """Copy the facts of the running guest ``vm`` (a ``Machine``) into ``dest``.

    Every file is written under a temporary name and renamed, then ``DONE`` last, so a
    concurrent reader never sees half a harvest. ``only`` restricts it to some files.

    :raise GuestExecError: a guest file could not be read (e.g. no BTF in this kernel).
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name, guest_path in GUEST_FILES:
        if only is not None and name not in only:
            continue
        data = gzip.decompress(vm.run(f"gzip -c {guest_path}", check=True, timeout=120).out)
        write_whole(dest / name, data)
    if only is None or "release" in only:
        write_whole(dest / "release", vm.run("uname -r", check=True).out)
    if only is None:
        write_whole(dest / DONE, b"")


def write_whole(path: Path, data: bytes) -> None:
    """``data`` into ``path`` whole or not at all: written beside it, then renamed (a
    reader, or a concurrent writer of the same content, never sees a torn file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.rename(path)


def is_harvested(d: Path) -> bool:
    return (d / DONE).exists() and not KernelFacts(d).missing()
