"""The oracle's mutation score in the suite (issue 25): the catalogue of
``bench/oracle_mutants.py``, each mutant injected into each host engine it applies to,
each judged by a real ``kph diff`` on the booted default kernel. A mutant that ends
"equivalent" (exit 0) is a bug in the oracle. The unmutated probe sets must be
equivalent first, or a kill means nothing."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vm, pytest.mark.timeout(180)]

_PATH = Path(__file__).resolve().parents[2] / "bench" / "oracle_mutants.py"
_spec = importlib.util.spec_from_file_location("oracle_mutants", _PATH)
om = importlib.util.module_from_spec(_spec)
sys.modules["oracle_mutants"] = om          # dataclasses look their module up there
_spec.loader.exec_module(om)

CASES = [(e, m) for e in ("gdbstub", "plugin") for m in om.MUTANTS if e in m.engines]


def test_the_catalogue_has_at_least_30_classes():
    assert len({m.name for m in om.MUTANTS}) >= 30
    assert {m.name for m in om.MUTANTS if m.engines == ("plugin",)} >= {
        "ring-record-dropped", "ring-overflow", "record-truncated", "capture-miss"}


@pytest.mark.parametrize("engine,probes", [(e, p) for e in ("gdbstub", "plugin")
                                           for p in om.PROBE_SETS])
def test_unmutated_probe_sets_are_equivalent(default_image, engine, probes):
    code, line = om.kph_diff(engine, probes)
    assert code == 0, line


@pytest.mark.parametrize("engine,mutant", CASES, ids=[f"{e}-{m.name}" for e, m in CASES])
def test_mutant_is_killed(default_image, engine, mutant):
    o = om.run_mutant(mutant, engine)
    assert o.killed, f"{engine} {mutant.name} ({mutant.what}) survived: {o.line}"
