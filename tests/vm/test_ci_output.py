"""KTAP and KCIDB out of real runs (docs/ci.md): ``kph diff --ktap`` and a one-kernel
``kph matrix --ktap-file`` on the default image, read by the kernel's own KTAP parser
(tools/testing/kunit/kunit_parser.py of linux-source-6.12: fetched when the cache lacks
it, never skipped), its counts those of kph's own JSON verdict; the KCIDB document
validated by kcidb-io. Matrix KTAP on several kernels is covered on recorded results by
tests/unit/test_ktap.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kunit_tool  # noqa: E402

pytestmark = [pytest.mark.vm, pytest.mark.timeout(300)]

#: open fires and matches; do_int3 is refused on both sides (blacklisted); vfs_read has no
#: hit under busybox cat (it reads through sendfile): one each of pass, pass, skip
SPECS = ["p:open do_sys_openat2 dfd=%di:s32", "p:bl do_int3", "p:rd vfs_read"]


def kph(*args, cwd):
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], capture_output=True,
                          text=True, timeout=240, stdin=subprocess.DEVNULL, cwd=cwd)


def test_diff_ktap_is_counted_by_the_kernel_s_parser_as_kph_decided(tmp_path):
    kunit_tool.parser()                         # the tree first: a missing one fails here
    r = kph("diff", *SPECS, "--run", "cat /proc/version", "--ktap", "-o", "d.json",
            "--kcidb", "k.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["result"] == "equivalent"
    main = kunit_tool.parse(r.stdout)           # stdout is the KTAP document, alone
    c = main.counts
    lines = len(doc["counts"]) + len(doc["both_refused"])
    assert (c.passed, c.failed, c.skipped, c.crashed, c.errors) == (
        lines - len(doc["silent"]), 0, len(doc["silent"]), 0, 0), r.stdout
    assert main.status.name == "SUCCESS"        # exit 0
    assert [t.name for t in main.subtests] == ["kprobes/open", "kprobes/bl", "kprobes/rd"]
    assert "ok 3 kprobes/rd # SKIP no hit on either side" in r.stdout

    from kcidb_io import schema
    kc = json.loads((tmp_path / "k.json").read_text())
    schema.LATEST.validate(kc)
    assert [t["status"] for t in kc["tests"]] == ["PASS", "PASS", "SKIP"]
    (build,) = kc["builds"]
    assert build["id"].startswith("kph:6.1.") and all(t["build_id"] == build["id"]
                                                      for t in kc["tests"])


def test_one_kernel_matrix_ktap_file(tmp_path):
    kunit_tool.parser()
    r = kph("matrix", *SPECS, "--run", "cat /proc/version", "--kernels", "6.1",
            "--ktap-file", "m.ktap", "-o", "m.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = (tmp_path / "m.ktap").read_text()
    doc = json.loads((tmp_path / "m.json").read_text())
    (k,) = doc["kernels"]
    assert k["equivalent"] and r.stdout == ""
    main = kunit_tool.parse(text)
    assert [t.name for t in main.subtests] == ["6.1"]
    (kernel,) = main.subtests
    assert [(t.name, t.status.name) for t in kernel.subtests] == [
        ("kprobes/open", "SUCCESS"), ("kprobes/bl", "SUCCESS"), ("kprobes/rd", "SKIPPED")]
    assert (main.counts.passed, main.counts.failed, main.counts.skipped) == (2, 0, 1)
    assert main.status.name == "SUCCESS"
