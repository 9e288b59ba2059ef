"""The pytest plugin's session image fixture may build an image in a test's setup (minutes
on a fresh cache); that build is not cut off by the asking test's pytest-timeout, whose
timer starts again in full afterwards (a cut-off build failed every later test of that
kernel on the worker: CI, 2026-11-28)."""
from __future__ import annotations

import subprocess
import sys

CASE = '''
import time

import pytest

from harness.apps.pytest_plugin import _untimed


@pytest.fixture(scope="session")
def built(request):
    with _untimed(request):
        time.sleep(3)           # the build, longer than the test's timeout
    return 1


@pytest.mark.timeout(2)
def test_asks_first(built):
    assert built == 1


@pytest.mark.timeout(2)
def test_its_own_time_is_still_bounded(built):
    time.sleep(4)
'''


def test_an_image_build_in_a_fixture_is_not_cut_off_by_the_asking_test_s_timeout(tmp_path):
    (tmp_path / "test_case.py").write_text(CASE)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        "test_case.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    out = r.stdout + r.stderr
    assert "1 failed, 1 passed" in out, out
    assert "test_its_own_time_is_still_bounded" in out and "Timeout" in out, out
