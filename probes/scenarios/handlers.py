"""Host-side handlers used by the scenarios (``vm`` is set by ``kph repro``)."""
import errno

vm = None  # the Machine, set before registration


def deny_proc_version(p, regs):
    """Make do_sys_openat2 return -EACCES for /proc/version, without running it."""
    path = vm.host.read_string(regs.si) or b""
    if path != b"/proc/version":
        return 0
    regs.ax = -errno.EACCES
    regs.ip = int.from_bytes(vm.host.read(regs.sp, 8), "little")  # back to the caller
    regs.sp = regs.sp + 8
    return 1
