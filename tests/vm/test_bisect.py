"""``kph bisect`` (issue 38) on a planted history: the git copy of Debian's 6.12 source,
finding 2's fix (the good end), an unrelated change, the commit that undoes the fix
(planted), another unrelated change (the bad end). kph bisect runs both ends, then
``git bisect run`` with a build, one boot and the scenario per step, and must name the
planted commit as the Fixes: line, leaving the tree at the commit it had.

Finding 2 (non-unique-symbol-errno), not finding 1: finding 1's line shows its bug only
where BTF type id 8 is an unsigned 8-bit integer, which in a small build depends on
pahole's unreproducible ``-j`` order (CI's run of 679dec3: the bad end refused the line);
finding 2's depends only on c_start being a static function of several files.

The first build is a whole kernel (both CPUs for ~4-10 min); the other three are
incremental (one file recompiled, the kernel relinked). Not ``alone``: its single-threaded
phases (unpacking, planting, linking, pahole, boots) would leave a CPU idle, and the
other worker's tests are not timing-sensitive (CI's run of 79c6101 spent 22 minutes with
one worker held off by the alone tests); ``kbuild`` schedules it first."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.apps import bisect

pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.kbuild, pytest.mark.timeout(2700)]

ROOT = Path(__file__).resolve().parents[2]
FINDING = "non-unique-symbol-errno"
SCENARIO = ROOT / f"probes/scenarios/upstream/{FINDING}.toml"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """The planted history, its commits authored by a git identity of the test's own
    (never the user's): git's global config is a file of the test's (GIT_CONFIG_GLOBAL),
    HOME stays, so kph's cache (~/.cache/kprobe-harness without KPH_CACHE) is the one
    every other test uses."""
    cfg = tmp_path_factory.mktemp("git") / "gitconfig"
    cfg.write_text("[user]\n\tname = Bisect Test\n\temail = bisect@example.org\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GIT_CONFIG_GLOBAL", str(cfg))
        yield bisect.plant_history(tmp_path_factory.mktemp("tree") / "linux",
                                   finding=FINDING, series="6.12")


def test_a_good_end_after_the_bad_one_is_refused_before_any_build(planted, tmp_path):
    r = subprocess.run([sys.executable, "-m", "harness.cli", "bisect", str(SCENARIO),
                        "--tree", str(planted.tree), "--good", planted.bad, "--bad", planted.good,
                        "--out", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [
        f"error: --good {planted.bad} is not an ancestor of --bad {planted.good}; give the "
        "older, good commit as --good"], r.stderr[-2000:]
    assert not (tmp_path / "out" / "steps.jsonl").exists()


def test_kph_bisect_names_the_planted_commit_as_the_fixes_line(planted, tmp_path):
    h = planted
    assert len(h.commits) == 4 and h.commits[2] == h.planted
    r = subprocess.run([sys.executable, "-m", "harness.cli", "bisect", str(SCENARIO),
                        "--tree", str(h.tree), "--good", h.good, "--bad", h.bad,
                        "--out", str(tmp_path / "out"), "--json"],
                       capture_output=True, text=True, timeout=2600)
    assert r.returncode == 0, r.stderr[-4000:]
    doc = json.loads(r.stdout)
    assert doc["first_bad"] == h.planted, [(s["role"], s["commit"][:12], s["verdict"], s["cause"])
                                           for s in doc["steps"]]
    assert h.title == 'tracing/kprobes: Take back "Fix the errno of a missing or non-unique symbol"'
    assert doc["fixes"] == f'Fixes: {h.planted[:12]} ("{h.title}")'
    roles = [s["role"] for s in doc["steps"]]
    assert roles[:2] == ["bad end", "good end"] and all(x.startswith("step") for x in roles[2:])
    verdict = {s["commit"]: s["verdict"] for s in doc["steps"]}
    assert verdict[h.bad] == "bad" and verdict[h.good] == "good"
    assert verdict.get(h.planted) == "bad"      # git bisect must have judged it itself
    # every step's kernel built from the one build directory: the later builds incremental
    assert all(s["kernel"].startswith("6.12.") for s in doc["steps"])
    first, later = doc["steps"][0]["build_s"], [s["build_s"] for s in doc["steps"][1:]]
    assert max(later) < first, doc["steps"]
    # the tree is back where it was, no bisect left in it
    head = subprocess.run(["git", "-C", str(h.tree), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert head == h.bad
    assert not (h.tree / ".git" / "BISECT_START").exists()
    assert (tmp_path / "out" / "bisect.log").read_text().count("# first bad commit") == 1
    assert f"first bad commit: {h.planted}" in r.stderr
