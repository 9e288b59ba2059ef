"""Machine against the real default image: commands, files, failures, teardown."""
from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from harness.errors import (GuestAgentError, GuestPanicError, GuestStoppedError, SetupError,
                            StateError, VMLostError)
from harness.vmctl import Machine, VmState

pytestmark = pytest.mark.vm


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes only once reaped; Popen.wait reaps it.
    return True


def test_runs_commands_with_status_and_streams(vm, default_image):
    r = vm.run("uname -r; cat /proc/cmdline; echo oops >&2; exit 7")
    assert r.status == 7
    release, cmdline = r.stdout.splitlines()[:2]
    assert release == default_image.version
    assert "nokaslr" in cmdline
    assert r.stderr == "oops\n"


def test_guest_has_kernel_filesystems_and_modules(vm):
    r = vm.run("ls /sys/kernel/tracing/kprobe_events /sys/kernel/debug/kprobes/list "
               "&& grep -c . /proc/kallsyms && lsmod", check=True)
    assert int(r.stdout.splitlines()[2]) > 50000
    assert "virtio_console" in r.stdout and "pvpanic_pci" in r.stdout


def test_push_and_pull_round_trip(vm, tmp_path):
    data = os.urandom(300_000)
    src = tmp_path / "blob"
    src.write_bytes(data)
    vm.push(src, "/tmp/blob", mode=0o600)
    assert vm.pull("/tmp/blob") == data
    assert vm.run("stat -c %a /tmp/blob").stdout.strip() == "600"


def test_a_command_s_bytes_come_raw_through_the_data_port(vm, tmp_path):
    data = os.urandom(300_000)
    (tmp_path / "blob").write_bytes(data)
    vm.push(tmp_path / "blob", "/tmp/blob")
    assert vm.has_data_port
    t0 = time.monotonic()
    got = vm.read_stream('cat /tmp/blob > "$KPH_DATA"', len(data), timeout=30)
    print(f"measured: 300,000 bytes through the data port in {time.monotonic() - t0:.3f} s")
    assert got == data
    assert vm.read_stream('printf abc > "$KPH_DATA"', 3, timeout=30) == b"abc"


def test_a_stream_short_of_its_size_fails_in_seconds_and_leaves_the_port_clean(vm):
    from harness.errors import GuestExecError, VMLostError

    t0 = time.monotonic()
    with pytest.raises(VMLostError, match="wrote 5 of 100 bytes to the data port"):
        vm.read_stream('printf 12345 > "$KPH_DATA"', 100, timeout=30)
    assert time.monotonic() - t0 < 10
    with pytest.raises(GuestExecError):
        vm.read_stream('printf xy > "$KPH_DATA"; exit 3', 2, timeout=30)
    # a stream that wrote more than it said: the next one does not read its rest
    assert vm.read_stream('printf 123456 > "$KPH_DATA"', 3, timeout=30) == b"123"
    assert vm.read_stream('printf abcd > "$KPH_DATA"', 4, timeout=30) == b"abcd"


def test_the_kernel_log_reader_prints_what_dmesg_prints_and_adds_what_is_new(vm):
    """``Machine.kernel_log`` through kph-reader (probes/progs/reader.c) prints the guest's
    log as its ``dmesg`` does, multi-line and escaped records included (/dev/kmsg's
    ``\\xHH`` undone), and each read adds what was printed since the last."""
    assert vm.has_reader
    before = vm.kernel_log(timeout=30)
    assert before.endswith(vm.run("dmesg", check=True).stdout)   # equal unless it wrapped
    vm.run(r"printf 'kph one\nkph two \\ b\001c\n' > /dev/kmsg; echo 'kph three' > /dev/kmsg",
           check=True)
    after = vm.kernel_log(timeout=30)
    assert after.startswith(before) and after.endswith(vm.run("dmesg", check=True).stdout)
    new = after[len(before):].splitlines()
    assert [ln.split("] ", 1)[1] for ln in new] == ["kph one", "kph two \\ b\x01c", "kph three"]
    assert new[0].split("] ", 1)[0] == new[1].split("] ", 1)[0]     # one record's two lines
    assert vm.kernel_log(timeout=30) == after


