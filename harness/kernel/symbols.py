"""Kernel symbols, and the kernel's rules for where a kprobe may go.

Models Linux 6.1: ``kernel/kallsyms.c`` (``kallsyms_lookup_size_offset()``, ``%pS``),
``kernel/kprobes.c`` (``register_kprobe()``, ``_kprobe_addr()``, ``kprobe_on_func_entry()``,
``check_kprobe_address_safe()``, ``within_kprobe_blacklist()``) and
``arch/x86/kernel/kprobes/core.c`` (``arch_adjust_kprobe_addr()``, ``can_probe()``,
``__copy_instruction()``). Nothing here talks to a VM: what needs guest memory takes a
``read(addr, n) -> bytes`` callable, so the same rules run on hand-assembled test bytes.

At ~770 lines this is past the usual size: the symbol table and the probe rules share the
kallsyms size rule and are one concept, and much of the length is kernel citations.
"""
from __future__ import annotations

import bisect
import difflib
import errno
import functools
import logging
import marshal
import os
import re
import struct
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ProbeRejectedError, ProbeSpecError, SetupError, SymbolNotFoundError
from .emulate import modrm_len

if TYPE_CHECKING:
    import capstone

log = logging.getLogger(__name__)

__all__ = ["SymbolTable", "Symbol", "Blacklist", "check_probe_address", "kprobe_addr",
           "instruction_at", "Insn", "load_kallsyms_cached", "Arch", "X86_64", "ARCH"]

#: ``read(addr, n)``: ``n`` bytes of guest memory at ``addr``.
ReadFn = Callable[[int, int], bytes]
#: ``recover(addr)``: the original bytes under an INT3 planted at ``addr``, or None.
RecoverFn = Callable[[int], "bytes | None"]

#: can_probe() decodes from the symbol start. Past this many bytes we give up rather than
#: read megabytes of a marker "symbol" like ``srso_alias_safe_ret`` (1 MiB to the next
#: symbol); the largest real function in a 6.1 kernel is ~13 KiB.
MAX_FUNC_PREFIX = 64 * 1024

_TEXT_TYPES = frozenset("tTwW")
# kallsyms lists these under a "[module]", but they are no module's text, so kprobes
# refuse them: Linux kernel commit 28f6c37a2910 ("kprobes: Forbid probing on trampoline
# and BPF code areas") (in v6.0).
_PSEUDO_MODULES = frozenset({"bpf", "__builtin__ftrace", "__builtin__kprobes"})


class Arch:
    """Facts about one architecture that the probe rules need."""

    name = "generic"
    breakpoint = b""
    max_insn_len = 0
    hw_breakpoints = 0

    def adjust_kprobe_addr(self, sym_addr: int, offset: int, entry: bytes) -> tuple[int, bool]:
        """``(addr, on_func_entry)`` for ``sym_addr+offset``, as the ``__weak``
        ``arch_adjust_kprobe_addr()``: no move, entry iff offset 0. ``entry`` holds the
        function's first bytes."""
        return sym_addr + offset, offset == 0


class X86_64(Arch):
    """x86_64: INT3, the 5-byte ftrace NOP, ENDBR on IBT kernels, 15-byte instructions."""

    name = "x86_64"
    breakpoint = b"\xcc"                             # INT3_INSN_OPCODE
    nop5 = bytes.fromhex("0f1f440000")               # x86_nops[5], at each __fentry__ site
    endbr64 = bytes.fromhex("f30f1efa")
    endbr32 = bytes.fromhex("f30f1efb")
    #: gen_endbr_poison() (arch/x86/include/asm/ibt.h): what apply_seal_endbr() writes
    #: over an ENDBR nobody calls indirectly, and what is_endbr() still takes for one.
    #: 6.12: 0x001f0f66, "osp nopl (%rax)"; 7.3: 0xd6401f0f, "nopl -42(%rax)" (a NOP that
    #: carries UDB as its immediate). Only the running kernel's own appears in its text.
    endbr_poisons = (bytes.fromhex("660f1f00"), bytes.fromhex("0f1f40d6"))
    emulate_prefixes = (bytes.fromhex("0f0b78656e"), bytes.fromhex("0f0b6b766d"))  # ud2 "xen"/"kvm"
    max_insn_len = 15                                # MAX_INSN_SIZE
    hw_breakpoints = 4                               # DR0..DR3

    def adjust_kprobe_addr(self, sym_addr: int, offset: int, entry: bytes) -> tuple[int, bool]:
        """On IBT kernels a function starts with ENDBR; +0 and +4 both mean entry and the
        probe goes to +4. Checked on the bytes, not the config: without
        ``CONFIG_X86_KERNEL_IBT`` the kernel builds with ``-fcf-protection=none`` and has
        no ENDBR to find. Linux kernel commit cc66bb914578 ("x86/ibt,kprobes: Cure sym+0
        equals fentry woes") (in v5.19)."""
        if entry[:4] in (self.endbr64, self.endbr32, *self.endbr_poisons):
            on_entry = offset in (0, 4)
            return sym_addr + (4 if on_entry else offset), on_entry
        return sym_addr + offset, offset == 0


ARCH = X86_64()


@dataclass(frozen=True, slots=True)
class Symbol:
    """One kallsyms entry. ``size`` is the ELF ``st_size`` when read from a vmlinux that
    has one, else the kallsyms rule: distance to the next higher symbol (0 if unknown)."""

    name: str
    addr: int
    type: str                 # kallsyms letter: t/T text, d/D data, r/R rodata, b/B bss, A
    module: str | None = None
    size: int = 0

    @property
    def is_text(self) -> bool:
        return self.type in _TEXT_TYPES

    def __str__(self) -> str:
        return f"{self.name} [{self.module}]" if self.module else self.name


# (addr, order, name, type, module, elf_size); ``order`` ranks aliases (same address) as
# scripts/kallsyms does, so symbolize() picks the name the kernel prints.
_Row = tuple[int, int, str, str, "str | None", int]


