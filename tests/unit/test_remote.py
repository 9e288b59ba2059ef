"""What makes a remote worker's results incomparable (harness.remote.differences)."""
from harness.remote import differences

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