def test_files_read_by_the_reader_are_what_the_agent_reads_errors_in_its_words(vm, tmp_path):
    """``Machine.pull_many`` through kph-reader: one request for many files, each the
    bytes the agent's file calls give (a file of several MiB, procfs, tracefs, a pipe
    with nothing in it) or the same error, in qemu-ga's words (the caller reads the
    strerror in them: a missing format file is an event that is not)."""
    assert vm.has_reader
    big = os.urandom(3 << 20)
    (tmp_path / "big").write_bytes(big)
    vm.push(str(tmp_path / "big"), "/tmp/kph-big")
    paths = ["/tmp/kph-big", "/proc/version", "/proc/modules", "/sys/kernel/tracing/available_events",
             "/sys/kernel/tracing/events/sched/sched_switch/format", "/sys/kernel/tracing/nosuch",
             "/sys/kernel/tracing/trace_pipe", "/sys/kernel/tracing/events", "/etc/kph/modules.load"]
    mine = vm.pull_many(paths, timeout=60)
    agents = vm.agent.read_files(paths, timeout=60)
    assert mine[0] == big and "Linux version" in mine[1].decode()
    for path, a, b in zip(paths, mine, agents):
        if isinstance(b, GuestAgentError):
            assert isinstance(a, GuestAgentError), (path, a[:80])
            assert str(b).split(": ")[-1] == str(a).split(": ")[-1], (path, str(a), str(b))
        else:
            assert a == b, path
    assert os.strerror(errno.ENOENT) in str(mine[5]) and os.strerror(errno.EAGAIN) in str(mine[6])
    assert vm.pull("/proc/version") == mine[1]
    with pytest.raises(GuestAgentError, match=os.strerror(errno.ENOENT)):
        vm.pull("/nosuch")


def test_the_reader_reads_a_file_a_piece_a_read(vm, tmp_path):
    """``Machine.read_pieces``: each read() kept (a ring buffer's pages, 4096 bytes each),
    up to the count asked, then whether a read found nothing more (EAGAIN from an empty
    pipe-like file, or a file's end); a missing file and a directory fail in qemu-ga's
    words."""
    data = os.urandom(3 * 4096 + 100)
    (tmp_path / "f").write_bytes(data)
    vm.push(str(tmp_path / "f"), "/tmp/kph-pieces")
    pieces, ended = vm.read_pieces("/tmp/kph-pieces", 10)
    assert b"".join(pieces) == data and [len(x) for x in pieces] == [4096] * 3 + [100] and ended
    pieces, ended = vm.read_pieces("/tmp/kph-pieces", 2)
    assert pieces == [data[:4096], data[4096:8192]] and not ended
    assert vm.read_pieces("/sys/kernel/tracing/trace_pipe", 5) == ([], True)     # EAGAIN
    with pytest.raises(GuestAgentError, match="open.*" + os.strerror(errno.ENOENT)):
        vm.read_pieces("/nosuch", 5)
    with pytest.raises(GuestAgentError, match="read.*" + os.strerror(errno.EISDIR)):
        vm.read_pieces("/tmp", 5)
    assert vm.pull("/proc/version").startswith(b"Linux version")    # the reader answers on


def test_a_reader_gone_or_silent_leaves_dmesg_and_the_agent_to_read(default_image):
    """A reader that stops answering is a VMLostError within the read's timeout, then
    never asked again; one that exits closes its port (QEMU's VSERPORT_CHANGE): either
    way the log is then read with ``dmesg`` in the guest, files with the agent. A guest
    that is not running is a GuestStoppedError within seconds, the reader kept."""
    with Machine.boot(default_image) as m:
        assert m.has_reader
        assert m.kernel_log(timeout=30) == m.run("dmesg", check=True).stdout
        m.qmp("stop")           # a guest that cannot run is said at once, the reader kept
        try:
            t0 = time.monotonic()
            with pytest.raises(GuestStoppedError):
                m.kernel_log(timeout=30)
            assert time.monotonic() - t0 < 10
        finally:
            m.qmp("cont")
        assert m.has_reader and m.pull("/proc/version").startswith(b"Linux version")
        m.run("kill -STOP $(pidof kph-reader)", check=True)
        t0 = time.monotonic()
        with pytest.raises(VMLostError, match="reader .kph-reader. did not answer"):
            m.kernel_log(timeout=2)
        assert time.monotonic() - t0 < 5 and not m.has_reader
        m.run("echo 'kph after' > /dev/kmsg", check=True)
        text = m.kernel_log(timeout=30)
        assert text == m.run("dmesg", check=True).stdout and "kph after" in text
        assert m.pull_many(["/proc/version"])[0].startswith(b"Linux version")   # the agent
    with Machine.boot(default_image) as m:
        m.run("kill $(pidof kph-reader)", check=True)
        deadline = time.monotonic() + 10
        while m.has_reader and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not m.has_reader
        assert m.kernel_log(timeout=30) == m.run("dmesg", check=True).stdout