class SymbolTable:
    """Kernel and module symbols, by name and by address.

    Held as columns and turned into ``Symbol`` objects on access: building 88k frozen
    dataclasses would cost more than parsing kallsyms.
    """

    def __init__(self, rows: Iterable[_Row] = ()) -> None:
        self._rows = list(rows)
        self._sections: dict[str, dict[str, int]] = {}
        self._rebuild()

    @classmethod
    def from_kallsyms(cls, text_or_path: str | os.PathLike[str]) -> SymbolTable:
        """Parse ``/proc/kallsyms`` (``ffffffff8134a350 t do_sys_openat2``, and for modules
        ``...\\t[mymod]``). A ``str`` with a space or newline is text, else a path.

        :raise SetupError: unreadable, malformed, or all addresses zero (``kptr_restrict``).
        """
        text, source = _text_or_file(text_or_path, "kallsyms")
        return cls(_parse_kallsyms(text, source))

    @classmethod
    def from_vmlinux(cls, path: str | os.PathLike[str]) -> SymbolTable:
        """The FUNC/OBJECT/NOTYPE symbols of an ELF64 LE ``.symtab``, lettered like nm.
        As ``scripts/kallsyms`` does, per-cpu symbols become ``A``, absolute ones are
        dropped, and aliases rank non-weak first, then by fewer leading underscores.

        :raise SetupError: not an ELF64 little-endian file with a ``.symtab``.
        """
        return cls(_parse_elf(Path(path)))

    def add_module(self, name: str, text: str) -> None:
        """Merge, or replace, module ``name``'s kallsyms lines (after it loads in the guest)."""
        self.modules_key = None
        base = max((r[1] for r in self._rows), default=-1) + 1
        new = [(a, base + o, n, t, name, s)
               for a, o, n, t, _, s in _parse_kallsyms(text, f"module {name}", name)]
        self._rows = [r for r in self._rows if r[4] != name] + new
        self._rebuild()

    #: what the last ``set_modules`` was given (its ``key``); any other change of the
    #: modules clears it
    modules_key: object = None

    def set_modules(self, texts: dict[str, str], sections: dict[str, dict[str, int]],
                    key: object = None) -> None:
        """Merge, or replace, several modules' kallsyms lines and section bases at once:
        ``add_module`` and ``add_module_sections`` for each, with one index rebuild (a
        rebuild sorts every symbol: ~0.5 s for a Debian kernel's ~160,000). ``key``
        names this state (``modules_key``), so a caller can tell it is already merged."""
        self.modules_key = key
        if not texts and not sections:
            return
        base = max((r[1] for r in self._rows), default=-1) + 1
        new: list[_Row] = []
        for name, text in texts.items():
            rows = _parse_kallsyms(text, f"module {name}", name)
            new += [(a, base + len(new) + o, n, t, name, sz) for a, o, n, t, _, sz in rows]
        self._rows = [r for r in self._rows if r[4] not in texts] + new
        self._sections = {**self._sections, **{k: dict(v) for k, v in sections.items()}}
        self._rebuild()

    def drop_module(self, name: str) -> None:
        """Forget module ``name`` (it is no longer loaded in the guest)."""
        if any(r[4] == name for r in self._rows):
            self.modules_key = None
            self._rows = [r for r in self._rows if r[4] != name]
            self._sections = {k: v for k, v in self._sections.items() if k != name}
            self._rebuild()

    def add_module_sections(self, name: str, sections: dict[str, int]) -> None:
        """Record ``/sys/module/NAME/sections/*`` bases; a module symbol then ends at the
        next section at the latest, as ``find_kallsyms_symbol()`` ends at the text's end."""
        self.modules_key = None
        self._sections = {**self._sections, name: dict(sections)}
        self._rebuild()

    @property
    def _rows(self) -> list[_Row]:
        """The rows the index was built from, which only a merge of modules needs: a
        table read back (:meth:`from_bytes`) makes them again from its columns when
        first asked (reading them back was 60 of the ~95 ms of reading a Debian kernel's
        table, in every ``kph`` process)."""
        rows = self.__dict__.get("_row_list")
        if rows is None:
            rows = self._row_list = list(zip(self._addrs, self._orders, self._names,
                                             self._types, self._mods, self._size0))
        return rows

    @_rows.setter
    def _rows(self, rows: list[_Row]) -> None:
        self._row_list = rows

    #: the layout of :meth:`to_bytes`; another one is not read back
    STATE_FORMAT = 2

    def to_bytes(self) -> bytes:
        """The table, parsed and indexed, as bytes :meth:`from_bytes` reads back (a cache
        on disk: reading them takes about a fifth of parsing kallsyms and indexing them);
        the rows left out (:attr:`_rows`).

        :raise ValueError: the table holds something marshal cannot write."""
        state = dict(self.__dict__, _counts=None, _counts_by=None, _count_asks=0)
        state.pop("_row_list", None)
        return marshal.dumps((self.STATE_FORMAT, state))

    @classmethod
    def from_bytes(cls, data: bytes) -> SymbolTable | None:
        """A table :meth:`to_bytes` wrote; None when ``data`` is not one of this layout."""
        try:
            fmt, state = marshal.loads(data)
        except (ValueError, EOFError, TypeError):
            return None
        if fmt != cls.STATE_FORMAT or not isinstance(state, dict) \
                or not {"_by_name", "_orders", "_size0"} <= state.keys():
            return None
        new = cls.__new__(cls)
        new.__dict__.update(state)
        return new

    def copy(self) -> SymbolTable:
        new = SymbolTable.__new__(SymbolTable)
        new.__dict__.update(self.__dict__)   # safe: indexes are replaced, never mutated
        return new

    #: how many times this table's index was built: a reader that worked from the table
    #: (``harness.backends.plugin``'s decoding while a workload runs) tells by it whether
    #: what it read still holds
    generation = 0

    def _rebuild(self) -> None:
        self.generation += 1
        rows = sorted(self._rows)
        keep = [r for r in rows if r[3] not in "aA"]   # per-cpu offsets are not addresses
        spans = self._spans_of(keep)
        table = keep + [r for r in rows if r[3] in "aA"]
        self._n_addr = len(keep)                       # bisect covers table[:_n_addr]
        self._addrs = [r[0] for r in table]
        self._names = [r[2] for r in table]
        self._types = [r[3] for r in table]
        self._mods = [r[4] for r in table]
        self._orders = [r[1] for r in table]       # with the other columns, the rows
        self._size0 = [r[5] for r in table]
        self._spans = spans
        self._sizes = [r[5] or sp for r, sp in zip(keep, spans)] + [r[5] for r in table[len(keep):]]
        by_name: dict[str, int] = {}
        by_mod: dict[tuple[str, str], int] = {}
        for i, name in enumerate(self._names):         # ascending address: first seen wins
            j = by_name.setdefault(name, i)
            if j != i and self._rank(i) < self._rank(j):
                by_name[name] = i
            if self._mods[i] is not None:
                j = by_mod.setdefault((self._mods[i], name), i)
                if j != i and self._rank(i) < self._rank(j):
                    by_mod[(self._mods[i], name)] = i
        self._by_name, self._by_mod = by_name, by_mod
        self._counts: dict[str, int] | None = None
        self._counts_by: dict[tuple[str | None, str], int] | None = None
        self._count_asks = 0
        self._modules = frozenset(m for m in self._mods if m is not None)
        stext, etext = by_name.get("_stext"), by_name.get("_etext")
        self._text_range = (None if stext is None or etext is None
                            else (self._addrs[stext], self._addrs[etext]))

    def _spans_of(self, keep: list[_Row]) -> list[int]:
        # kallsyms_lookup_size_offset(): up to the next higher address of the same owner
        # (core, or one module), capped by the module's next section; else the ELF size.
        # (one pass from the top, no list per symbol: every kph process builds the table)
        n = len(keep)
        spans, nxt, sections = [0] * n, None, self._sections
        for k in range(n - 1, -1, -1):
            row = keep[k]
            addr, owner = row[0], row[4]
            if k + 1 < n and keep[k + 1][0] != addr:
                nxt = keep[k + 1]
            end = nxt[0] if nxt is not None and nxt[4] == owner else None
            bases = sections.get(owner or "")
            if bases:
                for b in bases.values():
                    if b > addr and (end is None or b < end):
                        end = b
            spans[k] = end - addr if end is not None else row[5]
        return spans

    def _rank(self, i: int) -> tuple[bool, bool]:
        # kallsyms_lookup_name() searches the core before modules; then prefer text.
        return (self._mods[i] is not None, self._types[i] not in _TEXT_TYPES)

    def _sym(self, i: int) -> Symbol:
        return Symbol(self._names[i], self._addrs[i], self._types[i], self._mods[i],
                      self._sizes[i])

    def lookup(self, name: str) -> Symbol:
        """The symbol ``name`` or ``MOD:name``. A name defined several times (static
        functions) gives the core kernel's before a module's, text before data, then the
        lowest address.

        :raise SymbolNotFoundError: with close matches in ``.hint``.
        """
        mod, sep, sym = name.rpartition(":")
        i = self._by_mod.get((mod, sym)) if sep else self._by_name.get(name)
        if i is None:
            raise SymbolNotFoundError(
                name, hint=lambda: self._suggest(sym, mod if sep else None))
        return self._sym(i)

    def count(self, name: str) -> int:
        """How many entries are called ``name`` (core and modules), as 6.1's
        ``number_of_same_symbols()`` counts them for an unqualified kprobe target."""
        if self._counts is None:
            self._count_asks += 1
            if self._count_asks <= _SCANS:
                return self._names.count(name)
            self._counts = Counter(self._names)
        return self._counts.get(name, 0)

    def count_in(self, name: str, module: str | None) -> int:
        """How many entries ``name`` has in vmlinux (``module`` None) or in one module:
        ``kallsyms_on_each_match_symbol()`` / ``module_kallsyms_on_each_symbol(mod)``."""
        if self._counts_by is None:
            self._count_asks += 1
            if self._count_asks <= _SCANS:
                names, mods, n, i = self._names, self._mods, 0, -1
                while True:             # each entry of that name, found in C
                    try:
                        i = names.index(name, i + 1)
                    except ValueError:
                        return n
                    n += mods[i] == module
            self._counts_by = Counter(zip(self._mods, self._names))
        return self._counts_by.get((module, name), 0)

    def modules(self) -> frozenset[str]:
        """The modules this table has symbols of."""
        return self._modules

    def get(self, name: str) -> Symbol | None:
        """Like ``lookup`` but None when absent, without computing suggestions (which
        scans every name): for symbols a kernel may or may not have."""
        mod, sep, sym = name.rpartition(":")
        i = self._by_mod.get((mod, sym)) if sep else self._by_name.get(name)
        return None if i is None else self._sym(i)

    def resolve(self, spec: str) -> int:
        """The address of ``sym``, ``sym+0x10``, ``sym+16``, ``MOD:sym+off`` or ``0xADDR``.
        Offsets parse like ``kstrtoul(s, 0)``: ``0x`` is hex, a leading 0 octal.

        :raise ProbeSpecError: when ``spec`` has none of these forms.
        :raise SymbolNotFoundError: when the symbol is unknown.
        """
        s = spec.strip()
        if _HEX_ADDR.fullmatch(s):
            return int(s, 16)
        m = _SYM_SPEC.fullmatch(s)
        if m is None:
            raise ProbeSpecError(f"not SYM, SYM+OFFS, MOD:SYM+OFFS or 0xADDR: {spec!r}", spec)
        addr = self.lookup(m["sym"]).addr
        try:
            return addr + (_kstrtoul(m["off"]) if m["off"] else 0)
        except ValueError:
            raise ProbeSpecError(f"bad offset {m['off']!r} in {spec!r}", spec,
                                 spec.index("+") + 1) from None

    def _suggest(self, name: str, module: str | None) -> str:
        if module is not None and module not in self._modules:
            return f"module {module!r} is not loaded here; after loading it, call add_module()"
        names = ([n for m, n in self._by_mod if m == module] if module is not None
                 else list(self._by_name))
        low = name.lower()
        near = sorted((n for n in names if low in n.lower()), key=len)[:3] if low else []
        near += [n for n in difflib.get_close_matches(name, names, 3, 0.75) if n not in near]
        if not near:
            return "no similar names; check the kernel version and the loaded modules"
        return "did you mean " + ", ".join(
            f"{module}:{n}" if module else str(self._sym(self._by_name[n])) for n in near) + "?"

    def _find(self, addr: int) -> int | None:
        i = bisect.bisect_right(self._addrs, addr, 0, self._n_addr) - 1
        if i < 0:
            return None
        i = bisect.bisect_left(self._addrs, self._addrs[i], 0, i)    # the first alias
        off = addr - self._addrs[i]
        return i if off == 0 or off < self._spans[i] else None

    def symbolize(self, addr: int) -> tuple[Symbol, int] | None:
        """``(symbol, offset)`` of the symbol holding ``addr``, found as
        ``kallsyms_lookup_size_offset()`` finds it; None outside every symbol."""
        i = self._find(addr)
        return None if i is None else (self._sym(i), addr - self._addrs[i])

    def frame_name(self, addr: int) -> str:
        """A stack frame's return address as a trace's ``=>`` line names it (``%ps``): the
        function holding it, or ``0x...``. A return address lies in code: a data symbol
        found for it is this table's guess past the end of a module's memory (kallsyms
        has no sizes; the kernel's ``module_address_lookup()`` checks the module's
        bounds and finds nothing), where ftrace puts an ops' trampoline: no name."""
        hit = self.symbolize(addr)
        return hit[0].name if hit is not None and hit[0].is_text else f"0x{addr:x}"

    def format(self, addr: int) -> str:
        """``addr`` as ``%pS`` prints it: ``do_sys_openat2+0x5/0x140``, ``foo+0x0/0x20
        [mymod]``, or ``0xffffffff81000000`` when no symbol holds it."""
        i = self._find(addr)
        if i is None:
            return f"0x{addr:x}"
        text = f"{self._names[i]}+0x{addr - self._addrs[i]:x}/0x{self._spans[i]:x}"
        return f"{text} [{self._mods[i]}]" if self._mods[i] else text

    def is_text(self, addr: int) -> bool:
        """Text a kprobe may go in (``check_kprobe_address_safe()``): ``core_kernel_text()``,
        i.e. ``_stext <= addr < _etext`` (init text is freed after boot), or module text,
        here a module's text symbol. Without ``_stext``/``_etext``, core text symbols."""
        i = self._find(addr)
        if i is None:
            return False
        mod, text = self._mods[i], self._types[i] in _TEXT_TYPES
        if mod is not None:
            return text and mod not in _PSEUDO_MODULES
        if self._text_range is not None:
            return self._text_range[0] <= addr < self._text_range[1]
        return text

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self) -> Iterator[Symbol]:   # by address, then the per-cpu (A) ones
        return (self._sym(i) for i in range(len(self._names)))


