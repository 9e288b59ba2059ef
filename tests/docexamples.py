"""The examples of README.md and docs/*.md, found and run as a reader would paste them.

Used by tests/vm/test_docs_examples.py (which runs every example) and
tests/unit/test_docs.py (which checks every code block is classified).

What counts as an example, by the language of its fenced block:

- ``sh``: a shell script, run as written with ``bash -e -o pipefail`` (each command must
  succeed), ``kph`` and ``python3`` from this checkout's virtualenv first on PATH;
- ``console``: a transcript. Each ``$ `` line is a command, run in a terminal (a pty, so
  progress is the live line a person sees, and is erased as for them); the lines after it
  are the output the terminal ends up showing, compared line by line, ``...`` standing
  for any text within a line, or for any number of lines on a line of its own;
- ``python``: a script, run with this virtualenv's interpreter; one that defines
  ``test_`` functions is a pytest file and runs under pytest (the ``kprobe_harness``
  plugin is installed);
- ``text`` (output, grammars, layouts), ``toml``, ``json``, ``yaml``: not run.

A block is not run when the paragraph just above it is ``*Not run by the docs test:
REASON*``; the reason must say why (a second machine, waiting for a person, ...).

Every example runs in a scratch directory of its own holding links to the checkout's
``probes/``, ``tests/``, ``docs/``, ``bench/``, ``images/``, ``mkdocs.yml`` and
``pyproject.toml``, so relative paths work as in the checkout and whatever an example
writes (``open.html``, ``kph-runs/``, bundles) lands in the scratch directory.
"""
from __future__ import annotations

import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import fcntl
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = {"sh", "console", "python"}
NOT_RUN = {"text", "toml", "json", "yaml"}
SKIP_RE = re.compile(r"^\*Not run by the docs test: (.+)\*$", re.S)
LINKED = ("probes", "tests", "docs", "bench", "images", "mkdocs.yml", "pyproject.toml")


@dataclass
class Example:
    file: str                  # relative to the checkout
    line: int                  # of the opening fence
    lang: str
    code: str
    skip: str | None = None    # why it is not run
    steps: list[tuple[str, str]] = field(default_factory=list)   # console: (command, output)

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def is_pytest(self) -> bool:
        return self.lang == "python" and re.search(r"^def test_", self.code, re.M) is not None


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(path: Path) -> list[Example]:
    """Every fenced block of ``path`` (an unknown or missing language is kept as is, for
    tests/unit/test_docs.py to refuse)."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        code = "\n".join(lines[start + 1:j]) + "\n"
        k = start - 1                              # the paragraph just above the fence
        while k >= 0 and not lines[k].strip():
            k -= 1
        para = []
        while k >= 0 and lines[k].strip():
            para.insert(0, lines[k].strip())
            k -= 1
        sk = SKIP_RE.match(" ".join(para))
        ex = Example(str(path.relative_to(ROOT)), start + 1, lang, code,
                     sk.group(1).strip() if sk else None)
        if lang == "console":
            ex.steps = _transcript(code)
        out.append(ex)
        i = j + 1
    return out


def _transcript(code: str) -> list[tuple[str, str]]:
    steps: list[tuple[str, list[str]]] = []
    for ln in code.splitlines():
        if ln.startswith("$ "):
            steps.append((ln[2:], []))
        elif steps:
            steps[-1][1].append(ln)
        elif ln.strip():
            raise ValueError(f"a console block must start with a '$ ' command: {ln!r}")
    return [(c, "\n".join(o)) for c, o in steps]


def examples() -> list[Example]:
    return [b for f in doc_files() for b in blocks(f) if b.lang in RUN]


# -- running ---------------------------------------------------------------------------------

def scratch(tmp: Path) -> Path:
    for name in LINKED:
        (tmp / name).symlink_to(ROOT / name)
    return tmp


def environment() -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    # PYTEST_DEBUG_TEMPROOT kept: an example's pytest run makes its temp directories
    # under the suite's own (tests/conftest.py: _nested_pytest_temproot)
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith(("PYTEST_", "COV_")) or k == "PYTEST_DEBUG_TEMPROOT")
           and k != "PYTHONPATH"}
    env.update(PATH=venv_bin + os.pathsep + env.get("PATH", ""),
               VIRTUAL_ENV=str(Path(venv_bin).parent), COLUMNS="200", LINES="50")
    return env


def run_plain(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=environment(), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def run_in_terminal(cmd: str, cwd: Path, timeout: float) -> tuple[int, str]:
    """Run ``cmd`` with bash in a 200x50 pty; return its status and what the terminal
    shows at the end (live lines erased as a terminal erases them)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
    p = subprocess.Popen(["bash", "-c", cmd], cwd=cwd, env=environment(), stdin=slave,
                         stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=30)
                raise TimeoutError(f"{cmd!r} did not end within {timeout:.0f} s")
            r, _, _ = select.select([master], [], [], min(left, 1.0))
            if r:
                try:
                    data = os.read(master, 65536)
                except OSError:          # EIO: every writer closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif p.poll() is not None:
                break
    finally:
        os.close(master)
    status = p.wait(timeout=30)
    return status, screen(b"".join(chunks).decode("utf-8", "replace"))


def screen(raw: str) -> str:
    """What a terminal shows for ``raw``: ``\\r\\x1b[K`` and a bare ``\\r`` start the line
    over; other escape sequences leave no text."""
    out = []
    for ln in raw.replace("\r\n", "\n").split("\n"):
        ln = ln.split("\r")[-1] if "\r" in ln else ln
        out.append(re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", ln).rstrip())
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def matches(expected: str, actual: str) -> bool:
    """``expected`` with ``...`` wildcards (within a line; or any number of lines on a
    line of its own) against ``actual``, line by line, trailing spaces ignored."""
    parts = []
    for ln in expected.rstrip("\n").splitlines():
        if ln.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(re.escape(ln.rstrip()).replace(r"\.\.\.", r"[^\n]*?") + r"\n")
    return re.fullmatch("".join(parts), actual.rstrip("\n") + "\n") is not None