def test_a_reused_pid_reads_its_own_output_after_a_command_timed_out(vm):
    """qemu-ga answers guest-exec-status for the first entry with a pid; the command that
    timed out and the kill that ended it must leave none behind. ns_last_pid makes the
    next two commands get exactly their pids (seen once in CI as an empty exit 0)."""
    from harness.errors import VMLostError

    p0 = int(vm.run("echo $$", check=True).stdout)
    with pytest.raises(VMLostError, match="did not finish"):
        vm.run("exec sleep 30", timeout=1)
    for reuse in (p0 + 1, p0 + 2):          # the sleep's pid, then the kill's
        vm.write_file("/proc/sys/kernel/ns_last_pid", f"{reuse - 1}\n".encode())
        r = vm.run("echo $$; echo mine")
        assert (r.status, r.stdout.split()) == (0, [str(reuse), "mine"])


def test_a_pipeline_of_a_thousand_requests_is_answered_in_order_wave_by_wave(vm):
    """qemu-ga gets a long pipeline in half-duplex waves of PIPELINE_WAVE bytes (sent at
    once, 1,000 event enables lost answers in one run of five; sent while answers flowed
    back, every time: docs/machine.md): every open answered with its own handle, every
    close with {}, the stream still in step."""
    from harness.machine.agent import PIPELINE_WAVE

    agent = vm.agent
    n = 1000
    assert n * 80 > 10 * PIPELINE_WAVE                      # ~80 bytes an open: 10+ waves
    handles = agent.pipeline([("guest-file-open", {"path": "/proc/version", "mode": "r"})] * n,
                             timeout=120)
    assert all(isinstance(h, int) for h in handles) and len(set(handles)) == n
    reads = agent.pipeline([("guest-file-read", {"handle": h, "count": 5}) for h in handles],
                           timeout=120)
    assert {r["buf-b64"] for r in reads} == {"TGludXg="}        # b"Linux", each its own file
    assert agent.pipeline([("guest-file-close", {"handle": h}) for h in handles],
                          timeout=120) == [{}] * n
    assert vm.run("echo in step").stdout == "in step\n"


def test_a_command_past_execve_s_argument_limit_runs_from_a_file_that_removes_itself(vm):
    """One execve() argument holds at most 128 KiB (MAX_ARG_STRLEN): a longer command (a
    registration script of 1,000 probe lines; bench/scale.py met it as "Argument list too
    long") runs from a guest file, with the same status and output."""
    body = "".join(f"x{i}={i}\n" for i in range(20000))          # ~190 KB of shell
    r = vm.run(body + "echo \"$x19999\"; echo err >&2; exit 3", timeout=120)
    assert (r.status, r.stdout, r.stderr) == (3, "19999\n", "err\n"), r
    assert vm.run("ls /tmp/kph-run-* 2>/dev/null | wc -l").stdout.strip() == "0"


def test_sockets_live_in_a_private_run_dir(vm):
    st = os.stat(vm.rundir)
    assert st.st_mode & 0o777 == 0o700
    socks = sorted(p.name for p in vm.rundir.iterdir() if p.suffix == ".sock")
    # plugin.sock: the TCG plugin's control socket (harness.machine.pluginlink), when QEMU loads it
    assert socks == sorted(["data.sock", "gdb.sock", "qga.sock", "qmp.sock", "reader.sock"]
                           + (["plugin.sock"] if vm.plugin_path else []))
    # Nothing of ours listens on TCP.
    cmd = " ".join(vm.command_line())
    assert "tcp:" not in cmd and "port=" not in cmd


def test_qmp_answers(vm):
    st = vm.qmp("query-status")
    assert st["status"] == "running"


def test_the_machine_has_no_hpet_and_the_guest_keeps_its_tsc_and_lapic_timer(vm):
    """harness.constants.MACHINE: no HPET (its QEMU model woke the main loop 250 times a
    second in an idle guest); the guest's clocksource is the TSC (``tsc=reliable``: the
    ACPI PM timer as its watchdog marked it unstable), its tick the LAPIC timer."""
    out = vm.run("cd /sys/devices/system; cat clocksource/clocksource0/available_clocksource "
                 "clocksource/clocksource0/current_clocksource; grep -h 'Clock Event Device' "
                 "/proc/timer_list", timeout=30).stdout.split("\n")
    assert "hpet" not in out[0].split() and out[1] == "tsc", out
    devices = [ln.split(":", 1)[1].strip() for ln in out[2:] if ln]
    assert "lapic" in devices and "hpet" not in devices, devices