_HEX_ADDR = re.compile(r"0[xX][0-9a-fA-F]+")
_SYM_SPEC = re.compile(r"(?P<sym>(?:[\w.-]+:)?[^\s:+]+)(?:\+(?P<off>\w+))?")


def _kstrtoul(s: str) -> int:
    if s[:2].lower() == "0x":
        return int(s[2:], 16)
    return int(s, 8) if len(s) > 1 and s[0] == "0" else int(s, 10)


def _text_or_file(text_or_path: str | os.PathLike[str], what: str) -> tuple[str, str]:
    if isinstance(text_or_path, str) and (not text_or_path or " " in text_or_path
                                          or "\n" in text_or_path):
        return text_or_path, f"<{what} text>"
    path = Path(text_or_path)
    try:
        return path.read_text(), str(path)
    except OSError as exc:
        raise SetupError(f"cannot read {what} {path}: {exc.strerror}",
                         hint="copy it from the guest as root") from exc


def _parse_kallsyms(text: str, source: str, module: str | None = None) -> list[_Row]:
    rows: list[_Row] = []
    append = rows.append
    for lineno, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            mod = parts[3][1:-1] if len(parts) > 3 else module
            append((int(parts[0], 16), lineno, parts[2], parts[1], mod, 0))
        except (ValueError, IndexError):
            raise SetupError(f"{source}:{lineno}: not a kallsyms line: {line!r}",
                             hint="expected 'ADDR TYPE NAME [MODULE]'") from None
    if rows and not any(r[0] for r in rows):
        raise SetupError(f"{source}: every kallsyms address is zero",
                         hint="read /proc/kallsyms as root, or set kernel.kptr_restrict=0")
    log.debug("parsed %d kallsyms lines from %s", len(rows), source)
    return rows


