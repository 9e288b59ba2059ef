"""What makes a remote worker's results incomparable (harness.apps.remote.differences), and the
check that the worker checked out the commit ``prepare`` sent."""
import subprocess

import pytest

from harness.apps import remote
from harness.errors import SetupError
from harness.apps.remote import check_checkout, differences

IMG = {"abi": "6.1.0-56-cloud-amd64", "current": True, "kernel_sha256": "aa", "recipe": "r1"}


def ident(**kw):
    base = {"host": "h", "commit": "c" * 40, "dirty": False, "qemu": "11.1.3", "cores": 8,
            "images": {"6.1": dict(IMG)}}
    base.update(kw)
    return base


def test_identical_hosts_differ_in_nothing_that_matters():
    assert differences(ident(), ident(host="other", cores=2)) == []


def test_every_difference_is_named():
    remote = ident(commit="d" * 40, qemu="10.0.0",
                   images={"6.1": dict(IMG, kernel_sha256="bb", recipe="r2", current=False)})
    diff = differences(ident(images={"6.1": IMG, "7.3": dict(IMG, abi="7.3.4")}), remote)
    text = "; ".join(diff)
    assert "harness commit dddddddddddd (here cccccccccccc)" in text
    assert "QEMU 10.0.0 (here 11.1.3)" in text
    assert "6.1: kernel binary bb (here aa)" in text and "6.1: image recipe r2" in text
    assert "6.1: image not current" in text and "no 7.3 image" in text


@pytest.mark.parametrize("here,there,named", [
    (True, False, ["uncommitted changes here (commit them: only the commit is sent)"]),
    (False, True, ["uncommitted changes in the worker's checkout"]),
    # both dirty: the same commit, but nothing says the changes are the same
    (True, True, ["uncommitted changes in the worker's checkout",
                  "uncommitted changes here (commit them: only the commit is sent)"]),
])
def test_uncommitted_changes_on_either_side_are_a_difference(here, there, named):
    assert differences(ident(dirty=here), ident(dirty=there)) == named


def test_a_checkout_of_another_commit_names_both():
    check_checkout("w1", "a" * 40, "a" * 40)
    with pytest.raises(SetupError) as err:
        check_checkout("w1", "a" * 40, "b" * 40)
    msg = str(err.value)
    assert "w1 checked out commit bbbbbbbbbbbb, not the commit sent (aaaaaaaaaaaa)" in msg
    assert "\n" not in msg and "kph worker prepare again" in msg


def test_prepare_stops_when_the_worker_is_on_another_commit(monkeypatch):
    """The worker's checkout answers with another commit (a hook, another checkout in
    --dir): prepare stops there, naming both, before setup.sh runs."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=remote.ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    scripts = []

    def run(self, script, *, stdin=None, timeout=600, progress=None, what=""):
        scripts.append(what)
        return "f" * 40 + "\n" if what == "checkout" else ""
    monkeypatch.setattr(remote.Ssh, "run", run)
    with pytest.raises(SetupError, match=f"checked out commit ffffffffffff, not the commit "
                                         f"sent \\({head[:12]}\\)"):
        remote.prepare("w1", directory="/srv/kph", commit="HEAD", progress=lambda s: None)
    assert scripts == ["upload", "checkout"]