def test_two_machines_at_once(default_image):
    results = {}

    def one(tag):
        with Machine.boot(default_image) as m:
            m.run(f"echo {tag} > /tmp/tag", check=True)
            time.sleep(0.2)
            results[tag] = (m.run("cat /tmp/tag").stdout.strip(), m.pid)

    threads = [threading.Thread(target=one, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results["a"][0] == "a" and results["b"][0] == "b"
    assert results["a"][1] != results["b"][1]
    for _, pid in results.values():
        assert not _alive(pid)


def test_the_host_side_loads_btf_and_symbols_beside_the_start(default_image):
    """A machine's start loads the image's BTF and kallsyms table in a thread while the
    guest restores: on an image object no one has asked yet (a new one, its own facts),
    both are there once that thread is done, before anything asked for them, and they
    are what asking gives."""
    from harness.machine.image.store import load_image

    img = load_image(default_image.dir)
    with Machine.boot(img) as vm:
        assert "nokaslr" in vm.append.split() and vm.warmer is not None
        vm.warmer.join(60)
        assert not vm.warmer.is_alive()
        loaded = vars(img.facts)
        assert {"btf", "symbols"} <= loaded.keys(), sorted(loaded)
        assert vm.btf is loaded["btf"] and vm.symbols is loaded["symbols"]


def test_panic_raises_within_seconds_and_cleans_up(default_image):
    m = Machine.boot(default_image)
    pid = m.pid
    t0 = time.monotonic()
    try:
        # the panic line whole (Machine._panic_line waits for the UART to finish it)
        with pytest.raises(GuestPanicError, match="sysrq triggered crash"):
            m.run("echo c > /proc/sysrq-trigger", timeout=60)
        assert time.monotonic() - t0 < 10
        assert m.state is VmState.PANICKED
    finally:
        m.close()           # a failed assertion above leaves no QEMU behind
    assert not _alive(pid)
    assert m.rundir is None
    with pytest.raises(StateError):
        m.run("true")


def test_corrupt_initramfs_names_the_file(default_image, tmp_path):
    bad = tmp_path / "corrupt-initrd.img"
    bad.write_bytes(default_image.initrd.read_bytes()[:50_000])
    with pytest.raises(GuestPanicError, match="corrupt-initrd.img"):
        Machine.boot(default_image, initrd=bad, timeout=60)


def test_missing_kernel_is_a_setup_error():
    with pytest.raises(SetupError, match="/nonexistent"):
        Machine.boot(kernel="/nonexistent")


def _kph(*args):
    return [sys.executable, "-m", "harness.cli", *args]


def test_cli_boot_prints_release_and_cmdline(default_image):
    r = subprocess.run(_kph("boot", "--run", "uname -r", "--run", "cat /proc/cmdline"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == default_image.version
    assert "console=ttyS0" in r.stdout.splitlines()[1]


def test_cli_refuses_an_image_from_another_recipe_in_one_line(default_image, tmp_path):
    """A copy of the default image whose manifest names another recipe (as one built
    before a ``git pull`` does): refused before QEMU starts, one line naming the fix."""
    import json
    import shutil

    stale = tmp_path / default_image.dir.name
    shutil.copytree(default_image.dir, stale, symlinks=True,
                    ignore=shutil.ignore_patterns("snapshots"))
    mf = json.loads((stale / "manifest.json").read_text())
    mf["recipe"] = "0123456789abcdef"
    (stale / "manifest.json").write_text(json.dumps(mf))
    r = subprocess.run(_kph("boot", "--image", str(stale), "--run", "true"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, (r.stdout, r.stderr)
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "built from another recipe than this kph's" in err[0] and \
        "Traceback" not in r.stderr, r.stderr


def test_cli_exit_status_is_the_last_commands():
    r = subprocess.run(_kph("boot", "--run", "true", "--run", "exit 5"), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 5, r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_signal_mid_run_leaves_nothing(sig):
    p = subprocess.Popen(_kph("boot", "--run", "echo started; sleep 60"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    qemu_pids: list[int] = []
    while time.monotonic() < deadline and not qemu_pids:
        qemu_pids = [int(d.name) for d in __import__("pathlib").Path("/proc").iterdir()
                     if d.name.isdigit() and _ppid(d.name) == p.pid]
        time.sleep(0.1)
    assert qemu_pids, "kph boot never started QEMU"
    time.sleep(4)  # let the guest boot and the command start
    p.send_signal(sig)
    p.wait(30)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr.read()
    time.sleep(0.2)
    for pid in qemu_pids:
        assert not os.path.exists(f"/proc/{pid}"), f"QEMU {pid} survived {sig.name}"


def _ppid(pid: str) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("PPid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1
