"""The pytest side of ``kph fuzz -n W``: one test per shard, spread by pytest-xdist.

``kph fuzz`` writes its configuration to a JSON file and names it in ``$KPH_FUZZ_CONFIG``;
shard ``i`` of ``W`` boots its own machine, fuzzes its share of the examples with seed
``seed * 1000 + i`` (so a seed and a worker count give the same examples every time) and
writes its stats and findings to ``<out>/shard-<i>.json``, which ``kph fuzz`` merges; while
it runs, ``<out>/shard-<i>.progress`` holds its count, which ``kph fuzz`` shows.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


def _config() -> dict:
    path = os.environ.get("KPH_FUZZ_CONFIG")
    if not path:
        pytest.skip("run by kph fuzz (KPH_FUZZ_CONFIG names its configuration)")
    return json.loads(Path(path).read_text())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "shard" in metafunc.fixturenames:
        path = os.environ.get("KPH_FUZZ_CONFIG")
        n = json.loads(Path(path).read_text())["workers"] if path else 1
        metafunc.parametrize("shard", range(n))


def test_shard(shard: int) -> None:
    from harness.apps import fuzz
    from harness.vmctl import Machine

    cfg = _config()
    n, total = cfg["workers"], cfg["examples"]
    mine = total // n + (1 if shard < total % n else 0)
    budget = cfg.get("time_budget")
    beat = Path(cfg["out"], f"shard-{shard}.progress")

    def tick(st: fuzz.FuzzStats) -> None:
        # what kph fuzz shows while the shards run: replaced whole, never half-written
        tmp = beat.with_suffix(".tmp")
        tmp.write_text(json.dumps({"examples": st.examples, "findings": len(st.findings)}))
        os.replace(tmp, beat)

    vm = Machine.boot(cfg.get("image"), host=cfg["host"])
    try:
        st = fuzz.run(vm, examples=mine, seed=cfg["seed"] * 1000 + shard, guest=cfg["guest"],
                      workload=cfg["workload"], time_budget=budget, tick=tick,
                      reboot=lambda: Machine.boot(cfg.get("image"), host=cfg["host"]),
                      mix=cfg.get("mix", "all"))
        vm = st.vm
    finally:
        vm.close()
    Path(cfg["out"], f"shard-{shard}.json").write_text(json.dumps({
        "examples": st.examples, "seconds": st.seconds, "agreed_runs": st.agreed_runs,
        "agreed_refusals": st.agreed_refusals, "not_mirrored": st.not_mirrored,
        "not_mirrored_why": st.not_mirrored_why, "slowed": st.slowed,
        "events": st.events, "findings": [f.as_dict() for f in st.findings]}))
