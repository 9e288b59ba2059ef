"""A pytest the suite starts (a docs example's too) keeps its temporary directories under
the starting worker's own (tests/conftest.py: ``_nested_pytest_temproot``), so its
end-of-session cleanup never walks the directories earlier runs left in
``/tmp/pytest-of-USER`` (the CI of cd8eca6: the watchdog test's inner run spent its 150 s
deleting an old kernel tree there)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INNER = '''
def test_where(tmp_path):
    print("INNER_TMP", tmp_path)
'''


def test_a_nested_pytest_s_temporary_directories_are_under_this_worker_s(tmp_path,
                                                                         tmp_path_factory):
    (tmp_path / "test_where.py").write_text(INNER)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                        "-c", os.devnull, "--rootdir", str(tmp_path), "test_where.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    inner = Path(next(line.split(None, 1)[1] for line in r.stdout.splitlines()
                      if line.startswith("INNER_TMP")))
    mine = tmp_path_factory.getbasetemp().resolve()
    assert inner.resolve().is_relative_to(mine), (inner, mine)


def test_a_docs_example_s_pytest_keeps_them_there_too(tmp_path, tmp_path_factory):
    """The docs examples run in an environment of their own (tests/docexamples.py drops
    the suite's ``PYTEST_*`` variables) which keeps ``PYTEST_DEBUG_TEMPROOT``: without it,
    docs/plugin.md's ``pytest tests/vm/test_differential_suite.py ...`` took 222 s, its
    tests 4 s of them, deleting the earlier run's directories (CI's way, 2026-12-01)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import docexamples as dx

    (tmp_path / "test_where.py").write_text(INNER)
    r = dx.run_plain([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
                      "-c", os.devnull, "--rootdir", str(tmp_path), "test_where.py"],
                     tmp_path, 120)
    assert r.returncode == 0, r.stdout + r.stderr
    inner = Path(next(line.split(None, 1)[1] for line in r.stdout.splitlines()
                      if line.startswith("INNER_TMP")))
    mine = tmp_path_factory.getbasetemp().resolve()
    assert inner.resolve().is_relative_to(mine), (inner, mine)
