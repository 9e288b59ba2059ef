"""kph doctor's fix for a stale image names the command that makes that image again."""
from __future__ import annotations

from types import SimpleNamespace

from harness.apps import doctor


def test_a_stale_image_s_fix_rebuilds_it_as_it_was_made(tmp_path, monkeypatch):
    monkeypatch.setenv("KPH_CACHE", str(tmp_path))
    debian = SimpleNamespace(series="7.3", manifest={"kernel_origin": "debian"})
    assert doctor.rebuild_command(debian) == "kph image build --kernel 7.3"
    variant = SimpleNamespace(series="6.12", manifest={"kernel_origin": "tree", "tree": {
        "src": str(tmp_path / "src/linux-source-6.12.117-1+variants"),
        "patches": [{"file": "/p/undo fix.patch"}]}})
    assert doctor.rebuild_command(variant) == \
        "kph image build --tree 6.12 --patch '/p/undo fix.patch'"
    mine = SimpleNamespace(series="6.12", manifest={"kernel_origin": "tree",
                                                    "tree": {"src": "/home/me/linux"}})
    assert doctor.rebuild_command(mine) == "kph image build --tree /home/me/linux"
