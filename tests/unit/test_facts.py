"""KernelFacts from recorded files (no guest)."""
from harness.machine.image.facts import DONE, REQUIRED, KernelFacts, is_harvested


def _write(d, **files):
    for k, v in files.items():
        (d / k).write_text(v)


def test_missing_lists_what_a_harvest_lacks(tmp_path):
    _write(tmp_path, kallsyms="ffffffff81000000 T _stext\n", release="6.1.0-x\n")
    f = KernelFacts(tmp_path)
    assert f.missing() == [n for n in REQUIRED if n not in ("kallsyms", "release")]
    assert not is_harvested(tmp_path)
    _write(tmp_path, kprobes_blacklist="", btf="", modules="")
    (tmp_path / DONE).write_text("")
    assert is_harvested(tmp_path)
    assert f.release == "6.1.0-x"


def test_modules_and_config_parse(tmp_path):
    _write(tmp_path, modules="virtio_console 45056 0 - Live 0xffffffffc0100000\n"
                             "pvpanic_pci 16384 0 - Live 0xffffffffc0010000\n",
           config="# comment\nCONFIG_KPROBES=y\nCONFIG_X=\"a=b\"\n# CONFIG_Y is not set\n")
    f = KernelFacts(tmp_path)
    assert f.modules == ("virtio_console", "pvpanic_pci")
    assert f.config == {"CONFIG_KPROBES": "y", "CONFIG_X": '"a=b"'}


def test_an_unreadable_fact_is_a_setup_error_naming_the_fix(tmp_path):
    import pytest
    from harness.errors import SetupError
    with pytest.raises(SetupError, match="kph image build"):
        KernelFacts(tmp_path).btf


def test_facts_parsed_once_are_kept_beside_the_file_for_the_same_file_only(tmp_path):
    """facts._derived: what a process built of a facts file is read back by the next one
    (no build) for the same file, format and Python; a changed file, a damaged copy or
    a directory it cannot write to means a build, never an error."""
    from harness.kernel.symbols import SymbolTable
    from harness.machine.image import facts as F
    src = tmp_path / "kallsyms"
    src.write_text("ffffffff81000000 T _stext\nffffffff81000100 t f\nffffffff81000200 T _etext\n")
    built = []

    def build():
        built.append(1)
        return SymbolTable.from_kallsyms(src)

    def get(stamp=(1, 2, 3)):
        return F._derived(src, "table", stamp, build, SymbolTable.from_bytes,
                          SymbolTable.to_bytes)
    t = get()
    assert built == [1] and (tmp_path / ".kallsyms.table.kept").is_file()
    again = get()
    assert built == [1] and again.lookup("f").addr == t.lookup("f").addr
    assert again.symbolize(0xffffffff81000105)[1] == 5 and again.count("f") == 1
    get(stamp=(1, 2, 4))                          # another file: built, kept anew
    assert built == [1, 1]
    (tmp_path / ".kallsyms.table.kept").write_bytes(b"kph table garbage\n")
    get(stamp=(1, 2, 4))
    assert built == [1, 1, 1]
    (tmp_path / ".kallsyms.table.kept").unlink()
    (tmp_path / ".kallsyms.table.kept").mkdir()        # neither readable nor replaceable
    assert get(stamp=(9, 9, 9)).lookup("f") is not None and len(built) == 4
    assert not list(tmp_path.glob("*.tmp"))
    # the image's manifest leaves such copies out
    from harness.machine.image.store import write_manifest
    (tmp_path / ".kallsyms.table.kept").rmdir()
    get(stamp=(9, 9, 9))
    write_manifest(tmp_path, {})
    import json
    listed = json.loads((tmp_path / "manifest.json").read_text())["artifacts"]
    assert ".kallsyms.table.kept" not in listed and "kallsyms" in listed
