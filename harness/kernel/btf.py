"""A small BTF reader: struct member offsets, function prototypes, the types probe
events use.

Why: the host reads kernel objects from guest memory and needs their layout, and since
6.12 (``CONFIG_PROBE_EVENTS_BTF_ARGS``) ``kprobe_events`` types and names arguments from
the function's BTF prototype (``$retval`` of ``kernel_clone`` prints ``121``, not
``0x79``), so the host must read the same prototypes. The kernel carries BTF in
``/sys/kernel/btf/vmlinux`` (CONFIG_DEBUG_INFO_BTF); no DWARF package is needed. Format:
include/uapi/linux/btf.h (header, type section, string section). What is mirrored:
``btf_find_func_proto()``, ``btf_type_skip_modifiers()``, ``btf_find_struct_member()``
(kernel/trace/trace_btf.c, kernel/bpf/btf.c) and ``bpf_find_btf_id()`` for vmlinux.
"""
from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

BTF_MAGIC = 0xEB9F
(KIND_INT, KIND_PTR, KIND_ARRAY, KIND_STRUCT, KIND_UNION, KIND_ENUM, KIND_FWD, KIND_TYPEDEF,
 KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_FUNC, KIND_FUNC_PROTO, KIND_VAR, KIND_DATASEC,
 KIND_FLOAT, KIND_DECL_TAG, KIND_TYPE_TAG, KIND_ENUM64) = range(1, 20)
#: btf_type_is_modifier(): what btf_type_skip_modifiers() skips
MODIFIERS = (KIND_TYPEDEF, KIND_VOLATILE, KIND_CONST, KIND_RESTRICT, KIND_TYPE_TAG)
INT_SIGNED, INT_CHAR, INT_BOOL = 1, 2, 4
# Extra bytes after each ``struct btf_type`` by kind (per member for vlen kinds).
_FIXED = {KIND_INT: 4, KIND_ARRAY: 12, KIND_VAR: 4, KIND_DECL_TAG: 4}
_PER_MEMBER = {KIND_STRUCT: 12, KIND_UNION: 12, KIND_ENUM: 8, KIND_FUNC_PROTO: 8,
               KIND_DATASEC: 12, KIND_ENUM64: 12}


@dataclass(frozen=True)
class BtfType:
    """One ``struct btf_type``: ``ref`` is its size (INT, STRUCT, UNION, ENUM) or the type
    it refers to (PTR, TYPEDEF, modifiers, FUNC, FUNC_PROTO's return type)."""

    id: int
    kind: int
    name: str
    ref: int
    vlen: int
    kflag: bool
    extra: tuple = ()            # INT: (encoding, bit offset, bits); ARRAY: (elem, index, n)

    @property
    def size(self) -> int:
        return self.ref


@dataclass(frozen=True)
class Member:
    """A struct or union member: ``bit_offset`` from the start of its own struct,
    ``bitfield_size`` (0: not a bitfield, as ``BTF_MEMBER_BITFIELD_SIZE()``)."""

    name: str
    type: int
    bit_offset: int
    bitfield_size: int


@dataclass(frozen=True)
class Param:
    name: str
    type: int


