"""Issue 13: every kernel fact the host side reads is on the host before a probe is armed."""
from __future__ import annotations

import json

import pytest

from harness.machine.image.facts import REQUIRED, KernelFacts
from harness.machine.image.store import sha256_file
from harness.kernel.kprobes import Kprobe
from harness.vmctl import Machine

pytestmark = pytest.mark.vm


def test_the_image_carries_its_facts_hashed_in_its_manifest(default_image):
    facts = default_image.facts
    assert facts.missing() == []
    arts = json.loads((default_image.dir / "manifest.json").read_text())["artifacts"]
    for name in REQUIRED:
        assert arts[name]["sha256"] == sha256_file(default_image.dir / name), name
    assert facts.release == default_image.version
    assert "virtio_console" in facts.modules
    assert facts.config.get("CONFIG_KPROBES") == "y"
    assert isinstance(facts.btf.offset("task_struct", "comm"), int)
    assert facts.symbols.lookup("do_sys_openat2").addr > 0


def test_a_kernel_without_an_image_is_harvested_before_boot_returns(default_image, tmp_path,
                                                                    monkeypatch):
    """The empty-cache deadlock of issue 13: a pre_handler that needs BTF (task comm and
    pid) on a kernel whose facts nobody harvested before. It must work the first time."""
    monkeypatch.setenv("KPH_CACHE", str(tmp_path))
    from harness.machine.qemu import find_qemu

    with Machine.boot(kernel=default_image.kernel, initrd=default_image.initrd,
                      qemu=find_qemu()) as vm:
        assert vm.image is None and vm.facts is not None
        assert vm.facts.dir.parent == tmp_path / "kernels"
        assert vm.facts.missing() == []             # all there before any probe exists
        comms = []

        def pre(p, regs):
            task = vm.host.current_task(regs)
            comms.append((vm.host.task_comm(task), vm.host.task_pid(task)))
            return 0
        vm.host.register_kprobe(Kprobe(symbol_name="do_sys_openat2", pre_handler=pre))
        r = vm.run("cat /proc/version", timeout=30)
        assert r.status == 0
        assert any(comm == "cat" and pid and pid > 1 for comm, pid in comms), comms
    # A second boot of the same kernel finds them and harvests nothing.
    stamp = (vm.facts.dir / "btf").stat().st_mtime_ns
    with Machine.boot(kernel=default_image.kernel, initrd=default_image.initrd) as vm2:
        assert vm2.facts.dir == vm.facts.dir
    assert (vm.facts.dir / "btf").stat().st_mtime_ns == stamp


def test_facts_of_a_kaslr_boot_take_kallsyms_from_that_boot(default_image, tmp_path, monkeypatch):
    monkeypatch.setenv("KPH_CACHE", str(tmp_path))
    append = "console=ttyS0 quiet panic=-1"          # no nokaslr
    with Machine.boot(kernel=default_image.kernel, initrd=default_image.initrd,
                      append=append) as vm:
        assert vm.facts.kallsyms_file is not None and vm.rundir is not None
        assert vm.facts.kallsyms_file.parent == vm.rundir
        guest = vm.run("grep ' do_sys_openat2$' /proc/kallsyms", check=True).stdout.split()[0]
        assert vm.symbols.lookup("do_sys_openat2").addr == int(guest, 16)


def test_kernel_facts_read_offline(default_image):
    """KernelFacts is plain files: no machine, no guest."""
    f = KernelFacts(default_image.dir)
    assert f.blacklist.find(f.symbols.lookup("kprobe_int3_handler").addr)
