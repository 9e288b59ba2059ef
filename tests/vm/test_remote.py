"""Issue 18: the differential suite across machines on pytest-xdist's SSH gateways.

Only loopback is allowed here, so "another machine" is a private sshd on 127.0.0.1
(``harness.apps.loopback_sshd``: a random port, throwaway keys, stopped by its pid) and a
worker checkout made by ``kph worker prepare`` in a temporary directory with its own,
empty ``KPH_CACHE``: setup.sh, the private QEMU, the image and its snapshot are all made
there afresh, as on a new host. ``prepare`` refuses a checkout with uncommitted changes
(only the commit is sent), so a dirty one is prepared from a commit of its working tree
made in a throwaway clone: the worker runs the code under test either way.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.apps.loopback_sshd import HOST_ALIAS, LoopbackSshd
from harness.procs import lock_file

pytestmark = [pytest.mark.vm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SLICE = "test_differential and 6.1-events and (entry or return or mid-function)"


#: seconds a worker's test waits for the other xdist worker's prepare or test on the
#: shared worker checkout (a prepare is a whole setup.sh: 64-94 s in CI on 12-02)
SHARED_WAIT = 1500.0


def _shared_base(tmp_path_factory) -> Path:
    """Where the prepared worker lives: under xdist, in the run's own temporary directory,
    which both xdist workers share (each one's basetemp is ``<run>/popen-gwN``); else this
    session's."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return base / "remote-worker"


@pytest.fixture(scope="module")
def _prepared(tmp_path_factory):
    """(sshd, the --tx spec of a prepared worker, its KPH_CACHE): the checkout and cache are
    made once a run, by whichever xdist worker asks first, under a lock the other one
    waits on; the other one then reuses them through its own sshd (the tx differs only
    in its ssh_config). Each worker's sshd is its own, stopped at its module's end.

    Why shared: worksteal runs this module's tests on both workers, and each made its own
    worker (a whole setup.sh in an empty cache: 73 s and 64 s in CI's run of 1907e6a,
    94 s and 75 s in 6e6241d's)."""
    base = _shared_base(tmp_path_factory)
    base.mkdir(exist_ok=True)
    sshd = LoopbackSshd()          # its own mkdtemp directory in /tmp: short socket paths
    sshd.start()
    try:
        cache = base / "cache"
        done = base / "prepared.json"
        fd = lock_file(base / "lock", SHARED_WAIT, "the other xdist worker's prepare hangs")
        try:
            if done.is_file():
                tx = json.loads(done.read_text())["tx"]
                old = tx.split("//ssh_config=", 1)[1].split("//", 1)[0]
                tx = tx.replace(f"//ssh_config={old}//", f"//ssh_config={sshd.ssh_config}//")
            else:
                # A whole setup.sh runs here, inside the first test's run lock
                # (tests/conftest.py), so an ``alone`` test does not run beside it.
                r = _prepare(sshd, base, cache)
                assert r.returncode == 0, r.stderr[-3000:]
                tx = json.loads(r.stdout)["tx"]
                done.write_text(json.dumps({"tx": tx}))
        finally:
            os.close(fd)
        yield sshd, tx, cache
    finally:
        sshd.stop()
        import shutil
        shutil.rmtree(sshd.dir, ignore_errors=True)


@pytest.fixture
def worker(_prepared, tmp_path_factory):
    """The prepared worker, this test's alone: the other xdist worker's tests on it wait
    (one kills a worker whose processes it finds by the cache in their environment)."""
    fd = lock_file(_shared_base(tmp_path_factory) / "use.lock", SHARED_WAIT,
                   "the other xdist worker's test on the prepared worker hangs")
    try:
        yield _prepared
    finally:
        os.close(fd)


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                          timeout=120).stdout


