"""The documentation builds (mkdocs, warnings as errors), the README is a front door, and
every code block of README.md and docs/ is either run by tests/vm/test_docs_examples.py or
says why not."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import docexamples as dx  # noqa: E402

ROOT = dx.ROOT


def test_docs_build_strict(tmp_path):
    """What CI builds: ``mkdocs build --strict`` (broken links, pages missing from the nav,
    docstrings mkdocstrings cannot render: all errors). setup.sh installs the ``docs``
    extra."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    assert mkdocs, "mkdocs is not installed: run ./setup.sh (pip install -e '.[test,docs]')"
    r = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING" not in r.stderr, r.stderr
    api = (tmp_path / "site" / "api" / "machine" / "index.html").read_text()
    assert "boot" in api and "Raises" in api       # generated from Machine's docstrings


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for heading in ("## Two commands", "## A five-minute tour", "## Documentation"):
        assert heading in text, heading
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link
    for page in (ROOT / "docs").glob("*.md"):       # every page reachable from the README
        assert f"docs/{page.name}" in text or page.name == "index.md", page.name


def test_every_code_block_is_run_or_says_why_not():
    for f in dx.doc_files():
        for b in dx.blocks(f):
            assert b.lang in dx.RUN | dx.NOT_RUN, f"{b.id}: a block needs a language (sh, " \
                f"console, python, or text for output): {b.lang!r}"
            if b.skip is not None:
                assert b.lang in dx.RUN and len(b.skip) > 20, b.id
            if b.lang == "console":
                assert b.steps, b.id
    ex = dx.examples()
    assert len([e for e in ex if not e.skip]) >= 40
    # Six that need a second machine, a person or real time, and three that build kernels
    # (tests/vm/test_kbuild.py builds one, alone: both CPUs for minutes).
    assert len([e for e in ex if e.skip]) <= 9


def test_every_help_example_is_on_the_cli_page_and_run_there():
    """``kph COMMAND --help`` examples paste and run: each is in docs/cli.md, in a block
    the docs test runs (or in one marked not run, when the example says so itself)."""
    from harness.cli import EXAMPLES

    cli = [b for b in dx.blocks(ROOT / "docs" / "cli.md") if b.lang == "sh"]
    for verb, exs in EXAMPLES.items():
        for ex in exs:
            where = [b for b in cli if ex in b.code.splitlines()]
            assert where, f"{verb}: {ex!r} is not in docs/cli.md"
            assert all((b.skip is None) == ("# not run:" not in ex) for b in where), ex


def test_a_line_that_says_it_is_not_run_is_in_a_block_the_docs_test_does_not_run():
    """A ``# not run:`` comment inside a block the docs test runs is a claim the test
    does not keep (docs/cli.md's ``kph upstream verify --others`` line ran every CI run
    while it said it did not)."""
    wrong = [f"{e.id}: {ln.strip()}" for e in dx.examples() if e.skip is None
             for ln in e.code.splitlines() if "# not run:" in ln]
    assert wrong == []


def test_the_transcript_matcher():
    assert dx.matches("a\n...\nc ... d\n", "a\nx\ny\nc zz d\n")
    assert dx.matches("a\n...\nb\n", "a\nb\n")
    assert not dx.matches("a\nc\n", "a\nb\n")
    assert not dx.matches("a ... z\n", "a b\n")
    assert dx.screen("x\r\x1b[Kbooting\r\x1b[Kresult: ok\r\nnext  \r\n\r\n") == "result: ok\nnext"
