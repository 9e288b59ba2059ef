"""The corpus of undone fixes (issue 37, probes/bugs/): each entry is the reverse of an
upstream probe fix as a patch for Debian's 6.12 and/or 7.3 source, with its metadata.

The patches are checked the way ``kph image build --tree SERIES --patch FILE`` applies
them (``ksource.check_patches``, then GNU patch ``-p1 --forward --batch``), as a dry run
against the tree ``kph kernel fetch SERIES`` unpacks, with no fuzz. A series' tree that
is not unpacked is fetched (``ksource.fetch_source``, what ``kph kernel fetch`` runs); if
that fails the test fails and names the command: it never passes without the tree.
"""
from __future__ import annotations

import os
import re
import subprocess
import tomllib
from functools import cache
from pathlib import Path

import pytest

from harness.errors import SetupError
from harness.machine.image import ksource

BUGS = Path(__file__).resolve().parents[2] / "probes" / "bugs"
SERIES = {"6.12", "7.3"}
KINDS = {"kprobe", "uprobe", "fprobe", "eprobe", "tprobe", "kprobes-core", "kretprobe",
         "rethook", "fetch", "dynevent"}
EFFECTS = {"wrong value", "wrong acceptance", "wrong errno", "wrong count", "kernel warning",
           "oops", "hang", "stale state"}
HEX = re.compile(r"[0-9a-f]{12,40}")


def _entries() -> list[tuple[str, dict]]:
    return [(p.stem, tomllib.loads(p.read_text())) for p in sorted(BUGS.glob("*.toml"))]


ENTRIES = _entries()


@cache
def tree(series: str) -> Path:
    """Debian's unpacked ``linux-source-<series>`` (the newest one in the cache), fetched
    if there is none."""
    have = ksource.unpacked_sources(series)
    if have:
        return have[-1]
    try:
        return ksource.fetch_source(series)
    except SetupError as e:
        pytest.fail(f"no Debian {series} tree in {ksource.sources_dir()} and fetching it failed "
                    f"({e}): run `kph kernel fetch {series}`")


def test_the_corpus_has_enough_entries_across_enough_kinds():
    assert len(ENTRIES) >= 12, [n for n, _ in ENTRIES]
    # an entry no probe line can show (visible = false, with why) is kept, not counted
    assert len([n for n, m in ENTRIES if m.get("visible", True)]) >= 12
    assert len({m["kind"] for _, m in ENTRIES}) >= 4
    # every toml has its patch and every patch its toml
    assert {p.stem for p in BUGS.glob("*.patch")} == {n for n, _ in ENTRIES}


@pytest.mark.parametrize("name,meta", ENTRIES, ids=[n for n, _ in ENTRIES])
def test_an_entry_has_its_metadata(name, meta):
    assert meta["name"] == name
    assert meta["patch"] == f"{name}.patch" and (BUGS / meta["patch"]).is_file()
    assert meta["series"] and set(meta["series"]) <= SERIES, meta["series"]
    assert len(set(meta["series"])) == len(meta["series"])
    assert meta["kind"] in KINDS and meta["kind"] in meta["kinds"]
    assert set(meta["kinds"]) <= KINDS, meta["kinds"]
    assert meta["effect"] in EFFECTS, meta["effect"]
    assert len(meta["effect_detail"]) > 40
    assert isinstance(meta["needs"], str)
    assert isinstance(meta.get("visible", True), bool)
    for req in meta.get("requires", []):      # what bench/recall.py checks on the build
        what, _, arg = req.partition(":")
        assert (what, bool(arg)) in {("config", True), ("cpus", True), ("cmdline", True)}, req
    assert meta.get("visible", True) or len(meta.get("invisible_why", "")) > 80
    fix = meta["fix"]
    assert HEX.fullmatch(fix["commit"]), fix["commit"]
    assert fix["title"] and fix["date"][:4].isdigit()
    assert "author" in fix
    fixes = meta["fixes"]
    assert fixes["commit"] == "" or HEX.fullmatch(fixes["commit"]), fixes["commit"]
    assert fixes["title"]
    rev = meta["reverse"]
    assert rev["touches"] and all(re.fullmatch(r"[\w./-]+\.[ch]:\w+", t) for t in rev["touches"])
    assert isinstance(rev["by_hand"], bool) and rev["how"] and rev["fix_present"]


@pytest.mark.parametrize("name,meta", ENTRIES, ids=[n for n, _ in ENTRIES])
def test_a_patch_touches_only_the_files_its_metadata_names(name, meta):
    patch = BUGS / meta["patch"]
    assert ksource.check_patches([patch]) == [patch.resolve()]
    files = set(ksource.patch_targets(patch, patch.read_text()))
    assert files == {t.split(":")[0] for t in meta["reverse"]["touches"]}


CASES = [(n, s) for n, m in ENTRIES for s in m["series"]]


@pytest.mark.parametrize("name,series", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_a_patch_applies_to_each_series_it_names(name, series):
    """No fuzz, as ``kph image build`` applies it (``--forward --batch``), dry run: the
    unpacked tree is never changed."""
    src = tree(series)
    proc = subprocess.run(["patch", "-p1", "--forward", "--batch", "--dry-run", "--fuzz=0",
                           "-d", str(src), "-i", str(BUGS / f"{name}.patch")],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LC_ALL": "C"})
    assert proc.returncode == 0, f"{name}.patch on {src.name}:\n{proc.stdout}{proc.stderr}"


def test_the_recall_bench_says_which_requirement_a_build_cannot_meet(tmp_path):
    """bench/recall.py: an entry whose build lacks what the hunt needs to show it is "not
    run" with the reason (and counted as not found), checked on the built image."""
    import importlib.util
    from types import SimpleNamespace

    spec = importlib.util.spec_from_file_location(
        "recall_bench", Path(__file__).resolve().parents[2] / "bench" / "recall.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    (tmp_path / "config").write_text("CONFIG_SMP=y\n# CONFIG_SECURITY is not set\n")
    img = SimpleNamespace(dir=tmp_path)
    lockdown = {"requires": ["config:CONFIG_SECURITY_LOCKDOWN_LSM", "cmdline:lockdown="]}
    assert bench.unmet(lockdown, img) == "the build has no CONFIG_SECURITY_LOCKDOWN_LSM=y"
    (tmp_path / "config").write_text("CONFIG_SECURITY_LOCKDOWN_LSM=y\n")
    assert "lockdown=" in bench.unmet(lockdown, img)
    assert bench.unmet({"requires": ["config:CONFIG_SECURITY_LOCKDOWN_LSM"]}, img) == ""
    assert bench.unmet({}, img) == ""