def _parse_elf(path: Path) -> list[_Row]:
    from elftools.common.exceptions import ELFError
    from elftools.elf.constants import SH_FLAGS
    from elftools.elf.elffile import ELFFile

    letters: list[str | None] = []      # per section index; None: not loaded, skip
    try:
        with path.open("rb") as f:
            elf = ELFFile(f)
            symtab = elf.get_section_by_name(".symtab")
            if elf.elfclass != 64 or not elf.little_endian or symtab is None:
                raise SetupError(f"{path}: not an ELF64 little-endian file with a .symtab",
                                 hint="pass an unstripped x86_64 vmlinux")
            strtab, data = elf.get_section(symtab["sh_link"]).data(), symtab.data()
            for sec in elf.iter_sections():
                flags = sec["sh_flags"]
                letters.append(None if not flags & SH_FLAGS.SHF_ALLOC
                               else "A" if sec.name == ".data..percpu"
                               else "t" if flags & SH_FLAGS.SHF_EXECINSTR
                               else "b" if sec["sh_type"] == "SHT_NOBITS"
                               else "d" if flags & SH_FLAGS.SHF_WRITE else "r")
    except (OSError, ELFError) as exc:
        raise SetupError(f"cannot read ELF symbols from {path}: {exc}",
                         hint="pass the vmlinux built with this kernel") from exc
    rows: list[_Row] = []
    # Elf64_Sym, unpacked directly: pyelftools' iter_symbols() takes ~10 us a symbol.
    for i, (name_off, info, _, shndx, value, size) in enumerate(
            struct.iter_unpack("<IBBHQQ", data)):
        bind, typ = info >> 4, info & 0xF
        letter = letters[shndx] if 0 < shndx < len(letters) else None  # no UNDEF/ABS/COMMON
        if typ > 2 or not name_off or letter is None:                   # NOTYPE/OBJECT/FUNC
            continue
        name = strtab[name_off:strtab.index(b"\0", name_off)].decode(errors="replace")
        if name.startswith((".L", "$")):
            continue
        if bind == 2:
            letter = "W" if letter == "t" else "V"
        elif bind == 1:
            letter = letter.upper()
        order = ((bind == 2) << 40) | ((len(name) - len(name.lstrip("_"))) << 32) | i
        rows.append((value, order, name, letter, None, size))
    log.debug("read %d ELF symbols from %s", len(rows), path)
    return rows


