"""Every example of README.md and docs/*.md, run as written (tests/docexamples.py says what
an example is and how each kind runs). VM examples boot the default image.

One test per fenced block, named ``FILE:LINE``. A block marked ``*Not run by the docs
test: REASON*`` is reported as skipped with its reason (tests/unit/test_docs.py checks
that every such mark gives one).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import docexamples as dx  # noqa: E402

pytestmark = [pytest.mark.vm, pytest.mark.slow]
EXAMPLES = dx.examples()
TIMEOUT = 900


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("ex", EXAMPLES, ids=[e.id for e in EXAMPLES])
def test_example_runs_as_written(ex, tmp_path):
    if ex.skip:
        pytest.skip(f"not run by the docs test: {ex.skip}")
    cwd = dx.scratch(tmp_path)
    if ex.lang == "sh":
        r = dx.run_plain(["bash", "-e", "-o", "pipefail", "-c", ex.code], cwd, TIMEOUT)
        assert r.returncode == 0, f"{ex.id}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
    elif ex.lang == "python":
        if ex.is_pytest:
            (cwd / "test_example.py").write_text(ex.code)
            argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "test_example.py"]
        else:
            (cwd / "example.py").write_text(ex.code)
            argv = [sys.executable, "example.py"]
        r = dx.run_plain(argv, cwd, TIMEOUT)
        assert r.returncode == 0, f"{ex.id}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    else:
        assert ex.lang == "console" and ex.steps, ex
        for cmd, expected in ex.steps:
            status, shown = dx.run_in_terminal(cmd, cwd, TIMEOUT)
            assert "Traceback" not in shown, shown
            assert dx.matches(expected, shown), (
                f"{ex.id}: `{cmd}` (exit {status}) showed:\n{shown}\n--- the docs show:\n{expected}")