def _committed_tree(base: Path) -> Path:
    """ROOT if it has no uncommitted change, else a clone of it whose HEAD is a commit of
    ROOT's working tree (tracked and untracked files git does not ignore). ROOT's own
    index, refs and files are not touched."""
    if not _git("status", "--porcelain", "--untracked-files=no").strip():
        return ROOT
    clone = base / "snapshot"
    _git("clone", "-q", str(ROOT), str(clone))
    for name in _git("ls-files", "-z", "--cached", "--others", "--exclude-standard").split("\0"):
        src, dst = ROOT / name, clone / name
        if not name:
            continue
        if src.is_file() and not src.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
            dst.chmod(src.stat().st_mode & 0o777)
        elif not src.exists() and not src.is_symlink():
            dst.unlink(missing_ok=True)             # deleted in the working tree
    _git("add", "-A", cwd=clone)
    _git("-c", "user.name=kph tests", "-c", "user.email=kph@localhost", "commit", "-q", "-m",
         "the working tree under test", cwd=clone)
    return clone


def _prepare(sshd, base, cache):
    # ``-m harness.cli`` imports the harness of the tree it runs in (cwd is first on sys.path)
    return subprocess.run([sys.executable, "-m", "harness.cli", "-q", "--json", "worker", "prepare",
                           HOST_ALIAS, "--dir", str(base / "w"), "--cache", str(cache),
                           "--ssh-config", str(sshd.ssh_config)],
                          capture_output=True, text=True, timeout=1200, cwd=_committed_tree(base))


def _pytest(args, timeout=900):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """nodeid-ish name -> (outcome, kph_host)."""
    out = {}
    for tc in ET.parse(junit).getroot().iter("testcase"):
        outcome = "failed" if tc.find("failure") is not None or tc.find("error") is not None \
            else "skipped" if tc.find("skipped") is not None else "passed"
        host = next((p.get("value") for p in tc.iter("property") if p.get("name") == "kph_host"), "")
        out[f"{tc.get('classname')}::{tc.get('name')}"] = (outcome, host or "")
    return out


