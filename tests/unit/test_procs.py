"""Run directories: made private with an owner, reaped once their owner is gone."""
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from harness import procs


@pytest.fixture
def short_tmp():
    d = tempfile.mkdtemp(prefix="kt", dir="/tmp")   # room for socket paths inside
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def test_run_dir_is_private_and_names_its_owner(short_tmp, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short_tmp))
    d = procs.make_run_dir("kph-test-1")
    assert d.parent == short_tmp and d.name.startswith("kph-test-1.")
    assert os.stat(d).st_mode & 0o777 == 0o700
    pid, started = (d / "owner").read_text().split()
    assert int(pid) == os.getpid() and started == procs.start_time(os.getpid())
    procs.listen_unix(d / "qmp.sock").close()


def test_a_runtime_dir_too_deep_for_socket_paths_is_passed_over(tmp_path, monkeypatch):
    deep = tmp_path / ("x" * 60)
    deep.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
    d = procs.make_run_dir("kph-gw0-123456-1")
    try:
        assert d.parent != deep
        procs.listen_unix(d / "qmp.sock").close()     # AF_UNIX path too long, before
    finally:
        shutil.rmtree(d)


def test_reap_removes_only_dirs_of_dead_owners(short_tmp, monkeypatch):
    tmp_path = short_tmp
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    mine = procs.make_run_dir("kph-mine")
    child = subprocess.Popen(["true"])
    child.wait()
    dead = tmp_path / "kph-dead.x"
    dead.mkdir()
    (dead / "owner").write_text(f"{child.pid} {123}\n")
    reused = tmp_path / "kph-reused.x"          # a live pid, but not the process that made it
    reused.mkdir()
    (reused / "owner").write_text(f"{os.getpid()} 1\n")
    foreign = tmp_path / "kph-no-owner.x"       # not made by make_run_dir: left alone
    foreign.mkdir()
    other = tmp_path / "other.x"
    other.mkdir()
    (other / "owner").write_text("1 1\n")
    removed = [p for p in procs.reap_stale_run_dirs() if p.parent == tmp_path]
    assert sorted(p.name for p in removed) == ["kph-dead.x", "kph-reused.x"]
    assert mine.exists() and foreign.exists() and other.exists()


def test_a_zombie_counts_as_gone():
    child = subprocess.Popen(["true"])
    import time
    deadline = time.monotonic() + 5
    while procs.start_time(child.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert procs.start_time(child.pid) is None   # exited, not yet waited for: a zombie
    child.wait()