#: Symbol counts a table answers by scanning its names (~2 ms each on 7.3's ~200,000)
#: before it counts every name at once (~40 ms): a process that parses a line or two asks
#: two or three times, a script of 1,000 lines 2,000 times
_SCANS = 16


def remembered_symbolizer(table: SymbolTable) -> Callable[[int], str | None]:
    """``%pS`` of an address (``table.format``), or None where the table has no symbol
    for it; each answer remembered. For one collect of hits: the probed addresses come
    back at every hit, and the table does not change under it."""
    seen: dict[int, str | None] = {}

    def symbolize(addr: int) -> str | None:
        if addr not in seen:
            seen[addr] = table.format(addr) if table.symbolize(addr) is not None else None
        return seen[addr]
    return symbolize


def load_kallsyms_cached(path: str | os.PathLike[str]) -> SymbolTable:
    """``SymbolTable.from_kallsyms(path)``, parsed once per (path, mtime); each caller
    gets its own copy, so one's ``add_module()`` never shows up in another's."""
    p = Path(path).expanduser().resolve()
    try:
        mtime = p.stat().st_mtime_ns
    except OSError as exc:
        raise SetupError(f"cannot read kallsyms {p}: {exc.strerror}",
                         hint="copy /proc/kallsyms from the guest as root") from exc
    return _load_kallsyms(str(p), mtime).copy()


@functools.lru_cache(maxsize=8)
def _load_kallsyms(path: str, mtime_ns: int) -> SymbolTable:
    return SymbolTable.from_kallsyms(Path(path))


class Blacklist:
    """``/sys/kernel/debug/kprobes/blacklist``: half-open ranges the kernel refuses, one
    ``0xffffffff81001230-0xffffffff81001250\\tsome_func`` a line (`` [mod]`` may follow).
    Ranges repeat or overlap (a NOKPROBE_SYMBOL inside a blacklisted section)."""

    def __init__(self, text: str = "") -> None:
        entries = []
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            m = _BLACKLIST_LINE.match(line)
            if m is None:
                raise SetupError(f"kprobes blacklist line {lineno}: {line!r}",
                                 hint="expected '0xSTART-0xEND\\tNAME [MOD]'")
            entries.append((int(m[1], 16), int(m[2], 16), m[3]))
        if entries and not any(end for _, end, _ in entries):
            raise SetupError("every kprobes blacklist address is zero",
                             hint="read /sys/kernel/debug/kprobes/blacklist as root")
        entries.sort()
        self.entries: tuple[tuple[int, int, str], ...] = tuple(entries)
        self._starts = [e[0] for e in entries]
        self._max_end: list[int] = []       # max end over entries[:i+1]: walk back over overlaps
        for _, end, _ in entries:
            self._max_end.append(max(end, self._max_end[-1] if self._max_end else 0))

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Blacklist:
        return cls(_text_or_file(Path(path), "kprobes blacklist")[0])

    def find(self, addr: int) -> str | None:
        """The blacklisted function whose range holds ``addr``, or None."""
        i = bisect.bisect_right(self._starts, addr) - 1
        while i >= 0 and self._max_end[i] > addr:
            if self.entries[i][1] > addr:
                return self.entries[i][2]
            i -= 1
        return None

    def __len__(self) -> int:
        return len(self.entries)


_BLACKLIST_LINE = re.compile(r"0x([0-9a-fA-F]+)-0x([0-9a-fA-F]+)\s+(\S+)")


@dataclass(frozen=True, slots=True)
class Insn:
    """One decoded instruction, in capstone's Intel syntax."""

    addr: int
    size: int
    mnemonic: str
    op_str: str
    bytes: bytes

    def __str__(self) -> str:
        return f"{self.mnemonic} {self.op_str}".strip()


@functools.cache
def _capstone() -> capstone.Cs:   # imported on first use, like pyelftools
    import capstone

    return capstone.Cs(capstone.CS_ARCH_X86, capstone.CS_MODE_64)


def load_disassembler() -> None:
    """Import capstone and make the decoder :func:`instruction_at` uses now (~40 ms),
    for a caller that has idle time before the first instruction is checked."""
    _capstone()


def instruction_at(code: bytes, addr: int) -> Insn | None:
    """The instruction at the start of ``code`` (located at ``addr``); None if invalid.
    A Xen/KVM emulate prefix joins the instruction after it, as in ``insn_decode()``.
    Instructions capstone lacks but the kernel's decoder knows come back as ``.byte``."""
    pre = next((p for p in ARCH.emulate_prefixes if code.startswith(p)), b"")
    rest = bytes(code[len(pre):len(pre) + ARCH.max_insn_len])
    for _, size, mnemonic, op_str in _capstone().disasm_lite(rest, addr + len(pre), 1):
        if mnemonic == "ud1":
            size = _ud1_size(rest) or size
        return Insn(addr, len(pre) + size, mnemonic, op_str, bytes(code[:len(pre) + size]))
    size = _length_fallback(rest)
    if size is None:
        return None
    raw = bytes(code[:len(pre) + size])
    return Insn(addr, len(raw), ".byte", ", ".join(f"{b:#04x}" for b in raw), raw)