def _processes_with(*texts: str) -> list[str]:
    """Live processes whose environment holds every one of ``texts``."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            data = env.read_bytes()
            stat = (env.parent / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] != "Z" and all(t.encode() in data for t in texts):
                found.append(f"{env.parent.name} {(env.parent / 'comm').read_text().strip()}")
        except OSError:
            continue
    return found


def test_two_processes_unpack_sshd_into_an_empty_cache_at_once(tmp_path):
    """Both xdist workers of a run asked for sshd in an empty cache at once: each
    downloaded into one directory and removed it when done, under the other's
    ``dpkg-deb -x`` (found running this module with ``-n 2``)."""
    code = "from harness.apps.loopback_sshd import _tree; print(_tree())"
    env = {**os.environ, "KPH_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    tree = tmp_path / "cache" / "sshd" / "tree"
    assert [o.strip() for o, _ in outs] == [str(tree)] * 2
    assert (tree / "usr/sbin/sshd").is_file()
    assert sorted(p.name for p in (tmp_path / "cache" / "sshd").iterdir()) == [".lock", "tree"]


def test_the_loopback_sshd_host_key_is_pinned(tmp_path):
    """The client's ssh_config trusts the sshd's generated host key and no other: with
    another key in its known_hosts the connection is refused, never accepted."""
    sshd = LoopbackSshd()
    ssh = ["ssh", "-F", str(sshd.ssh_config), HOST_ALIAS, "echo ok"]
    try:
        sshd.start()
        assert "StrictHostKeyChecking yes" in sshd.ssh_config.read_text()
        assert subprocess.run(ssh, capture_output=True, text=True, timeout=60).stdout == "ok\n"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "k")],
                       check=True, timeout=60)
        key_type, key = (tmp_path / "k.pub").read_text().split()[:2]
        (sshd.dir / "known_hosts").write_text(f"{HOST_ALIAS} {key_type} {key}\n")
        r = subprocess.run(ssh, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and r.stdout == "", r.stdout
        assert "Host key verification failed" in r.stderr, r.stderr
    finally:
        sshd.stop()
        import shutil
        shutil.rmtree(sshd.dir, ignore_errors=True)


@pytest.mark.timeout(1500)
def test_prepare_makes_an_identical_worker_and_prints_its_tx(worker):
    sshd, tx, cache = worker
    assert tx.startswith(f"{os.cpu_count()}*ssh={HOST_ALIAS}//ssh_config=")
    assert "//python=" in tx and tx.endswith("/w") and "//chdir=" in tx
    assert (cache / "default").exists() and (cache / "qemu" / "qemu.json").exists()


@pytest.mark.timeout(1500)
def test_a_slice_through_two_ssh_gateways_and_popen_matches_a_local_run(worker, tmp_path):
    sshd, tx, cache = worker
    two = tx.replace(tx.split("*", 1)[0], "2", 1)
    remote = _pytest(["--dist", "load", "--tx", two, "--tx", "popen", "-k", SLICE,
                      f"--junitxml={tmp_path / 'remote.xml'}"])
    assert remote.returncode == 0, remote.stdout[-3000:]
    local = _pytest(["-k", SLICE, "--junitxml", str(tmp_path / "local.xml")])
    assert local.returncode == 0, local.stdout[-3000:]
    r, l = _outcomes(tmp_path / "remote.xml"), _outcomes(tmp_path / "local.xml")
    assert r.keys() == l.keys() and len(r) >= 6
    assert {k: v[0] for k, v in r.items()} == {k: v[0] for k, v in l.items()}
    hosts = {h for _, h in r.values()}
    # Each result says where it ran: gw0, gw1 are the ssh workers, gw2 the local one.
    assert all(h.count(":") == 1 and h.split(":")[1].startswith("gw") for h in hosts), hosts
    assert len(hosts) >= 2, hosts


@pytest.mark.timeout(1500)
def test_a_remote_worker_killed_mid_run_is_an_error_naming_its_host(worker, tmp_path):
    """The killed worker's test is an error naming the ssh host, its QEMU dies with it
    (PDEATHSIG), and the other workers finish the run."""
    sshd, tx, cache = worker
    two = tx.replace(tx.split("*", 1)[0], "2", 1)
    evidence = tmp_path / "evidence"
    p = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--dist",
                          "load", "--tx", two, "--tx", "popen", "-k", "test_differential and 6.1-events",
                          # =-forms: xdist rewrites any argument that is an existing path
                          # for a gateway with a chdir (and refuses one outside its roots)
                          f"--junitxml={tmp_path / 'r.xml'}", f"--kph-evidence={evidence}"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        # Wait until a remote worker has a QEMU running, then kill that worker.
        deadline = time.monotonic() + 300
        victim = None
        while victim is None and time.monotonic() < deadline and p.poll() is None:
            for line in _processes_with(f"KPH_CACHE={cache}"):
                pid, comm = line.split(" ", 1)
                if comm.startswith("qemu-system"):
                    # The worker set PYTEST_XDIST_WORKER after it started (so only its
                    # children show it in /proc/PID/environ): read it off the QEMU.
                    try:
                        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]
                                   .split()[1])
                        environ = Path(f"/proc/{pid}/environ").read_bytes()
                    except OSError:
                        continue
                    if b"PYTEST_XDIST_WORKER=gw" in environ:
                        worker_id = environ.split(b"PYTEST_XDIST_WORKER=")[1].split(b"\0")[0]
                        victim = (ppid, worker_id.decode())
                        break
            time.sleep(0.2)
        assert victim is not None, "no remote worker ran a QEMU"
        os.kill(victim[0], signal.SIGKILL)
        mine = (f"PYTEST_XDIST_WORKER={victim[1]}\0", f"KPH_CACHE={cache}\0")
        gone = time.monotonic() + 10
        left = _processes_with(*mine)
        while left and time.monotonic() < gone:
            time.sleep(0.2)
            left = _processes_with(*mine)
        assert not left, f"processes of the killed worker {victim[1]} still run: {left}"
        out, _ = p.communicate(timeout=900)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert f"worker '{victim[1]}' crashed" in out and f"ssh host {HOST_ALIAS}" in out, out[-3000:]
    res = _outcomes(tmp_path / "r.xml")
    failed = [k for k, (o, _) in res.items() if o == "failed"]
    assert len(failed) == 1, failed                  # only the test it was running
    assert sum(1 for o, _ in res.values() if o == "passed") >= 20     # the rest finished
    assert list(evidence.glob(f"{HOST_ALIAS}-{victim[1]}/*/report.txt")), list(evidence.rglob("*"))
