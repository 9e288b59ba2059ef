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
