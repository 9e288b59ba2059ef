"""The parts of a program's ELF file that uprobes need: symbols, loaded segments, offsets.

``uprobe_events`` places a probe at a *file offset* (``kernel/trace/trace_uprobe.c``:
``__trace_uprobe_create()``), and ``uprobe_register()`` (``kernel/events/uprobes.c``) turns it
into an address in each mapping of that file. This module makes the same translations on the
host from the file's bytes (pyelftools), with no process and no guest.
"""
from __future__ import annotations

import io
import struct

#: ``PF_X`` of a program header (include/uapi/linux/elf.h).
PF_X = 1
PAGE = 4096
#: ``STT_FUNC`` of a symbol's ``st_info`` (include/uapi/linux/elf.h)
STT_FUNC = 2
#: ``Elf64_Sym``: st_name, st_info, st_other, st_shndx, st_value, st_size
_SYM64 = struct.Struct("<IBBHQQ")


class ElfImage:
    """The parts of a program's ELF that uprobes need (pyelftools)."""

    def __init__(self, data: bytes) -> None:
        from elftools.elf.elffile import ELFFile   # pyelftools loads only for uprobes

        self.size = len(data)
        self._elf = ELFFile(io.BytesIO(data))
        self.pie = self._elf["e_type"] == "ET_DYN"
        self.loads = [s.header for s in self._elf.iter_segments() if s["p_type"] == "PT_LOAD"]
        self._syms: dict[str, int] = {}
        tab = self._elf.get_section_by_name(".symtab")
        if tab is None:
            return
        if self._elf.elfclass == 64 and self._elf.little_endian and \
                tab["sh_entsize"] == _SYM64.size:
            # Elf64_Sym read in bulk (pyelftools parses each through construct: ~0.1 s
            # for busybox's symbols, paid at every uprobe line of a run)
            strtab = self._elf.get_section(tab["sh_link"]).data()
            for name_off, info, _, _, value, _ in _SYM64.iter_unpack(tab.data()):
                if info & 0xF == STT_FUNC and name_off:
                    end = strtab.find(b"\0", name_off)
                    raw = strtab[name_off:end if end >= 0 else len(strtab)]
                    if raw:         # pyelftools' names: UTF-8, undecodable bytes replaced
                        self._syms.setdefault(raw.decode("utf-8", "replace"), value)
            return
        for s in tab.iter_symbols():
            if s.name and s["st_info"]["type"] == "STT_FUNC":
                self._syms.setdefault(s.name, s["st_value"])

    def symbol(self, name: str) -> int:
        """The link-time address of function ``name``; KeyError when absent."""
        return self._syms[name]

    def file_offset(self, vaddr: int) -> int:
        for h in self.loads:
            if h["p_vaddr"] <= vaddr < h["p_vaddr"] + h["p_filesz"]:
                return h["p_offset"] + vaddr - h["p_vaddr"]
        raise KeyError(f"{vaddr:#x} is in no loaded segment")

    def vaddr(self, offset: int) -> int:
        """The link-time address of file offset ``offset`` (as ``uprobe_register`` maps it)."""
        for h in self.loads:
            if h["p_offset"] <= offset < h["p_offset"] + h["p_filesz"]:
                return h["p_vaddr"] + offset - h["p_offset"]
        raise KeyError(f"file offset {offset:#x} is in no loaded segment")

    def executable(self, vaddr: int) -> bool:
        return any(h["p_flags"] & PF_X and h["p_vaddr"] <= vaddr < h["p_vaddr"] + h["p_filesz"]
                   for h in self.loads)

    def trampoline(self) -> int:
        """A never-executed address in an executable page: the byte past the end of the
        last executable segment, when that end is not page aligned."""
        for h in sorted((h for h in self.loads if h["p_flags"] & PF_X),
                        key=lambda h: -h["p_vaddr"]):
            end = h["p_vaddr"] + h["p_filesz"]
            if end % PAGE:
                return end
        raise KeyError("no padding after the executable segment for a uretprobe trampoline")
