"""Just enough of a BTF reader to find struct member offsets (``task_struct.pid``, ``comm``).

Why: the host reads kernel objects from guest memory and needs their layout; the kernel
carries it in ``/sys/kernel/btf/vmlinux`` (CONFIG_DEBUG_INFO_BTF), so no DWARF package is
needed. Format: include/uapi/linux/btf.h (header, type section, string section).
"""
from __future__ import annotations

import struct

BTF_MAGIC = 0xEB9F
KIND_STRUCT, KIND_UNION = 4, 5
# Extra bytes after each ``struct btf_type`` by kind (per member for vlen kinds).
_FIXED = {1: 4, 3: 12, 12: 0, 14: 4, 17: 4}          # INT, ARRAY, FUNC, VAR, DECL_TAG
_PER_MEMBER = {4: 12, 5: 12, 6: 8, 13: 8, 15: 12, 19: 12}  # STRUCT UNION ENUM FUNC_PROTO DATASEC ENUM64


class BTF:
    def __init__(self, data: bytes) -> None:
        magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = \
            struct.unpack_from("<HBBIIIII", data, 0)
        if magic != BTF_MAGIC:
            raise ValueError("not BTF data")
        self._types = data[hdr_len + type_off:hdr_len + type_off + type_len]
        self._strs = data[hdr_len + str_off:hdr_len + str_off + str_len]
        self._structs: dict[str, list[tuple[str, int]]] | None = None
        # type id -> (kind, members as (name, byte offset, type id)) for structs and unions
        self._by_name: dict[str, int] = {}
        self._members: dict[int, tuple[int, list[tuple[str, int, int]]]] = {}

    def _name(self, off: int) -> str:
        end = self._strs.index(b"\0", off)
        return self._strs[off:end].decode()

    def _index(self) -> dict[str, list[tuple[str, int]]]:
        if self._structs is None:
            out: dict[str, list[tuple[str, int]]] = {}
            t, pos, tid = self._types, 0, 0
            while pos < len(t):
                name_off, info, _size = struct.unpack_from("<III", t, pos)
                pos += 12
                tid += 1
                kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, info >> 31
                if kind in (KIND_STRUCT, KIND_UNION):
                    members = []
                    for i in range(vlen):
                        m_name, m_type, m_off = struct.unpack_from("<III", t, pos + 12 * i)
                        bits = m_off & 0xFFFFFF if kflag else m_off
                        members.append((self._name(m_name) if m_name else "", bits // 8, m_type))
                    self._members[tid] = (kind, members)
                    if name_off:
                        out.setdefault(self._name(name_off), [(n, o) for n, o, _ in members])
                        self._by_name.setdefault(self._name(name_off), tid)
                pos += _FIXED.get(kind, 0) + _PER_MEMBER.get(kind, 0) * vlen
            self._structs = out
        return self._structs

    def offset(self, struct_name: str, member: str) -> int:
        """Byte offset of ``member`` in ``struct struct_name``, also inside anonymous
        structs and unions (6.1's ``mm_struct`` keeps nearly everything, ``exe_file``
        included, in one anonymous ``__randomize_layout`` struct)."""
        for name, off in self._index().get(struct_name, []):
            if name == member:
                return off
        tid = self._by_name.get(struct_name)
        found = self._find(tid, member, 0) if tid is not None else None
        if found is None:
            raise KeyError(f"struct {struct_name} has no member {member}")
        return found

    def _find(self, tid: int, member: str, base: int) -> int | None:
        for name, off, mtype in self._members.get(tid, (0, []))[1]:
            if name == member:
                return base + off
            if not name and mtype in self._members:
                got = self._find(mtype, member, base + off)
                if got is not None:
                    return got
        return None
