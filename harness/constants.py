"""Defaults in one place (timeouts in seconds, sizes as QEMU spells them)."""
from __future__ import annotations

import os
from pathlib import Path

#: Guest memory when none is given.
DEFAULT_MEMORY = "512M"
#: The machine every guest is (``-machine``): a PC without an HPET. QEMU's HPET model
#: woke QEMU's main loop every 4 ms (250 times a second) while the guest ran the TSC
#: clocksource, the LAPIC timer and the HPET's clockevent shut down, costing each guest
#: ~1.8% of a host CPU while it sat idle; without it the guest keeps the TSC and the LAPIC
#: timer (``tsc=reliable``: :data:`DEFAULT_APPEND`) and takes the PIT as its broadcast
#: device (measured on 6.1, 6.12 and 7.3, 2026-12-01: the main loop's CPU over 15 idle
#: s, 27-32 ticks -> 1-5). A replay keeps the machine it was recorded on
#: (``harness.machine.replay``).
MACHINE = "pc,hpet=off"
#: From QEMU start to the guest agent answering (TCG boot is ~1.5 s; xdist halves the CPU).
BOOT_TIMEOUT = 60.0
#: Default limit for one guest command.
RUN_TIMEOUT = 60.0
#: A command longer than this (bytes) runs from a guest file, not as /bin/sh -c's argument:
#: one argument of execve() holds at most MAX_ARG_STRLEN (32 pages, 128 KiB)
MAX_INLINE_CMD = 120_000
#: the name of the guest's virtio-serial port whose bytes go raw to the host
#: (``Machine.read_stream``)
DATA_PORT = "org.kprobe_harness.data.0"
#: the port of the guest's kph-reader: its kernel log and files (``Machine.kernel_log``,
#: ``Machine.pull_many``)
READER_PORT = "org.kprobe_harness.reader.0"
#: A recorded or replayed run (harness.machine.replay), QEMU start to the end; a replay runs ~1.3x
#: longer than its recording.
RR_TIMEOUT = 120.0
#: One QMP command.
QMP_TIMEOUT = 10.0
#: Waiting for another process that is building the same image (a Debian kernel's image
#: takes 1-3 min here; past this the other one is stuck).
IMAGE_LOCK_TIMEOUT = 900.0
#: Waiting for another process that is provisioning the kernel-build toolchain (apt
#: downloads and an unpack: minutes).
TOOLCHAIN_LOCK_TIMEOUT = 1800.0
#: Waiting for another process that is building the same snapshot.
SNAPSHOT_LOCK_TIMEOUT = 180.0
#: ``migrate`` of a booted guest's device state into the snapshot (takes ~0.02 s).
SNAPSHOT_SAVE_TIMEOUT = 60.0
#: How long a panic's console line may take to arrive whole once its start is seen (the
#: UART writes it a character at a time; Machine._panic_line)
PANIC_LINE_WAIT = 1.0
#: The resynchronisation after a restore (clock, random seed): one guest command.
RESYNC_TIMEOUT = 30.0
#: The guest clock offset is measured with guest-get-time until one round trip is this
#: short (seconds; the offset's error is half the round trip), at most that many times.
RESYNC_CLOCK_SLACK = 0.01
RESYNC_CLOCK_TRIES = 4
#: A directory of downloaded inputs (.deb files) that may be shared between caches.
DOWNLOADS_ENV = "KPH_DOWNLOADS"
#: Set (to anything but "" or "0") to make every ``Machine.boot()`` boot cold.
COLD_ENV = "KPH_COLD"
#: Longest wait for one reply of the guest agent. A command may run much longer (its
#: status is polled), but each request is answered in milliseconds by a live agent.
AGENT_REPLY_TIMEOUT = 20.0
#: While waiting on the guest, how often (seconds) to ask whether it can run at all
#: (QMP ``query-status``, the host-side engine): a guest stopped in a debugger or a probe
#: handler never answers, and waiting for the timeout would only hide why.
STALL_CHECK_INTERVAL = 0.5
#: A host-side probe handler holding the guest stopped for longer than this is stuck:
#: whoever waits on the guest gets an error naming it.
HANDLER_STUCK_TIMEOUT = 20.0
#: A guest that the host engine's probe stops held for HOST_BUSY_SHARE of the
#: HOST_BUSY_WINDOW seconds before a wait ran out is running, slowed by the host's probes:
#: the command that outlasted its timeout is not hung (``Machine.host_busy``).
HOST_BUSY_WINDOW = 2.0
HOST_BUSY_SHARE = 0.25
#: The calls a host-side engine runs with the guest halted (register, read, close).
ENGINE_CALL_TIMEOUT = 30.0
#: A settled halt (HostEngine.halted(settle=True)): tries, the pause between them, and
#: how much of a vCPU's stack is read for a hit under way.
SETTLE_TRIES = 25
SETTLE_PAUSE = 0.002
SETTLE_SCAN = 4096
#: ``kph doctor`` and ``--accel kvm``: a one-instruction guest must finish in this long.
KVM_PROBE_TIMEOUT = 5.0
#: Grace time for QEMU to exit after ``quit`` before it is killed.
QUIT_TIMEOUT = 3.0
#: Kernel command line of every machine unless ``--append`` replaces it. ``nokaslr`` keeps
#: kallsyms addresses valid. ``rcupdate.rcu_expedited=1`` (kernel/rcu/update.c:
#: rcu_gp_is_expedited(); kernel/rcu/tree.c: synchronize_rcu() then takes
#: synchronize_rcu_expedited()): each unregister_kprobes() (kernel/kprobes.c), so each
#: removed probe, and each ``echo > trace`` wait for one grace period: removing a kprobe
#: event took 53 ms, 0.3 ms expedited (6.1 guest, 2026-11-30). What a probe's handlers
#: see does not depend on how long unregistering waits. ``tsc=reliable``
#: (arch/x86/kernel/tsc.c: tsc_setup(); no clocksource watchdog on the TSC): TCG's TSC
#: runs on the host's clock, and without an HPET (:data:`MACHINE`) the watchdog is the
#: ACPI PM timer, 24 bits at 3.58 MHz, which wraps in 4.7 s: a snapshot built under load
#: (a guest not run that long) came up with its TSC marked unstable and on ``acpi_pm``.
DEFAULT_APPEND = ("console=ttyS0 nokaslr quiet panic=-1 oops=panic rcupdate.rcu_expedited=1 "
                  "tsc=reliable")
#: The first QEMU release whose gdbstub no longer flushes the translation cache on every stop.
FAST_GDBSTUB_QEMU = (10, 2)
#: The Debian package that names the current cloud kernel ABI.
KERNEL_META_PACKAGE = "linux-image-cloud-amd64"
#: Console lines kept in errors.
CONSOLE_TAIL_LINES = 25


def cache_dir() -> Path:
    """``$KPH_CACHE``, else ``~/.cache/kprobe-harness``: images, kallsyms, the private QEMU."""
    env = os.environ.get("KPH_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kprobe-harness"