_LEGACY_PREFIXES = frozenset(b"\x26\x2e\x36\x3e\x64\x65\x66\x67\xf0\xf2\xf3")
_VEX_0F_IMM8 = frozenset((0x70, 0x71, 0x72, 0x73, 0xc2, 0xc4, 0xc5, 0xc6))


def _ud1_size(code: bytes) -> int | None:
    """UD1's length as the kernel's decoder takes it: arch/x86/lib/x86-opcode-map.txt has
    ``0f b9: Grp10 (1A)``, an opcode with a ModRM; capstone 5 decodes it without one. 7.3's
    WARN() is ``ud1`` behind an address-size prefix (``67 48 0f b9 3a``: 5 bytes, capstone
    says 4), so a walk through a function past a WARN went astray (can_probe() does not)."""
    n = next((i for i, b in enumerate(code) if b not in _LEGACY_PREFIXES), len(code))
    n += n < len(code) and 0x40 <= code[n] <= 0x4F         # REX
    if code[n:n + 2] != b"\x0f\xb9":
        return None
    m = modrm_len(code, n + 2)
    return None if m is None or n + 2 + m > ARCH.max_insn_len else n + 2 + m


def _length_fallback(code: bytes) -> int | None:
    # Lengths of what capstone 5 cannot decode but arch/x86/lib/x86-opcode-map.txt has, as
    # found by walking every function of a 6.1 kernel: 0F 01 register forms (SERIALIZE,
    # PVALIDATE, RMPADJUST: 3 bytes) and VEX forms (AMX tilerelease): sizes from ModRM.
    n = next((i for i, b in enumerate(code) if b not in _LEGACY_PREFIXES), len(code))
    op = code[n:]
    if op[:2] == b"\x0f\x01" and len(op) > 2 and op[2] >= 0xc0:
        return n + 3
    # 0F 00 (Grp6) always takes a ModRM and nothing after it: 7.3's load_gs_index() is
    # LKGS, F2 0F 00 /6 (x86-opcode-map.txt, Grp6: "6: LKGS Ew (F2)"), which capstone
    # 5 does not know
    if op[:2] == b"\x0f\x00":
        m = modrm_len(op, 2)
        return None if m is None or n + 2 + m > min(len(code), ARCH.max_insn_len) else n + 2 + m
    if op[:1] not in (b"\xc4", b"\xc5"):
        return None
    vex = 3 if op[0] == 0xc4 else 2
    if len(op) < vex + 3:
        return None
    opmap = op[1] & 0x1F if vex == 3 else 1
    if opmap == 1 and op[vex] == 0x77:                            # vzeroupper: no ModRM
        return n + vex + 1
    mod, rm, size = op[vex + 1] >> 6, op[vex + 1] & 7, vex + 2
    if mod != 3 and rm == 4:                                      # SIB
        size += 1 + (4 if mod == 0 and op[vex + 2] & 7 == 5 else 0)
    size += {1: 1, 2: 4}.get(mod, 4 if mod == 0 and rm == 5 else 0)
    size += opmap == 3 or (opmap == 1 and op[vex] in _VEX_0F_IMM8)
    return n + size if n + size <= min(len(code), ARCH.max_insn_len) else None


def kprobe_addr(addr: int, *, symbols: SymbolTable, read: ReadFn,
                arch: Arch = ARCH) -> tuple[int, bool]:
    """``(where register_kprobe() puts a probe asked at addr, on_func_entry)``:
    ``_kprobe_addr()`` splits it into symbol+offset, ``arch_adjust_kprobe_addr()`` moves
    ``sym+0`` past an ENDBR. Place host breakpoints there, or they never match the guest.

    :raise ProbeRejectedError: ENOENT when no symbol holds ``addr``.
    """
    sym, off = _containing(addr, symbols)
    return arch.adjust_kprobe_addr(sym.addr, off, read(sym.addr, 4) if off in (0, 4) else b"")


def is_ftrace_site(code: bytes, arch: Arch = ARCH) -> bool:
    """The first instruction at a function entry (after an ENDBR) is its ``__fentry__``
    call site, so ``ftrace_location()`` holds it and a kprobe there is an ftrace probe
    (``check_ftrace_location()``, kernel/kprobes.c: KPROBE_FLAG_FTRACE): the 5-byte NOP
    ftrace left at boot, or the call it patched in for a user (the guest's own probe)."""
    return code[:5] == getattr(arch, "nop5", None) or code[:1] == b"\xe8"


def _containing(addr: int, symbols: SymbolTable) -> tuple[Symbol, int]:
    found = symbols.symbolize(addr)
    if found is None:
        raise ProbeRejectedError(f"no kernel symbol holds {addr:#x}, so _kprobe_addr() "
                                 "cannot make it symbol+offset", errno.ENOENT, addr,
                                 reason=f"no symbol holds {addr:#x}")
    return found


