"""``kph bisect``'s input checks (harness.apps.bisect.check_tree, resolve): each bad tree
or revision is one line and exit 2, before anything is built. The search itself runs on a
real kernel in tests/vm/test_bisect.py."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.apps import bisect
from harness.cli.main import main
from harness.errors import HarnessError, SetupError

SCENARIO = str(Path(__file__).resolve().parents[2] / "probes/scenarios/upstream/btf-char-ptr.toml")


def _git(tree: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(tree), "-c", "user.name=T", "-c",
                           "user.email=t@example.org", *args], check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.fixture
def tree(tmp_path):
    """A tree that looks like a kernel's (Makefile, Kconfig, arch/x86), not a git one."""
    t = tmp_path / "linux"
    (t / "arch/x86").mkdir(parents=True)
    (t / "Makefile").write_text("VERSION = 6\n")
    (t / "Kconfig").write_text("")
    return t


@pytest.fixture
def history(tree):
    _git(tree, "init", "-q")
    for i in range(3):
        (tree / "Makefile").write_text(f"VERSION = 6\n# {i}\n")
        _git(tree, "add", "-A")
        _git(tree, "commit", "-q", "-m", f"change {i}")
    return tree


def test_a_tree_without_history_is_named(tree):
    with pytest.raises(SetupError, match="is not a git work tree: kph bisect needs the tree's history"):
        bisect.check_tree(tree)
    _git(tree, "init", "-q")
    _git(tree, "add", "-A")
    _git(tree, "commit", "-q", "-m", "one")
    with pytest.raises(SetupError, match="has one commit and no history"):
        bisect.check_tree(tree)


def test_a_dirty_tree_or_one_bisecting_is_refused(history):
    assert bisect.check_tree(history) == history.resolve()
    (history / "Kconfig").write_text("x\n")
    with pytest.raises(SetupError, match="has uncommitted changes"):
        bisect.check_tree(history)
    _git(history, "checkout", "-q", "--", "Kconfig")
    _git(history, "bisect", "start", "HEAD", "HEAD~2")
    with pytest.raises(SetupError, match="a git bisect is in progress"):
        bisect.check_tree(history)


def test_revisions_are_resolved_or_named(history):
    assert bisect.resolve(history, "HEAD~1", "--good") == _git(history, "rev-parse", "HEAD~1")
    for bad in ("nope", "-x", "HEAD~9"):
        with pytest.raises(SetupError, match=r"--good"):
            bisect.resolve(history, bad, "--good")


@pytest.mark.parametrize("good,bad,says", [
    ("HEAD", "HEAD~2", "is not an ancestor of --bad"),
    ("HEAD", "HEAD", "name the same commit"),
    ("v0", "HEAD", "no such commit"),
])
def test_the_cli_refuses_bad_ends_in_one_line_before_building(history, good, bad, says, capsys,
                                                              tmp_path):
    assert main(["bisect", SCENARIO, "--tree", str(history), "--good", good, "--bad", bad,
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_fixes_line_has_twelve_hex_digits_and_the_title():
    r = bisect.BisectResult("0123456789abcdef0123456789abcdef01234567", "kprobes: Do a thing")
    assert r.fixes_line == 'Fixes: 0123456789ab ("kprobes: Do a thing")'


@pytest.mark.parametrize("met,outcome,verdict", [
    (True, "ok", "bad"), (True, "oops", "bad"), (True, "refused", "bad"),
    (False, "ok", "good"), (False, "refused", "good"),
    (False, "oops", "skip"), (False, "panic", "skip"), (False, "hang", "skip"),
    (False, "lost", "skip")])
def test_a_commit_is_good_only_when_its_run_went_through(met, outcome, verdict):
    """A kernel that crashed or hung in a way the scenario does not describe has not
    shown the bug absent: git bisect's skip, never good."""
    assert bisect.step_verdict(met, outcome) == verdict


def test_a_run_that_could_not_read_a_side_is_an_error_not_a_not_met(tmp_path):
    """The CI run of df5c4ce named the wrong commit: a step judged good had a NOT MET
    that nothing shows was measured. A side whose collection failed (a ring-buffer loss,
    a failed read) makes NOT MET an error naming it; MET still stands."""
    from harness.apps import repro
    from harness.apps.scenario import load
    scn = load(SCENARIO)
    obs = repro.Observed(unmeasured={"events": "the guest's ring buffer lost 3 event(s)"})
    with pytest.raises(HarnessError, match=r"btf-char-ptr.toml: not measured: collecting events "
                       r"failed: the guest's ring buffer lost 3 event\(s\); the evidence is in"):
        repro.check_measured(scn, obs, False, tmp_path)
    repro.check_measured(scn, obs, True, tmp_path)
    repro.check_measured(scn, repro.Observed(), False, tmp_path)


def test_a_failed_collection_is_kept_as_unmeasured():
    from types import SimpleNamespace
    from harness.apps import repro
    from harness.apps.scenario import load
    from harness.errors import GuestLossError

    class Side:
        def disable(self): pass

        def collect(self):
            raise GuestLossError("events", 3, "the guest's ring buffer lost 3 event(s)")

        def counters(self): return {}
    vm = SimpleNamespace(run=lambda cmd, **kw: SimpleNamespace(stdout=""))
    r = repro._Run(load(SCENARIO), vm)
    r.backends["events"] = Side()
    r.collect()
    assert r.obs.unmeasured == {"events": "events: the guest's ring buffer lost 3 event(s); "
                                          "the run is not compared"}
    assert "events" not in r.obs.counters
