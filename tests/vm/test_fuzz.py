"""kph fuzz in the default suite (issue 20): every regression case it found is replayed,
and a small seeded budget runs; both must show no divergence."""
from __future__ import annotations

import subprocess
import sys

import pytest

from harness.apps import fuzz

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]

CASES = fuzz.read_regressions()


@pytest.fixture(scope="module")
def oracle(default_image):
    from harness.vmctl import Machine

    with Machine.boot(default_image) as vm:
        yield fuzz.Oracle(vm)


@pytest.fixture(scope="module")
def oracles(oracle):
    """An oracle per kernel a case names (``# kernel: 6.12``), booted on first use."""
    import contextlib

    from harness.machine.image.build import build_image
    from harness.vmctl import Machine

    made = {None: oracle}
    with contextlib.ExitStack() as stack:
        def get(series):
            if series not in made:
                img = build_image(kernel=series, progress=lambda s: None)
                made[series] = fuzz.Oracle(stack.enter_context(Machine.boot(img)))
            return made[series]
        yield get


@pytest.mark.parametrize("name,lines", CASES, ids=[c[0] for c in CASES])
def test_regression_case_agrees(oracles, name, lines):
    """The case agrees, and it ran: a case the oracle skips (not mirrored) fails."""
    kernel = fuzz.regression_kernel(name)
    o = oracles(kernel)
    st = o.stats
    before = (st.not_mirrored, st.agreed_runs + st.agreed_refusals)
    f = o.judge(lines)
    assert f is None, (f"{name}: {f.kind}: {f.detail}\n"
                       f"{fuzz.repro_line(f, image=kernel)}")
    assert st.not_mirrored == before[0], f"{name}: ran nothing (a construct not mirrored)"
    assert st.agreed_runs + st.agreed_refusals == before[1] + 1, f"{name}: ran nothing"


def test_the_symbol_pool_holds_the_functions_the_workload_calls(oracle, tmp_path, monkeypatch):
    """A fresh pass (its own cache), not one name: the function tracer's buffer is read
    before the tracer goes back to nop, which empties it."""
    monkeypatch.setenv("KPH_CACHE", str(tmp_path))
    pool = fuzz.symbol_pool(oracle.vm, fuzz.DEFAULT_WORKLOAD)
    assert len(pool) >= 50, pool
    assert {"vfs_read", "ksys_read", "do_sys_openat2", "kernel_clone"} & set(pool), pool[-40:]
    assert fuzz.symbol_pool(oracle.vm, fuzz.DEFAULT_WORKLOAD) == pool    # cached


def test_a_seeded_budget_finds_nothing(oracle):
    st = fuzz.run(oracle.vm, examples=30, seed=20261125, database=False)
    assert st.examples >= 30
    assert st.agreed_runs + st.agreed_refusals + sum(st.known.values()) >= 30
    assert not st.findings, "\n".join(f"{f.kind}: {f.detail.splitlines()[0]}\n  "
                                      f"{fuzz.repro_line(f)}" for f in st.findings)
    assert st.agreed_runs >= 10, "most examples must reach both sides"


def test_the_same_seed_lists_the_same_examples_and_bad_input_is_one_line():
    import json

    r1 = subprocess.run([sys.executable, "-m", "harness.cli", "fuzz", "--list", "--examples",
                         "12", "--seed", "5", "--json"], capture_output=True, text=True, timeout=300)
    r2 = subprocess.run([sys.executable, "-m", "harness.cli", "fuzz", "--list", "--examples",
                         "12", "--seed", "5", "--json"], capture_output=True, text=True, timeout=300)
    assert r1.returncode == 0 and r1.stdout == r2.stdout
    assert len(json.loads(r1.stdout)["examples"]) == 12
    for bad in (["--examples", "0"], ["--seed", "x"], ["--image", "5.4"], ["-n", "0"]):
        r = subprocess.run([sys.executable, "-m", "harness.cli", "fuzz", *bad],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (bad, r.stderr)


def test_workers_shard_the_examples_and_report_progress(tmp_path):
    """``kph fuzz -n 2``: two pytest-xdist workers, each on its own machine, share the
    examples; the merged result counts all of them and progress reaches stderr."""
    import json

    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "harness.cli", "fuzz", "-n", "2", "--examples",
                        "6", "--seed", "3", "--json", "--out", str(out)],
                       capture_output=True, text=True, timeout=540)
    assert r.returncode in (0, 1), r.stderr[-2000:]
    doc = json.loads(r.stdout)
    # A finding is replayed (and shrunk) by Hypothesis, and every replay is a run the
    # oracle judged: counted (a loaded machine can make a timing finding of one example).
    ran = sum(json.loads((out / f"shard-{i}.json").read_text())["examples"] for i in (0, 1))
    assert doc["examples"] == ran and doc["config"]["workers"] == 2
    assert ran == 6 if not doc["findings"] else ran >= 6, (ran, doc["findings"])
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-0.json", "shard-1.json"]
    assert json.loads((out / "findings.json").read_text())["examples"] == ran
    assert "fuzz: 6 examples on" in r.stderr
