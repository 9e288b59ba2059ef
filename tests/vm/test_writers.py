"""``kph diff --refusals --writers N`` on the default image with two CPUs: refused lines
written by several writers at once leave only the lines' own error_log entries (the
kernel parses one command at a time: kernel/trace/trace_dynevent.c dyn_event_ops_mutex);
the bad-input cases need no guest."""
import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(180)]

LINES = ["p:kph/ra vfs_read a=%zz", "p:kph/rb do_sys_openat2 b=+0(%di):zz",
         "p:kph/rc /bin/sh:0x10 c=$zz"]


def kph(*args, timeout=150):
    return subprocess.run([sys.executable, "-m", "harness.cli", "diff", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_refused_lines_from_four_writers_on_two_cpus_log_only_their_own_entries():
    r = kph("--refusals", "--smp", "2", "--writers", "4", "--run", "true", "--json", "--",
            *LINES)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    rows = doc["refusals"]
    assert len(rows) == len(LINES) + 1 and all(row["agrees"] for row in rows), rows
    assert "from 4 writers at once" in rows[-1]["line"]


@pytest.mark.parametrize("args, word", [
    (["--writers", "3", "--run", "true", "p:a vfs_read"], "--refusals"),
    (["--refusals", "--writers", "0", "--run", "true", "p:a vfs_read x=%zz"], "no writer"),
])
def test_writers_need_refusals_and_one_writer_at_least(args, word):
    r = kph(*args, timeout=60)
    assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
