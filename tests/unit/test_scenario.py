import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import ScenarioError
from harness.apps.scenario import load

SCENARIOS = Path(__file__).resolve().parents[2] / "probes" / "scenarios"


def write(tmp_path, text):
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("path", sorted(SCENARIOS.rglob("*.toml")), ids=lambda p: p.stem)
def test_shipped_scenarios_validate(path):
    scn = load(path)
    assert scn.name and scn.trigger and scn.probes


@pytest.mark.parametrize("text,key", [
    ('trigger = "true"\n[expect]\noutcome="ok"\n', "name"),
    ('name="x"\n[expect]\noutcome="ok"\n', "trigger"),
    ('name="x"\ntrigger="true"\n', "expect"),
    ('name="x"\ntrigger="true"\n[expect]\noutcome="boom"\n', "expect.outcome"),
    ('name="x"\ntrigger="true"\n[[probe]]\nside="qemu"\nspec="p:a do_exit"\n[expect]\n', "probe[0].side"),
    ('name="x"\ntrigger="true"\n[[probe]]\nside="host"\nspec="p:a do_exit x=%zz"\n[expect]\n', "probe[0].spec"),
    ('name="x"\ntrigger="true"\n[[probe]]\nside="events"\nsymbol="do_exit"\npre_handler="h.py:f"\n[expect]\n',
     "probe[0].pre_handler"),
    ('name="x"\ntrigger="true"\n[expect]\ncounters=["host:kprobes/a.nhits > 1"]\n', "expect.counters[0]"),
    ('name="x"\ntrigger="true"\n[expect]\nconsole="("\n', "expect.console"),
    ('name="x"\ntrigger="true"\n[timeouts]\ntrigger=-1\n[expect]\n', "timeouts.trigger"),
    ('name="x"\ntrigger="true"\ncolour="red"\n[expect]\n', "colour"),
    ('name="x"\ntrigger="true"\n[machine]\nsmp="two"\n[expect]\n', "machine.smp"),
    ('name="x"\ntrigger="true"\n[kernels]\npatch="fix.patch"\n[expect]\n', "kernels.series"),
    ('name="x"\ntrigger="true"\n[kernels]\nseries="latest"\n[expect]\n', "kernels.series"),
    ('name="x"\ntrigger="true"\n[kernels]\nseries="6.12"\npatch="gone.patch"\n[expect]\n',
     "kernels.patch"),
    ('name="x"\ntrigger="true"\n[kernels]\nseries="6.12"\nimage="x"\n[expect]\n', "kernels.image"),
])
def test_bad_scenarios_name_the_key(tmp_path, text, key):
    with pytest.raises(ScenarioError) as ei:
        load(write(tmp_path, text))
    assert ei.value.key == key, str(ei.value)


def test_not_toml(tmp_path):
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load(write(tmp_path, "name = \n"))