class ReservedText:
    """Kernel text a kprobe may not go in because the kernel patches it itself, as
    ``check_kprobe_address_safe()`` (kernel/kprobes.c, 6.1) asks: ``jump_label_text_reserved()``
    (a ``static_branch`` site: the 2- or 5-byte jmp/nop at each ``__jump_table`` entry's code,
    its length decoded as ``arch_jump_entry_size()`` does), ``static_call_text_reserved()``
    (``CALL_INSN_SIZE`` bytes at each ``.static_call_sites`` entry) and ``find_bug()`` (the
    ``ud2`` of each ``__bug_table`` entry). vmlinux's tables only: module tables live in
    ``struct module`` and are not read (a module's jump label or static call site is not
    refused host-side).

    Entries are self-relative ``s32``s (``jump_entry_code()``, ``static_call_addr()``,
    ``bug_addr()``): 16-byte ``struct jump_entry``, 8-byte ``struct static_call_site``, 12-byte
    ``struct bug_entry`` (``CONFIG_DEBUG_BUGVERBOSE``, relative pointers).
    """

    _TABLES = (("__start___jump_table", "__stop___jump_table", 16),
               ("__start_static_call_sites", "__stop_static_call_sites", 8),
               ("__start___bug_table", "__stop___bug_table", 12))

    def __init__(self, jump: list[int], static_calls: list[int], bugs: set[int]) -> None:
        self.jump = sorted(jump)
        self.static_calls = sorted(static_calls)
        self.bugs = bugs

    @classmethod
    def from_memory(cls, symbols: SymbolTable, read: ReadFn) -> ReservedText:
        """Read the three tables of vmlinux (``read(addr, n)``: guest memory)."""
        found: list[list[int]] = []
        for start, stop, size in cls._TABLES:
            a, b = symbols.get(start), symbols.get(stop)
            sites: list[int] = []
            if a is not None and b is not None and b.addr > a.addr:
                data = read(a.addr, b.addr - a.addr)
                for i in range(0, len(data) - size + 1, size):
                    rel = int.from_bytes(data[i:i + 4], "little", signed=True)
                    sites.append((a.addr + i + rel) & ((1 << 64) - 1))
            found.append(sites)
        return cls(found[0], found[1], set(found[2]))

    @classmethod
    def state(cls, symbols: SymbolTable) -> tuple[tuple[int, int] | None, ...]:
        """Where the three tables lie (their start and stop symbols' addresses): with the
        kernel, what :meth:`from_memory` reads (a cache's key; the tables are sorted and
        fixed by the time the kernel runs init)."""
        out = []
        for start, stop, _ in cls._TABLES:
            a, b = symbols.get(start), symbols.get(stop)
            out.append((a.addr, b.addr) if a is not None and b is not None else None)
        return tuple(out)

    def to_bytes(self) -> bytes:
        """The sites, for :meth:`from_bytes`: three counts, then the addresses (u64 LE)."""
        bugs = sorted(self.bugs)
        return struct.pack(f"<3Q{len(self.jump) + len(self.static_calls) + len(bugs)}Q",
                           len(self.jump), len(self.static_calls), len(bugs),
                           *self.jump, *self.static_calls, *bugs)

    @classmethod
    def from_bytes(cls, data: bytes) -> ReservedText:
        """:raise ValueError: not what :meth:`to_bytes` wrote."""
        try:
            nj, ns, nb = struct.unpack_from("<3Q", data)
            if len(data) != 8 * (3 + nj + ns + nb):
                raise ValueError(f"{len(data)} bytes for {nj}+{ns}+{nb} sites")
            sites = struct.unpack_from(f"<{nj + ns + nb}Q", data, 24)
        except struct.error as exc:
            raise ValueError(str(exc)) from None
        return cls(list(sites[:nj]), list(sites[nj:nj + ns]), set(sites[nj + ns:]))

    def find(self, addr: int, read: ReadFn) -> str | None:
        """What reserves ``addr``, or None."""
        i = bisect.bisect_left(self.jump, addr - 4)
        while i < len(self.jump) and self.jump[i] <= addr:
            code = self.jump[i]
            insn = instruction_at(read(code, 16), code)
            if insn is not None and code + insn.size > addr:
                return "a jump label site (jump_label_text_reserved)"
            i += 1
        i = bisect.bisect_left(self.static_calls, addr - 4)
        if i < len(self.static_calls) and self.static_calls[i] <= addr:
            return "a static call site (static_call_text_reserved)"
        if addr in self.bugs:
            return "a BUG() site (find_bug)"
        return None


def check_probe_address(addr: int, *, symbols: SymbolTable, blacklist: Blacklist,
                        read: ReadFn, kretprobe: bool = False,
                        symbol_offset: int | None = None, recover: RecoverFn | None = None,
                        arch: X86_64 = ARCH, max_prefix: int = MAX_FUNC_PREFIX,
                        reserved: ReservedText | None = None,
                        exception_insns: bool = False) -> None:
    """Refuse ``addr`` as Linux 6.1 ``register_k[ret]probe()`` would, with its errno.

    In the kernel's order: ``_kprobe_addr()``, ENOENT if no symbol holds ``addr``; for a
    kretprobe ``kprobe_on_func_entry()``, EINVAL unless ``sym+0`` (or +4 after ENDBR);
    ``check_kprobe_address_safe()``, EINVAL outside core/module text, on the blacklist
    (or a ``foo.cold`` of a listed ``foo``: ``within_kprobe_blacklist()``) or in a
    ``__cfi_``/``__pfx_`` preamble; x86 ``can_probe()``, EILSEQ off an instruction
    boundary; ``__copy_instruction()``, EINVAL for an unrecoverable INT3, ``mov ss``, an
    emulate prefix or garbage. A probe on the ``__fentry__`` NOP's first byte becomes an
    ftrace probe and skips ``can_probe()``; that byte is a boundary and +1..+4 are not, so
    the boundary check answers both. Not modelled (the data lives in the guest): jump
    label, static call, BUG and alternatives sites (EINVAL), ``prepare_emulation()``
    (EOPNOTSUPP), modules going away, and kprobe_events' own checks.

    ``read`` is called once, for ``sym.addr`` to ``addr+15``. INT3s of armed probes decode
    as 1-byte ``int3`` unless ``recover`` gives back the original bytes, as
    ``recover_probed_instruction()`` does. With ``reserved``, jump label, static call and
    BUG() sites of vmlinux are refused with EINVAL too (:class:`ReservedText`). With
    ``exception_insns`` (``KernelRules.can_probe_exception_insns``: 6.12, 7.3), ``can_probe()``
    refuses INT3, INT n, INTO, INT1 and UD0/1/2 at ``addr`` with EILSEQ first.

    :param symbol_offset: OFFS of a ``SYM+OFFS`` probe, for messages only: the kernel
        re-derives the offset from the address (``foo+0x140`` past ``foo`` is ``bar+0x0``).
    :raise ProbeRejectedError: with ``.errno`` and ``.addr`` when the kernel would refuse.
    """
    sym, off = _containing(addr, symbols)
    where = f"{sym.name}+{off:#x}" + (f" [{sym.module}]" if sym.module else "")
    if symbol_offset is not None and symbol_offset != off:
        where += f" (given as +{symbol_offset:#x})"
    if off > max_prefix:
        raise ProbeRejectedError(f"{where}: the harness does not decode more than "
                                 f"{max_prefix} bytes of a function", errno.EILSEQ, addr,
                                 reason=f"not decoded that far: {where}")
    code = bytearray()

    def prefix() -> bytearray:
        if not code:
            code.extend(read(sym.addr, off + arch.max_insn_len))
        return code

    if kretprobe and not arch.adjust_kprobe_addr(sym.addr, off,
                                                 prefix() if off == 4 else b"")[1]:
        raise ProbeRejectedError(f"{where} is not a function entry; a kretprobe must be at "
                                 "+0 (kprobe_on_func_entry)", errno.EINVAL, addr,
                                 reason=f"not a function entry: {where}")
    if not symbols.is_text(addr):
        what = ("BPF or trampoline code" if sym.module in _PSEUDO_MODULES
                else "text outside _stext.._etext (init text is freed after boot)"
                if sym.is_text else f"a {sym.type!r} symbol, not text")
        raise ProbeRejectedError(f"{where} ({addr:#x}) is {what}; kprobes go only in core "
                                 "kernel text or module text", errno.EINVAL, addr,
                                 reason=f"not kernel text: {where}")
    listed, via = blacklist.find(addr), ""
    if listed is None and "." in sym.name:
        stem = sym.name.split(".", 1)[0]
        try:
            listed = blacklist.find(symbols.lookup(stem).addr)
        except SymbolNotFoundError:
            pass
        via = f" (as {sym.name} is a compiler-made piece of it)"
    if listed is not None:
        where = where if listed == sym.name else f"{where} is in {listed}, which"
        raise ProbeRejectedError(
            f"{where} is on the kprobe blacklist{via} (NOKPROBE_SYMBOL,"
            f" noinstr or entry code; /sys/kernel/debug/kprobes/blacklist); probe a caller "
            f"of {listed} instead, or a function it calls", errno.EINVAL, addr,
            reason=f"blacklisted: {listed}")
    why = reserved.find(addr, read) if reserved is not None else None
    if why is not None:
        raise ProbeRejectedError(f"{where} is {why}: the kernel patches it itself",
                                 errno.EINVAL, addr, reason=f"{why.split(' (')[0]}: {where}")
    if sym.name.startswith(("__cfi_", "__pfx_")):
        raise ProbeRejectedError(f"{where} is a CFI/padding preamble, not a function "
                                 "(is_cfi_preamble_symbol)", errno.EINVAL, addr,
                                 reason=f"CFI preamble: {where}")
    _check_insn(addr, sym, where, prefix(), recover, arch, exception_insns)


#: arch/x86/kernel/kprobes/core.c: is_exception_insn() (6.12, 7.3): INT3, INT n, INTO,
#: INT1; after 0F: UD0, UD1, UD2
_EXCEPTION_OPCODES = (b"\xcc", b"\xcd", b"\xce", b"\xf1", b"\x0f\xff", b"\x0f\xb9", b"\x0f\x0b")
_PREFIXES = frozenset(b"\x66\x67\xf2\xf3\x2e\x36\x3e\x26\x64\x65\xf0") | frozenset(range(0x40, 0x50))


def _opcode(raw: bytes) -> bytes:
    """The opcode bytes of an instruction, past its legacy and REX prefixes."""
    i = 0
    while i < len(raw) - 1 and raw[i] in _PREFIXES:
        i += 1
    return raw[i:]


def _check_insn(addr: int, sym: Symbol, where: str, code: bytearray,
                recover: RecoverFn | None, arch: X86_64, exception_insns: bool = False) -> None:
    # can_probe(): walk instruction by instruction from the symbol start to addr.
    pos, last = sym.addr, None
    while True:
        i = pos - sym.addr
        if recover is not None and code[i:i + 1] == arch.breakpoint:
            orig = recover(pos)
            if orig:
                code[i:i + len(orig)] = orig
        insn = instruction_at(code[i:i + 2 * arch.max_insn_len], pos)
        if pos >= addr:
            break
        if insn is None:
            raise ProbeRejectedError(
                f"cannot decode {bytes(code[i:i + 8]).hex(' ')} at {sym.name}+{i:#x}, so "
                f"can_probe() never reaches {where}", errno.EILSEQ, addr,
                reason=f"not an instruction boundary: {where}")
        last, pos = insn, pos + insn.size
    if last is not None and pos != addr:
        start = last.addr - sym.addr
        raise ProbeRejectedError(
            f"{where} is not an instruction boundary (can_probe): it is inside '{last}' "
            f"({last.size} bytes); the nearest boundaries are {sym.name}+{start:#x} and "
            f"{sym.name}+{pos - sym.addr:#x}", errno.EILSEQ, addr,
            reason=f"not an instruction boundary: {where}")
    if exception_insns and insn is not None and \
            _opcode(bytes(insn.bytes)).startswith(_EXCEPTION_OPCODES):
        raise ProbeRejectedError(
            f"the instruction at {where} is '{insn}', an INT or UD that can_probe() refuses "
            "(is_exception_insn)", errno.EILSEQ, addr,
            reason=f"an INT or UD instruction: {where}")
    # __copy_instruction(): what arch_copy_kprobe() refuses with EINVAL.
    if insn is None:
        why = "cannot be decoded"
    elif insn.bytes[:1] == arch.breakpoint:
        why = "is an INT3 that no kprobe can give back (planted by someone else, or real)"
    elif insn.mnemonic == "mov" and insn.op_str.startswith("ss,"):
        why = "masks exceptions (mov ss), so it cannot be single-stepped"
    elif insn.bytes.startswith(arch.emulate_prefixes):
        why = "carries a Xen/KVM emulate prefix"
    else:
        return
    raise ProbeRejectedError(f"the instruction at {where} {why} (__copy_instruction)",
                             errno.EINVAL, addr, reason=f"cannot copy the instruction at {where}")
