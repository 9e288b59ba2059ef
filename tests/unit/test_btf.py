"""harness.kernel.btf on a BTF blob built here (include/uapi/linux/btf.h): the lazy
reader gives what the format says, and the real image's BTF answers as an eager
decoding of it does."""
from __future__ import annotations

import struct

from harness.kernel.btf import (KIND_ARRAY, KIND_DATASEC, KIND_DECL_TAG, KIND_ENUM, KIND_ENUM64,
                                KIND_FUNC, KIND_FUNC_PROTO, KIND_INT, KIND_PTR, KIND_STRUCT,
                                KIND_TYPEDEF, KIND_UNION, KIND_VAR, BTF, Member, Param)


def _blob(types: list[bytes], strs: bytes) -> bytes:
    tsec = b"".join(types)
    hdr = struct.pack("<HBBIIIII", 0xEB9F, 1, 0, 24, 0, len(tsec), len(tsec), len(strs))
    return hdr + tsec + strs


def _t(name_off: int, kind: int, vlen: int, ref: int, kflag: bool = False) -> bytes:
    return struct.pack("<III", name_off, (kflag << 31) | (kind << 24) | vlen, ref)


# string section: offsets 1 "int", 5 "s", 7 "a", 9 "b", 11 "f", 13 "x", 15 "bar_foo"
# ("foo" at 19 is a whole C string inside it, as a deduplicated table may share a tail)
STRS = b"\0int\0s\0a\0b\0f\0x\0bar_foo\0"
FOO = STRS.index(b"foo\0")
TYPES = [
    _t(1, KIND_INT, 0, 4) + struct.pack("<I", (1 << 24) | 32),        # 1 int, signed 32
    _t(5, KIND_STRUCT, 2, 8, kflag=True)                                # 2 struct s
    + struct.pack("<III", 7, 1, 0) + struct.pack("<III", 9, 1, (3 << 24) | 35),
    _t(0, KIND_PTR, 0, 2),                                              # 3 struct s *
    _t(0, KIND_FUNC_PROTO, 2, 1)                                        # 4 int (*)(int x, s *)
    + struct.pack("<II", 13, 1) + struct.pack("<II", 0, 3),
    _t(11, KIND_FUNC, 0, 4),                                            # 5 f
    _t(5, KIND_STRUCT, 0, 0),                                           # 6 a second struct s
    _t(FOO, KIND_TYPEDEF, 0, 2),                                        # 7 typedef s foo
]


def test_types_members_and_prototypes_decode_as_the_format_says() -> None:
    btf = BTF(_blob(TYPES, STRS))
    t = btf.type(1)
    assert (t.kind, t.name, t.ref, t.extra) == (KIND_INT, "int", 4, (1, 0, 32))
    assert btf.type(0) is None and btf.type(8) is None
    assert btf.members(2) == [Member("a", 1, 0, 0), Member("b", 1, 35, 3)]
    assert btf.members(1) == [] and btf.members(6) == []
    assert btf.func_proto("f") == (1, [Param("x", 1), Param("", 3)])
    assert btf.func_proto("s") is None
    assert btf.skip_modifiers(7) == (2, btf.type(2))


def test_find_takes_the_first_type_of_a_kind_and_name_at_any_offset() -> None:
    btf = BTF(_blob(TYPES, STRS))
    assert btf.find("s", KIND_STRUCT) == 2          # not 6: btf_find_by_name_kind()
    assert btf.find("foo", KIND_TYPEDEF) == 7       # its name is the tail of "bar_foo"
    assert btf.find("bar_foo", KIND_TYPEDEF) is None
    assert btf.find("oo", KIND_TYPEDEF) is None     # a tail that no type starts at
    assert btf.find("s", KIND_FUNC) is None and btf.find("", KIND_INT) is None
    assert btf.find("s", KIND_STRUCT) == 2          # asked twice: the same


def test_the_image_btf_answers_as_an_eager_decoding(default_image) -> None:
    """Named types of the image's kernel (one in 40, and the usual ones) found where a plain walk of the type
    section puts its first of that kind and name; each struct's members as decoded."""
    data = (default_image.dir / "btf").read_bytes()
    btf = BTF(data)
    _, _, _, hdr_len, type_off, type_len, str_off, _ = struct.unpack_from("<HBBIIIII", data)
    t, pos, tid = data[hdr_len + type_off:hdr_len + type_off + type_len], 0, 0
    strs = data[hdr_len + str_off:]
    first: dict[tuple[int, str], int] = {}
    structs = 0
    per = {KIND_STRUCT: 12, KIND_UNION: 12, KIND_ENUM: 8, KIND_FUNC_PROTO: 8,
           KIND_DATASEC: 12, KIND_ENUM64: 12}
    fixed = {KIND_INT: 4, KIND_ARRAY: 12, KIND_VAR: 4, KIND_DECL_TAG: 4}
    while pos < len(t):
        name_off, info, _ = struct.unpack_from("<III", t, pos)
        tid += 1
        kind, vlen = (info >> 24) & 0x1F, info & 0xFFFF
        name = strs[name_off:strs.index(b"\0", name_off)].decode()
        if name:
            first.setdefault((kind, name), tid)
        if kind == KIND_STRUCT and vlen and structs < 500:
            structs += 1
            m0 = struct.unpack_from("<III", t, pos + 12)
            got = btf.members(tid)[0]
            assert got.name == strs[m0[0]:strs.index(b"\0", m0[0])].decode()
            assert got.type == m0[1] and len(btf.members(tid)) == vlen
        assert btf.type(tid).name == name and btf.type(tid).kind == kind
        pos += 12 + fixed.get(kind, 0) + per.get(kind, 0) * vlen
    assert len(first) > 10_000
    for (kind, name), want in list(first.items())[::40]:
        assert btf.find(name, kind) == want, (kind, name)
    for name in ("task_struct", "int", "pt_regs", "kprobe", "file"):
        assert btf.find(name, KIND_STRUCT if name != "int" else KIND_INT) == \
            first[(KIND_STRUCT if name != "int" else KIND_INT, name)]


def test_an_index_kept_gives_the_same_answers_and_a_bad_one_is_ignored() -> None:
    """BTF(data, index) with what index_bytes() gave (a cache on disk, facts._derived)
    answers as the parse does; an index of another layout, or not one at all, is parsed
    over."""
    import marshal
    data = _blob(TYPES, STRS)
    idx = BTF(data).index_bytes()
    kept = BTF(data, idx)
    assert kept.indexed                         # nothing parsed again
    assert not BTF(data, b"junk").indexed and not BTF(data).indexed
    for b in (kept, BTF(data, b"junk"), BTF(data, marshal.dumps((99, [0], {})))):
        assert b.find("s", KIND_STRUCT) == 2 and b.find("foo", KIND_TYPEDEF) == 7
        assert b.members(2) == [Member("a", 1, 0, 0), Member("b", 1, 35, 3)]
