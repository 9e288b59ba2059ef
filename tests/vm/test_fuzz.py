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
    vm = oracle.vm
    pool = fuzz.symbol_pool(vm, fuzz.DEFAULT_WORKLOAD)
    assert len(pool) >= 50, pool
    assert fuzz.symbol_pool(vm, fuzz.DEFAULT_WORKLOAD) == pool    # cached
    # what the pool is for: a probe drawn on it fires when the workload runs. Not a named
    # function (the pool of a ~1,300-function pass is every k-th name, so which names it
    # holds moves with the pass), but every pool function the pass saw called at least 5
    # times outside an interrupt, up to 24 of them spread over the pool
    wl = fuzz.DEFAULT_WORKLOAD
    calls, irq = fuzz.symbol_calls(vm, wl), fuzz.symbol_irq(vm, wl)
    often = [fn for fn in pool if calls.get(fn, 0) >= 5 and fn not in irq]
    picked = often[::max(1, len(often) // 24)][:24]
    assert len(picked) >= 8, (len(often), pool[:20])
    t = "/sys/kernel/tracing"
    lines = "\n".join(f"p:kph_pool/p{i} {fn}" for i, fn in enumerate(picked))
    # a line at a time: the pool may hold a function the kernel refuses (the fuzzer's
    # agreed refusals), and one refused write must not leave the rest unregistered
    vm.run(f"cd {t}; echo > dynamic_events; printf '%s\\n' '{lines}' | while read -r l; do "
           "echo \"$l\" >> kprobe_events 2>/dev/null; done; echo 1 > events/kph_pool/enable",
           check=True, timeout=60)
    try:
        vm.run(fuzz.DEFAULT_WORKLOAD, timeout=60)
        prof = vm.run(f"cat {t}/kprobe_profile", check=True, timeout=30).stdout
    finally:
        vm.run(f"cd {t}; echo 0 > events/kph_pool/enable; echo > dynamic_events", timeout=60)
    nhit = {ln.split()[0]: int(ln.split()[1]) for ln in prof.splitlines() if ln.strip()}
    placed = [(i, fn) for i, fn in enumerate(picked) if f"p{i}" in nhit]
    assert len(placed) >= 8, (picked, prof)
    silent = [fn for i, fn in placed if nhit[f"p{i}"] == 0]
    assert len(silent) <= len(placed) // 4, (silent, placed)


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
    examples; the merged result counts all of them and progress reaches stderr. Their
    pytest keeps its temp directories in one of kph's own, removed after the run: none
    left in the temp root a pytest would use (this worker's: tests/conftest.py) or in the
    run's TMPDIR (a short one of this test's own: the other worker may fuzz meanwhile)."""
    import glob
    import json
    import os
    import shutil
    import tempfile

    nested = os.environ.get("PYTEST_DEBUG_TEMPROOT", "/nonexistent")
    tmpdir = tempfile.mkdtemp(prefix="kf")      # short: UNIX socket paths are made in it

    def temp_dirs() -> set[str]:
        return set(glob.glob(os.path.join(nested, "pytest-of-*", "pytest-*"))
                   + glob.glob(os.path.join(tmpdir, "kph-fuzz-pytest-*")))

    before = temp_dirs()
    out = tmp_path / "run"
    try:
        r = subprocess.run([sys.executable, "-m", "harness.cli", "fuzz", "-n", "2",
                            "--examples", "6", "--seed", "3", "--json", "--out", str(out)],
                           capture_output=True, text=True, timeout=540,
                           env=dict(os.environ, TMPDIR=tmpdir))
        left = temp_dirs() - before
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
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
    assert left == set(), left
