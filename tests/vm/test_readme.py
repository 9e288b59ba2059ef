"""The README's first command, verbatim, on a newcomer's machine: a fresh clone of this
repository and an empty ``KPH_CACHE`` (issue 13: a warm cache once hid a deadlock in it).

The clone is of the committed HEAD (uncommitted changes are not in it, as they would not
be in a newcomer's clone). ``$KPH_DOWNLOADS`` is passed through when set: downloaded
.deb files may be shared, nothing derived is (QEMU tree, image, facts, snapshots are
all made afresh in the empty cache).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
FIRST_RESULT_BUDGET = 1500


def readme_commands() -> list[str]:
    """The commands of the README's first screen: its first two ```sh blocks."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.S)
    return [b.strip() for b in blocks[:2]]


def test_the_readme_names_setup_then_the_main_job_then_the_tests():
    first, second = readme_commands()
    assert first.startswith("./setup.sh && .venv/bin/kph diff ")
    assert second == "./setup.sh && .venv/bin/python -m pytest -n 2"
    ci = (ROOT / ".ci/run").read_text()
    assert second in ci, ".ci/run must run the README's test command as written"


@pytest.mark.timeout(FIRST_RESULT_BUDGET + 120)
def test_readme_first_command_from_a_fresh_clone_and_an_empty_cache(tmp_path):
    if not shutil.which("git") or not (ROOT / ".git").exists():
        pytest.fail("this test clones the repository: it needs git and a git checkout")
    clone = tmp_path / "kprobe-harness"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KPH_", "PYTEST_", "VIRTUAL_ENV")) and k != "PYTHONPATH"}
    env.update(KPH_CACHE=str(cache), CI=os.environ.get("CI", "true"))
    if os.environ.get("KPH_DOWNLOADS"):
        env["KPH_DOWNLOADS"] = os.environ["KPH_DOWNLOADS"]
    first = readme_commands()[0]
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-c", first], cwd=clone, env=env, capture_output=True,
                       text=True, timeout=FIRST_RESULT_BUDGET, stdin=subprocess.DEVNULL)
    took = time.monotonic() - t0
    print(f"README first command from an empty cache: {took:.0f} s")
    assert r.returncode == 0, (r.stdout[-3000:] + r.stderr[-3000:])
    assert "result: equivalent" in r.stderr, r.stderr[-3000:]     # text for people: stderr
    assert not (cache / "kernels").exists(), "facts were harvested on demand, not at build"
    # Everything derived is new: nothing came from another cache.
    assert (cache / "qemu" / "qemu.json").exists() and (cache / "default").exists()
