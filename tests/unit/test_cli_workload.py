"""Every verb that runs a workload fails on one that did not run (exit 126 or 127 from its
shell) as plain ``kph diff`` does: exit 2 with one line, never EMPTY or equivalent
(issue 36: ``kph diff --host both`` and ``kph matrix`` compared such runs)."""
import contextlib
import importlib
from types import SimpleNamespace

import pytest

from harness.errors import SetupError
from harness.records import SideResult

cli_main = importlib.import_module("harness.cli.main")


def test_diff_host_both_fails_on_a_workload_that_did_not_run(monkeypatch, capsys):
    import harness.cli.diff as cdiff
    import harness.diff.worlds as worlds

    @contextlib.contextmanager
    def machine(args):
        yield SimpleNamespace()
    monkeypatch.setattr(cdiff, "machine", machine)
    monkeypatch.setattr(cdiff, "booted", lambda vm, args, out: None)
    runs = tuple(SideResult(s, workload_status=127,
                            workload_stderr="/bin/sh: no_such_cmd: not found\n")
                 for s in ("host", "plugin", "events"))
    monkeypatch.setattr(worlds, "run_three", lambda *a, **k: SimpleNamespace(runs=runs,
                                                                           pairs=()))
    code = cli_main.main(["-q", "diff", "--host", "both", "p:o do_sys_openat2", "--run", "no_such_cmd"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.strip().splitlines() if not ln.startswith("booting")]
    assert len(lines) == 1 and "did not run (exit 127" in lines[0], err


def test_matrix_fails_on_a_workload_that_did_not_run(monkeypatch):
    import harness.diff.runner as runner
    from harness.cli.common import workload_ran

    img = SimpleNamespace(manifest={}, series="6.1", version="6.1.0",
                          facts=SimpleNamespace(rules=SimpleNamespace(series="6.1")),
                          dir=SimpleNamespace(name="6.1"))

    class Boot:
        @staticmethod
        @contextlib.contextmanager
        def boot(img, qemu=None):
            yield SimpleNamespace()
    monkeypatch.setattr(runner, "Machine", Boot)
    monkeypatch.setattr(runner, "default_image", lambda sel: img)
    ran = []

    def differential(vm, specs, workload, **kw):
        ran.append(workload)
        return (SideResult("host", workload_status=126, workload_stderr="sh: permission\n"),
                SideResult("events", workload_status=126))
    monkeypatch.setattr(runner, "run_differential", differential)
    with pytest.raises(SetupError, match=r"did not run \(exit 126: sh: permission\)"):
        runner.run_matrix(["6.1", "6.12"], [], "/tmp/x", build=False,
                          check_run=lambda r: workload_ran(r, "/tmp/x"))
    assert ran == ["/tmp/x"]        # the first kernel ends the matrix