def test_cli_bad_scenario_is_one_line_exit_2(tmp_path):
    p = write(tmp_path, 'name="x"\ntrigger="true"\n[expect]\noutcome="boom"\n')
    r = subprocess.run([sys.executable, "-m", "harness.cli", "repro", str(p)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "expect.outcome" in lines[0], r.stderr


def test_every_upstream_reproducer_names_its_kernels_and_its_fix():
    """probes/scenarios/upstream/: each runs on Debian's binary kernel of its series, a
    build of Debian's source of it, and that build with its patch (kph repro --kernels)."""
    found = sorted((SCENARIOS / "upstream").glob("*.toml"))
    assert len(found) == 3
    for path in found:
        scn = load(path)
        assert scn.kernel_series() == ["6.12", "7.3"], path
        sel = scn.kernel_selectors()
        patch = Path(sel["patched"].split("+", 1)[1])
        assert sel["stock"] == "6.12" and sel["source"] == "tree:6.12", path
        assert sel["patched"].startswith("tree:6.12+") and patch.is_file(), path
        assert patch.parent == SCENARIOS.parent / "patches"
        assert f"scenarios/upstream/{path.name}" in patch.read_text(), path
        # on 7.3 the fix is the exported series' own first patch (the code moved)
        sel = scn.kernel_selectors("7.3")
        patch = Path(sel["patched"].split("+", 1)[1])
        assert sel["stock"] == "7.3" and sel["source"] == "tree:7.3", path
        assert patch.parent == SCENARIOS.parent / "patches" / "upstream" / path.stem / "7.3"
        assert patch.name.startswith("0001-") and patch.is_file(), path


def test_named_kernels_come_from_the_scenario_and_others_pass_through(tmp_path):
    from harness.apps.repro import resolve_kernels
    from harness.errors import HarnessError

    (tmp_path / "fix.patch").write_text("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")
    scn = load(write(tmp_path, 'name="x"\ntrigger="true"\n[kernels]\nseries="6.12"\n'
                               'patch="fix.patch"\n[expect]\n'))
    assert resolve_kernels(scn, ["stock", "source", "patched", "7.3"]) == [
        ("stock", "6.12"), ("source", "tree:6.12"),
        ("patched", f"tree:6.12+{tmp_path / 'fix.patch'}"), ("7.3", "7.3")]
    bare = load(write(tmp_path, 'name="x"\ntrigger="true"\n[expect]\n'))
    with pytest.raises(HarnessError, match="has no \\[kernels\\] patch"):
        resolve_kernels(bare, ["patched"])


def test_kernels_of_another_series_take_that_series_fix(tmp_path):
    """[kernels.patches]: the fix for each other series (kph repro --series)."""
    from harness.apps.repro import resolve_kernels
    from harness.errors import HarnessError

    (tmp_path / "fix.patch").write_text("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")
    (tmp_path / "fix73.patch").write_text("--- a/y\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n")
    scn = load(write(tmp_path, 'name="x"\ntrigger="true"\n[kernels]\nseries="6.12"\n'
                               'patch="fix.patch"\n[kernels.patches]\n"7.3"="fix73.patch"\n'
                               '[expect]\n'))
    assert scn.kernel_series() == ["6.12", "7.3"]
    assert resolve_kernels(scn, ["stock", "source", "patched"], "7.3") == [
        ("stock", "7.3"), ("source", "tree:7.3"), ("patched", f"tree:7.3+{tmp_path / 'fix73.patch'}")]
    assert resolve_kernels(scn, ["patched"], "6.12") == [
        ("patched", f"tree:6.12+{tmp_path / 'fix.patch'}")]
    assert resolve_kernels(scn, ["stock", "source"], "6.1") == [("stock", "6.1"), ("source", "tree:6.1")]
    with pytest.raises(HarnessError, match='has no \\[kernels\\] patches."6.1"'):
        resolve_kernels(scn, ["patched"], "6.1")
    # a fix the table does not name, under a name of one's own
    assert resolve_kernels(scn, ["source", "patched=tree:6.12+/x/0001-fix.patch"]) == [
        ("source", "tree:6.12"), ("patched", "tree:6.12+/x/0001-fix.patch")]
    with pytest.raises(HarnessError, match="NAME=SELECTOR needs a selector"):
        resolve_kernels(scn, ["patched="])
    # a selector whose path holds '=' is a selector, not NAME=SELECTOR
    assert resolve_kernels(scn, ["tree:6.12+/srv/a=b/fix.patch", "/srv/a=b/img"]) == [
        ("tree:6.12+/srv/a=b/fix.patch", "tree:6.12+/srv/a=b/fix.patch"),
        ("/srv/a=b/img", "/srv/a=b/img")]


@pytest.mark.parametrize("table, key", [
    ('[kernels.patches]\n"7.3"="missing.patch"\n', 'kernels.patches."7.3"'),
    ('[kernels.patches]\n"6.12"="fix.patch"\n', 'kernels.patches."6.12"'),
    ('[kernels.patches]\nlatest="fix.patch"\n', 'kernels.patches."latest"'),
    ('patches="fix.patch"\n', "kernels.patches"),
])
def test_a_bad_fix_for_another_series_is_named(tmp_path, table, key):
    (tmp_path / "fix.patch").write_text("--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(ScenarioError) as e:
        load(write(tmp_path, 'name="x"\ntrigger="true"\n[kernels]\nseries="6.12"\n'
                             'patch="fix.patch"\n' + table + '[expect]\n'))
    assert key in str(e.value), str(e.value)


@pytest.mark.parametrize("argv, says", [
    (["--series", "7.3"], "--series 7.3 without --kernels"),
    (["--kernels", "stock", "--series", "seven"], "--series 'seven' is not a series"),
])
def test_cli_series_errors_are_one_line_exit_2(tmp_path, argv, says):
    p = write(tmp_path, 'name="x"\ntrigger="true"\n[expect]\n')
    r = subprocess.run([sys.executable, "-m", "harness.cli", "repro", str(p), *argv],
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr
