"""Ready snapshots against the real default image: speed, resynchronisation, isolation,
staleness. The stale-snapshot tests work on a private copy of the image (in tmp_path), so
they never rebuild the snapshot the rest of the suite restores from."""
from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harness.machine.image.store import pack_cpio, load_image
from harness.machine.snapshot import file_sha256, snapshot_key
from harness.vmctl import Machine

pytestmark = pytest.mark.vm


def _start_and_run(image, **kw):
    t0 = time.monotonic()
    with Machine.boot(image, **kw) as m:
        m.run("true", check=True)
        return time.monotonic() - t0, m.start_mode


def test_snapshot_start_is_a_quarter_of_a_cold_boot(default_image):
    _start_and_run(default_image)  # builds the snapshot if this cache has none yet
    cold, mode = _start_and_run(default_image, fresh=False)
    assert mode == "cold"
    runs = [_start_and_run(default_image) for _ in range(3)]
    assert {mode for _, mode in runs} == {"snapshot"}
    fast = statistics.median(t for t, _ in runs)
    assert fast <= 0.25 * cold, f"snapshot start {fast:.2f} s against cold boot {cold:.2f} s"


def test_restored_guest_has_the_hosts_clock(default_image):
    with Machine.boot(default_image) as m:
        assert m.start_mode == "snapshot", m.cold_reason
        # Without the resync the guest would show the snapshot's time: make sure that
        # is far enough behind for the check below to tell.
        age = time.time() - m.snapshot.meta["built_unix"]
        if age < 5:
            time.sleep(5 - age)
            m._resync()
        guest = int(m.run("date +%s", check=True).stdout)
        assert abs(guest - time.time()) < 2
        assert m.clock_error_ns is not None and m.clock_error_ns < 0.1e9


def test_two_restored_machines_are_independent(default_image):
    """Both come from one snapshot, run at once, change the guest, and see only their own
    changes; a third restored afterwards sees none; the snapshot's files are untouched."""
    seen: dict[str, tuple[str, str, str, int]] = {}
    barrier = threading.Barrier(2, timeout=120)
    errors: list[BaseException] = []

    def one(tag: str) -> None:
        try:
            with Machine.boot(default_image) as m:
                assert m.start_mode == "snapshot", m.cold_reason
                # a new file, and a file that came with the snapshot (initramfs, in RAM)
                m.run(f"echo {tag} > /tmp/tag && echo {tag} >> /etc/kph/modules.load",
                      check=True)
                barrier.wait()  # both have written before either reads
                seen[tag] = (m.run("cat /tmp/tag", check=True).stdout.strip(),
                             m.run("tail -n 1 /etc/kph/modules.load", check=True).stdout.strip(),
                             m.run("head -c 16 /dev/urandom | od -An -tx1", check=True).stdout,
                             m.pid)
                barrier.wait()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=one, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert seen["a"][:2] == ("a", "a") and seen["b"][:2] == ("b", "b")
    assert seen["a"][2] != seen["b"][2], "both guests read the same random bytes"
    assert seen["a"][3] != seen["b"][3]
    with Machine.boot(default_image) as m:
        assert m.start_mode == "snapshot"
        assert m.run("cat /tmp/tag").status != 0
        assert m.run("tail -n 1 /etc/kph/modules.load").stdout.strip().endswith(".ko")
        snap = m.snapshot
    assert file_sha256(snap.state) == snap.meta["files"]["state"]["sha256"]
    assert snap.ram.stat().st_size == snap.meta["files"]["ram"]["size"]
    assert snap.ram.stat().st_mode & 0o222 == 0  # read-only: no machine could write it


def _image_copy(src, dest: Path, marker: str):
    """A private copy of ``src`` whose initramfs carries /etc/kph/marker = ``marker``
    (one more gzip'd cpio member: the kernel unpacks concatenated archives)."""
    dest.mkdir(exist_ok=True)
    for f in src.dir.iterdir():
        if f.is_file():
            shutil.copy(f, dest / f.name)
    extra = dest.parent / f"{dest.name}-extra"
    (extra / "etc/kph").mkdir(parents=True, exist_ok=True)
    (extra / "etc/kph/marker").write_text(marker + "\n")
    pack_cpio(extra, dest / "extra.cpio.gz")
    (dest / "initrd.img").write_bytes(src.initrd.read_bytes() + (dest / "extra.cpio.gz").read_bytes())
    return load_image(dest)


def _marker(m) -> str:
    return m.run("cat /etc/kph/marker", check=True).stdout.strip()


def test_changed_initramfs_makes_the_snapshot_stale(default_image, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="harness.machine.snapshot")
    img = _image_copy(default_image, tmp_path / "img", "one")
    with Machine.boot(img) as m:
        assert m.start_mode == "snapshot", m.cold_reason
        assert _marker(m) == "one"
        first = json.loads((m.snapshot.dir / "snapshot.json").read_text())
    img = _image_copy(default_image, tmp_path / "img", "two")
    caplog.clear()
    with Machine.boot(img) as m:
        assert m.start_mode == "snapshot", m.cold_reason
        assert _marker(m) == "two", "a stale snapshot was used"
        second = m.snapshot.meta
    assert "the snapshot is stale (initrd changed)" in caplog.text
    assert first["key"]["initrd_sha256"] != second["key"]["initrd_sha256"]
    assert first["key"]["kernel_sha256"] == second["key"]["kernel_sha256"]
    assert len(list((tmp_path / "img/snapshots").glob("[!.]*"))) == 1  # replaced, not kept


def test_changed_qemu_makes_the_snapshot_stale(default_image, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="harness.machine.snapshot")
    img = _image_copy(default_image, tmp_path / "img", "q")
    real = Machine.prepare(img).qemu
    exe = next(a for a in reversed(real.argv) if Path(a).is_file())
    copy = tmp_path / "qemu-copy" / Path(exe).name
    copy.parent.mkdir()
    shutil.copy2(exe, copy)
    copy.touch()  # another build of the same version, as far as anyone can tell
    other = dataclasses.replace(real, argv=tuple(str(copy) if a == exe else a for a in real.argv))
    with Machine.boot(img, qemu=real) as m:
        assert m.start_mode == "snapshot", m.cold_reason
        key_real = snapshot_key(m)
    caplog.clear()
    with Machine.boot(img, qemu=other) as m:
        assert m.start_mode == "snapshot", m.cold_reason
        assert m.snapshot.key == snapshot_key(m) != key_real
        assert str(copy) in m.command_line()
    assert "the snapshot is stale (QEMU binary changed)" in caplog.text


def test_cold_on_request(default_image, monkeypatch):
    with Machine.boot(default_image, fresh=False) as m:
        assert m.start_mode == "cold" and m.snapshot is None
    monkeypatch.setenv("KPH_COLD", "1")
    with Machine.boot(default_image) as m:
        assert m.start_mode == "cold" and "KPH_COLD" in m.cold_reason
        assert m.run("uname -r").stdout.strip() == default_image.version


