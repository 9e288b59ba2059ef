"""Shared fixtures. VM tests boot the real default image; when none can boot they fail
with the reason (never skip)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def _our_qemu_children() -> list[str]:
    me = str(os.getpid())
    out = []
    for st in Path("/proc").glob("[0-9]*/status"):
        try:
            text = st.read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
        if fields.get("PPid", "").strip() == me and fields.get("Name", "").strip() in (
                "qemu-system-x86", "gdb", "ld-linux-x86-64"):
            out.append(f"{st.parent.name} {fields['Name'].strip()}")
    return out


@pytest.fixture(scope="session", autouse=True)
def _no_leftover_processes():
    """After the whole session, nothing this worker started may still run."""
    yield
    from harness.vmctl import _live

    for m in list(_live):
        m.close()
    left = _our_qemu_children()
    assert not left, f"processes left running after the tests: {left}"


@pytest.fixture(scope="session")
def default_image():
    from harness.errors import HarnessError
    from harness.images import default_image as _default

    try:
        return _default()
    except HarnessError as exc:
        pytest.fail(f"no default image: {exc}")


@pytest.fixture(scope="module")
def vm(default_image):
    """One booted default image shared by the tests of a module."""
    from harness.vmctl import Machine

    with Machine.boot(default_image) as m:
        yield m


@pytest.fixture
def host(vm):
    """``vm.host`` for one test; closed after it, the guest still answering, no handler
    having raised."""
    h = vm.host
    yield h
    errors = list(h.handler_errors)
    h.close()
    assert vm.run("echo alive").stdout == "alive\n"
    assert not errors, f"handler raised: {errors[0]!r}"
