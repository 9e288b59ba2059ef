"""``kph upstream verify`` on a booted kernel: each finding's series selftest, copied with
the tree's ftracetest into Debian's 6.12 guest, fails there as the bug says it must (the
fix is not in Debian's kernel), read by the tree's own KTAP parser, and the KTAP kph
writes shows it as the known bug (XFAIL). The patched kernels are a kernel build each
(1 to 6 min): their runs are measured in docs/upstream.md, not repeated here."""
from __future__ import annotations

import json

import pytest

from harness.apps.upstream import FINDINGS
from harness.cli.main import main

pytestmark = [pytest.mark.vm, pytest.mark.timeout(900)]


@pytest.mark.parametrize("name", list(FINDINGS))
def test_the_series_selftest_fails_on_the_kernel_with_the_bug(name, tmp_path, capsys):
    out, ktap_file = tmp_path / "v.json", tmp_path / "v.ktap"
    rc = main(["upstream", "verify", name, "--tree", "6.12", "--kernels", "stock",
               "-o", str(out), "--ktap-file", str(ktap_file)])
    doc = json.loads(out.read_text())
    [run] = doc["runs"]
    assert (rc, run["result"], run["ok"], doc["verified"]) == (0, "fail", True, False), doc
    assert "not ok 1 " in run["ktap"]                       # ftracetest's own line
    text = ktap_file.read_text()
    assert f"ok 1 stock # XFAIL known bug: {name}" in text, text
    assert "a verification needs a kernel with the bug and the patched one" in \
        capsys.readouterr().err