class BTF:
    def __init__(self, data: bytes) -> None:
        magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = \
            struct.unpack_from("<HBBIIIII", data, 0)
        if magic != BTF_MAGIC:
            raise ValueError("not BTF data")
        self._types_raw = data[hdr_len + type_off:hdr_len + type_off + type_len]
        self._strs = data[hdr_len + str_off:hdr_len + str_off + str_len]
        self._types: list[BtfType | None] | None = None
        self._members: dict[int, list[Member]] = {}
        self._params: dict[int, list[Param]] = {}
        self._by_name: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()

    # -- the type table ----------------------------------------------------------------------
    def _name(self, off: int) -> str:
        end = self._strs.index(b"\0", off)
        return self._strs[off:end].decode()

    def _table(self) -> list[BtfType | None]:
        if self._types is not None:
            return self._types
        with self._lock:            # one parse, though machines of one kernel share it
            if self._types is None:
                self._parse()
        assert self._types is not None
        return self._types

    def _parse(self) -> None:
        out: list[BtfType | None] = [None]          # id 0 is void
        t, pos = self._types_raw, 0
        while pos < len(t):
            name_off, info, ref = struct.unpack_from("<III", t, pos)
            pos += 12
            tid = len(out)
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, bool(info >> 31)
            name = self._name(name_off) if name_off else ""
            extra: tuple = ()
            if kind == KIND_INT:
                (v,) = struct.unpack_from("<I", t, pos)
                extra = ((v >> 24) & 0x0F, (v >> 16) & 0xFF, v & 0xFF)
            elif kind == KIND_ARRAY:
                extra = struct.unpack_from("<III", t, pos)
            elif kind in (KIND_STRUCT, KIND_UNION):
                ms = []
                for i in range(vlen):
                    m_name, m_type, m_off = struct.unpack_from("<III", t, pos + 12 * i)
                    bits, bsize = (m_off & 0xFFFFFF, m_off >> 24) if kflag else (m_off, 0)
                    ms.append(Member(self._name(m_name) if m_name else "", m_type, bits, bsize))
                self._members[tid] = ms
            elif kind == KIND_FUNC_PROTO:
                self._params[tid] = [
                    Param(self._name(n) if n else "", ty)
                    for n, ty in (struct.unpack_from("<II", t, pos + 8 * i) for i in range(vlen))]
            out.append(BtfType(tid, kind, name, ref, vlen, kflag, extra))
            if name:
                self._by_name.setdefault((kind, name), tid)
            pos += _FIXED.get(kind, 0) + _PER_MEMBER.get(kind, 0) * vlen
        self._types = out

    def type(self, tid: int) -> BtfType | None:
        """``btf_type_by_id()``; None for void (0) or an id out of range."""
        table = self._table()
        return table[tid] if 0 < tid < len(table) else None

    def find(self, name: str, kind: int) -> int | None:
        """``btf_find_by_name_kind()``: the first type of that kind and name."""
        self._table()
        return self._by_name.get((kind, name))

    def skip_modifiers(self, tid: int) -> tuple[int, BtfType | None]:
        """``btf_type_skip_modifiers()``: (the id and type past typedefs and qualifiers)."""
        t = self.type(tid)
        while t is not None and t.kind in MODIFIERS:
            tid = t.ref
            t = self.type(tid)
        return tid, t

    def members(self, tid: int) -> list[Member]:
        self._table()
        return self._members.get(tid, [])

    def func_proto(self, name: str) -> tuple[int, list[Param]] | None:
        """``btf_find_func_proto()`` + ``btf_get_func_param()``: (the return type id, 0
        for void; the parameters) of the function ``name``, or None when BTF has no such
        function."""
        fid = self.find(name, KIND_FUNC)
        if fid is None:
            return None
        func = self.type(fid)
        proto = self.type(func.ref) if func is not None else None
        if proto is None or proto.kind != KIND_FUNC_PROTO:
            return None
        return proto.ref, list(self._params.get(proto.id, []))

    def find_member(self, struct_tid: int, name: str
                    ) -> tuple[Member, int, BtfType] | None:
        """``btf_find_struct_member()``: (the member, the bit offset of the anonymous
        struct or union holding it, that holder), or None. Anonymous members are searched
        after the named ones, the last one pushed first, as the kernel's stack does."""
        holder = self.type(struct_tid)
        if holder is None or holder.kind not in (KIND_STRUCT, KIND_UNION):
            return None
        stack: list[tuple[int, int]] = []
        cur = 0
        while True:
            for m in self.members(holder.id):
                if not m.name:
                    mtid, mt = self.skip_modifiers(m.type)
                    if mt is not None and mt.kind in (KIND_STRUCT, KIND_UNION) and len(stack) < 16:
                        stack.append((mtid, cur + m.bit_offset))
                elif m.name == name:
                    return m, cur, holder
            if not stack:
                return None
            tid, cur = stack.pop()
            holder = self.type(tid)

    # -- struct member offsets (the host's own reads) ------------------------------------------
    def sizeof(self, struct_name: str) -> int:
        """``sizeof(struct struct_name)``.

        :raise KeyError: no such struct."""
        tid = self.find(struct_name, KIND_STRUCT)
        t = self.type(tid) if tid is not None else None
        if t is None:
            raise KeyError(f"no struct {struct_name}")
        return t.size

    def offset(self, struct_name: str, member: str) -> int:
        """Byte offset of ``member`` in ``struct struct_name``, also inside anonymous
        structs and unions (6.1's ``mm_struct`` keeps nearly everything, ``exe_file``
        included, in one anonymous ``__randomize_layout`` struct). A dotted ``member``
        (``d_name.name``) walks embedded structs.

        :raise KeyError: no such struct or member.
        """
        tid = self.find(struct_name, KIND_STRUCT)
        if tid is None:
            tid = self.find(struct_name, KIND_UNION)
        if tid is None:
            raise KeyError(f"struct {struct_name} has no member {member}")
        bits = 0
        for part in member.split("."):
            found = self.find_member(tid, part)
            if found is None:
                raise KeyError(f"struct {struct_name} has no member {member}")
            m, anon, _ = found
            bits += anon + m.bit_offset
            tid, _t = self.skip_modifiers(m.type)
        return bits // 8
