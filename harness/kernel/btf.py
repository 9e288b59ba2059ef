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

import marshal
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
    #: the layout of :meth:`index_bytes`; another one is not read back
    INDEX_FORMAT = 1

    def __init__(self, data: bytes, index: bytes | None = None) -> None:
        """``data``: the BTF file; ``index``: what :meth:`index_bytes` gave for the same
        data (its type table worked out already; ignored when it is not one)."""
        magic, _ver, _flags, hdr_len, type_off, type_len, str_off, str_len = \
            struct.unpack_from("<HBBIIIII", data, 0)
        if magic != BTF_MAGIC:
            raise ValueError("not BTF data")
        self._types_raw = data[hdr_len + type_off:hdr_len + type_off + type_len]
        self._strs = data[hdr_len + str_off:hdr_len + str_off + str_len]
        self._pos: list[int] | None = None
        self._types: dict[int, BtfType] = {}
        self._found: dict[tuple[int, str], int | None] = {}
        self._members: dict[int, list[Member]] = {}
        self._params: dict[int, list[Param]] = {}
        self._by_name: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        if index is not None:
            try:
                fmt, pos, by_name = marshal.loads(index)
            except (ValueError, EOFError, TypeError):
                return
            if fmt == self.INDEX_FORMAT and isinstance(pos, list) and isinstance(by_name, dict):
                self._pos, self._by_name = pos, by_name

    @property
    def indexed(self) -> bool:
        """The type table is worked out (parsed, or given as an index)."""
        return self._pos is not None

    def index_bytes(self) -> bytes:
        """The type table (:meth:`_parse`: one pass over ~100,000 types, 0.13 s) as bytes
        to give the constructor back with the same data (0.03 s), for a cache on disk."""
        return marshal.dumps((self.INDEX_FORMAT, self._table(), self._by_name))

    # -- the type table ----------------------------------------------------------------------
    def _name(self, off: int) -> str:
        end = self._strs.index(b"\0", off)
        return self._strs[off:end].decode()

    def _table(self) -> list[int]:
        """Each type's offset in the type section (index 0, void, unused)."""
        if self._pos is not None:
            return self._pos
        with self._lock:            # one parse, though machines of one kernel share it
            if self._pos is None:
                self._parse()
        assert self._pos is not None
        return self._pos

    def _parse(self) -> None:
        """One pass over the type section: where each type starts, and the first type of
        each (kind, name offset). Types are decoded when asked (:meth:`type`): vmlinux
        has ~100,000 and a run asks for a few hundred."""
        out = [0]                                   # id 0 is void
        by_name = self._by_name
        t, pos, end = self._types_raw, 0, len(self._types_raw)
        unpack = struct.Struct("<II").unpack_from
        while pos < end:
            name_off, info = unpack(t, pos)
            tid = len(out)
            out.append(pos)
            kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
            if name_off:
                by_name.setdefault((kind, name_off), tid)
            pos += 12 + _FIXED.get(kind, 0) + _PER_MEMBER.get(kind, 0) * vlen
        self._pos = out

    def type(self, tid: int) -> BtfType | None:
        """``btf_type_by_id()``; None for void (0) or an id out of range."""
        table = self._table()
        if not 0 < tid < len(table):
            return None
        got = self._types.get(tid)
        if got is None:
            t, pos = self._types_raw, table[tid]
            name_off, info, ref = struct.unpack_from("<III", t, pos)
            pos += 12
            kind, vlen, kflag = (info >> 24) & 0x1F, info & 0xFFFF, bool(info >> 31)
            extra: tuple = ()
            if kind == KIND_INT:
                (v,) = struct.unpack_from("<I", t, pos)
                extra = ((v >> 24) & 0x0F, (v >> 16) & 0xFF, v & 0xFF)
            elif kind == KIND_ARRAY:
                extra = struct.unpack_from("<III", t, pos)
            got = BtfType(tid, kind, self._name(name_off) if name_off else "", ref, vlen,
                          kflag, extra)
            self._types[tid] = got
        return got

    def find(self, name: str, kind: int) -> int | None:
        """``btf_find_by_name_kind()``: the first type of that kind and name (every
        offset of the string table where ``name`` is a whole C string may be its name)."""
        self._table()
        key = (kind, name)
        if key in self._found:
            return self._found[key]
        if not name:
            return None
        want, strs = name.encode() + b"\0", self._strs
        best = None
        at = strs.find(want)
        while at >= 0:
            tid = self._by_name.get((kind, at))
            if tid is not None and (best is None or tid < best):
                best = tid
            at = strs.find(want, at + 1)
        self._found[key] = best
        return best

    def skip_modifiers(self, tid: int) -> tuple[int, BtfType | None]:
        """``btf_type_skip_modifiers()``: (the id and type past typedefs and qualifiers)."""
        t = self.type(tid)
        while t is not None and t.kind in MODIFIERS:
            tid = t.ref
            t = self.type(tid)
        return tid, t

    def _decode_list(self, tid: int) -> None:
        """A struct's members or a prototype's parameters, from the position
        :meth:`_parse` kept; decoding every one of vmlinux's up front was
        most of a 1-s parse."""
        t = self.type(tid)
        if t is None or t.kind not in (KIND_STRUCT, KIND_UNION, KIND_FUNC_PROTO):
            return
        pos = self._table()[tid] + 12
        raw = self._types_raw
        if t.kind == KIND_FUNC_PROTO:
            self._params[tid] = [
                Param(self._name(n) if n else "", ty)
                for n, ty in (struct.unpack_from("<II", raw, pos + 8 * i) for i in range(t.vlen))]
            return
        ms = []
        for i in range(t.vlen):
            m_name, m_type, m_off = struct.unpack_from("<III", raw, pos + 12 * i)
            bits, bsize = (m_off & 0xFFFFFF, m_off >> 24) if t.kflag else (m_off, 0)
            ms.append(Member(self._name(m_name) if m_name else "", m_type, bits, bsize))
        self._members[tid] = ms

    def members(self, tid: int) -> list[Member]:
        self._table()
        if tid not in self._members:
            self._decode_list(tid)
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
        if proto.id not in self._params:
            self._decode_list(proto.id)
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