def test_cli_boot_says_how_it_started():
    kph = [sys.executable, "-m", "harness.cli", "boot", "--run", "true"]
    r = subprocess.run(kph, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "boot: restored from" in r.stderr, r.stderr
    r = subprocess.run(kph + ["--cold"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "restored" not in r.stderr, r.stderr


def test_fresh_machine_fixture(kph_fresh_machine, kph_image):
    from harness.apps.pytest_plugin import boot_machine

    assert kph_fresh_machine.start_mode == "snapshot", kph_fresh_machine.cold_reason
    kph_fresh_machine.run("echo x > /tmp/left-behind", check=True)
    with boot_machine(kph_image) as next_one:  # what the next test would get
        assert next_one.start_mode == "snapshot"
        assert next_one.run("cat /tmp/left-behind").status != 0


def test_a_snapshot_that_does_not_restore_falls_back_to_a_cold_boot(default_image, tmp_path):
    img = _image_copy(default_image, tmp_path / "img", "broken")
    with Machine.boot(img) as m:
        assert m.start_mode == "snapshot", m.cold_reason
        snap = m.snapshot
    # A state file cut short, with a snapshot.json that agrees with it: only QEMU can tell.
    snap.state.chmod(0o644)
    snap.state.write_bytes(snap.state.read_bytes()[:4096])
    meta = json.loads((snap.dir / "snapshot.json").read_text())
    meta["files"]["state"] = {"size": 4096, "sha256": file_sha256(snap.state)}
    (snap.dir / "snapshot.json").write_text(json.dumps(meta))
    with Machine.boot(img) as m:
        assert m.start_mode == "cold"
        assert m.cold_reason.startswith(f"restoring {snap.dir} failed: ")
        assert _marker(m) == "broken"


def test_module_kallsyms_are_kept_per_snapshot(default_image):
    """A machine restored from the snapshot finds the modules' kallsyms lines of a state
    another machine of it read (``module-kallsyms/``): no walk of /proc/kallsyms, and
    the same symbols as the guest lists."""
    lines = []
    for _ in range(2):
        with Machine.boot(default_image) as m:
            real, reads = m.run, []

            def run(cmd, *a, real=real, reads=reads, **kw):
                if "/proc/kallsyms" in cmd:
                    reads.append(cmd)
                return real(cmd, *a, **kw)
            m.run = run
            m.symbols.modules_key = None    # as a new process's table: not merged yet
            mods = m.refresh_module_symbols()
            assert m.snapshot is not None and mods, mods
            got = sorted((s.addr, s.name) for s in m.symbols if s.module in mods)
            lines.append((reads, got))
            assert (m.snapshot.dir / "module-kallsyms").is_dir()
            listed = {(int(ln.split()[0], 16), ln.split()[2]) for ln in
                      real("grep '\\[' /proc/kallsyms", check=True).stdout.splitlines()}
            assert got and set(got) <= listed, sorted(set(got) - listed)[:5]
    assert lines[1][0] == [], lines[1][0]
    assert lines[0][1] == lines[1][1]


def test_a_kept_copy_of_module_kallsyms_leaves_out_what_is_not_a_module(default_image):
    """An ftrace trampoline's ``[__builtin__ftrace]`` line comes with a probe, not with
    the modules' layout: read while a kprobe on an ftrace site was enabled, it is in that
    machine's table, and a later machine of the snapshot (no probe) that takes the kept
    copy has no such line (one kept copy named a trampoline that was gone)."""
    import shutil
    with Machine.boot(default_image) as m:
        shutil.rmtree(m.snapshot.dir / "module-kallsyms", ignore_errors=True)
        m.run("cd /sys/kernel/tracing && echo 'p:kph_tramp vfs_read' >> kprobe_events && "
              "echo 1 > events/kprobes/kph_tramp/enable", check=True, timeout=30)
        m.symbols.modules_key = None
        m.refresh_module_symbols()
        first = {s.module for s in m.symbols if s.module}
        m.run("cd /sys/kernel/tracing && echo 0 > events/kprobes/kph_tramp/enable && "
              "echo '-:kph_tramp' >> kprobe_events", check=True, timeout=30)
    assert "__builtin__ftrace" in first, sorted(first)      # the probe made a trampoline
    with Machine.boot(default_image) as m:
        real, reads = m.run, []

        def run(cmd, *a, **kw):
            if "/proc/kallsyms" in cmd:
                reads.append(cmd)
            return real(cmd, *a, **kw)
        m.run = run
        m.symbols.modules_key = None
        m.refresh_module_symbols()
        assert reads == []                                   # the kept copy was taken
        later = {s.module for s in m.symbols if s.module}
    assert "__builtin__ftrace" not in later and later, sorted(later)


def test_tracefs_texts_are_kept_per_snapshot(default_image):
    """The ftrace locations of a set of loaded modules and the events available_events
    leaves out (harness.backends.tracelayer), kept in the snapshot (``tracefs/``): a
    machine of a later process (the in-process caches emptied) reads neither from the
    guest, and gets what the guest lists."""
    from harness.backends import tracelayer as TL

    import shutil

    got = []
    for i in range(2):
        TL._SNAPSHOT_FTRACE_FILES.clear()
        TL._SNAPSHOT_UNLISTED.clear()
        with Machine.boot(default_image) as m:
            if i == 0:          # as on a new snapshot: nothing kept yet
                shutil.rmtree(m.snapshot.dir / "tracefs", ignore_errors=True)
            real, real_many, reads = m.run, m.pull_many, []

            def run(cmd, *a, real=real, reads=reads, **kw):
                if "available_filter_functions" in cmd or "ls -d" in cmd:
                    reads.append(cmd)
                return real(cmd, *a, **kw)

            def pull_many(paths, *a, real_many=real_many, reads=reads, **kw):
                reads.extend(p for p in paths if "available_filter_functions" in p)
                return real_many(paths, *a, **kw)
            m.run, m.pull_many = run, pull_many
            mods = frozenset(m.refresh_module_symbols())
            funcs = TL.filter_functions(m, mods)
            names = TL.guest_event_names(m)
            assert (m.snapshot.dir / "tracefs").is_dir()
            assert funcs == {ln.split(" ", 1)[0] for ln in real(
                "cat /sys/kernel/tracing/available_filter_functions", check=True,
                timeout=60).stdout.splitlines() if ln}
            assert names == TL.other_event_names(real(
                "cd /sys/kernel/tracing/events && ls -d */*/", check=True, timeout=60).stdout)
            got.append(reads)
    assert len(got[0]) == 2 and got[1] == [], got
