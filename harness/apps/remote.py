"""Remote workers: a host prepared over SSH to run the differential suite as a pytest-xdist
worker (``--tx ssh=HOST//python=...//chdir=...``), and the identity check that keeps
results from different kernels, QEMUs or harness versions from being pooled silently.

No rsync (deprecated in xdist): ``prepare`` sends the commit as a git bundle through the
SSH connection, checks it out in the worker directory (the gateway's ``chdir``, so the
worker collects with the checkout's own configuration; select tests with ``-k``/``-m``:
xdist rewrites positional test paths for rsync roots, which kph workers do not use, and
refuses paths outside them), runs the project's own
``setup.sh`` there (packages, venv, QEMU, default image, snapshot) and builds the extra
kernels' images, writes ``.kph-worker/python`` (the worker's interpreter with its
``KPH_CACHE``), asks the host for its identity (``kph worker identity``) and compares it
with the controller's.

Identity: the harness commit and whether either checkout has uncommitted changes (only
the commit is sent, so a dirty tree on either side runs other code), the QEMU version,
and per image the kernel ABI, the sha256 of its kernel and the recipe hash (the initramfs
itself is rebuilt on every host and is not byte-identical: file times differ). The core
count tells how many workers the host takes (one per core: TCG runs one guest per core).
The commit the worker checked out is checked against the one sent before anything else.
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..errors import SetupError
from ..machine.image.store import built_images, default_image, image_is_current
from ..machine.qemu import find_qemu

Progress = Callable[[str], None]
ROOT = Path(__file__).resolve().parents[2]
WORKER_DIR = ".kph-worker"
PREPARE_TIMEOUT = 3600.0


def local_identity(kernels: list[str] | None = None) -> dict[str, Any]:
    """This checkout's identity (what ``kph worker identity`` prints)."""
    commit = _git("rev-parse", "HEAD").strip()
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no").strip())
    imgs = {}
    wanted = ([default_image(None if k == "default" else k) for k in kernels] if kernels
              else built_images())
    for img in wanted:
        imgs[img.series] = {"abi": img.version, "current": image_is_current(img),
                            "kernel_sha256": img.manifest["artifacts"]["vmlinuz"]["sha256"],
                            "recipe": img.manifest.get("recipe")}
    try:
        q = find_qemu().version_str
    except SetupError:
        q = None
    return {"host": os.uname().nodename, "commit": commit, "dirty": dirty, "qemu": q,
            "cores": os.cpu_count() or 1, "images": imgs}


def differences(local: dict[str, Any], remote: dict[str, Any]) -> list[str]:
    """What makes ``remote``'s results incomparable with ``local``'s (empty: nothing)."""
    out = []
    if local["commit"] != remote["commit"]:
        out.append(f"harness commit {remote['commit'][:12]} (here {local['commit'][:12]})")
    # Only the commit travels: uncommitted changes on either side are code the other lacks.
    if remote.get("dirty"):
        out.append("uncommitted changes in the worker's checkout")
    if local.get("dirty"):
        out.append("uncommitted changes here (commit them: only the commit is sent)")
    if local["qemu"] != remote["qemu"]:
        out.append(f"QEMU {remote['qemu']} (here {local['qemu']})")
    for series, mine in local["images"].items():
        theirs = remote["images"].get(series)
        if theirs is None:
            out.append(f"no {series} image")
            continue
        for key, label in (("abi", "kernel"), ("kernel_sha256", "kernel binary"),
                           ("recipe", "image recipe")):
            if mine[key] != theirs[key]:
                out.append(f"{series}: {label} {theirs[key]} (here {mine[key]})")
        if not theirs.get("current"):
            out.append(f"{series}: image not current")
    return out


def check_checkout(target: str, sent: str, checked_out: str) -> None:
    """The worker's checkout is the commit ``prepare`` sent (``--commit``).

    :raise SetupError: it is another one (both named).
    """
    if checked_out != sent:
        raise SetupError(f"{target} checked out commit {checked_out[:12] or '(none)'}, not the "
                         f"commit sent ({sent[:12]})",
                         "check the worker's --dir (another checkout, a hook) and run "
                         "kph worker prepare again")


def _git(*args: str, cwd: Path = ROOT) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                             timeout=120, check=False)
    except OSError as exc:
        raise SetupError("git is needed to send the harness to a worker", "apt-get install git") from exc
    if out.returncode != 0:
        raise SetupError(f"git {' '.join(args)} failed: {out.stderr.strip()[-200:]}",
                         "run kph worker from a git checkout of kprobe-harness")
    return out.stdout


def check_target(target: str) -> str:
    """``target`` if ssh can only read it as a host: not empty, no leading ``-`` (ssh
    would take ``-oProxyCommand=...`` as an option and run its command here), no
    whitespace or control character (the ``--tx`` spec and the remote command line are
    text). ``Ssh`` also puts ``--`` before it.

    :raise SetupError: one line naming the target and the fix, before anything runs.
    """
    if not target or target.startswith("-") or any(c.isspace() or not c.isprintable()
                                                   for c in target):
        why = ("starts with '-': ssh would read it as an option" if target.startswith("-")
               else "is empty" if not target else "has whitespace or a control character")
        raise SetupError(f"ssh target {target!r} {why}",
                         "name a host: [USER@]HOST, or a Host of --ssh-config")
    return target


def check_directory(directory: str) -> str:
    """``directory`` (the worker's checkout) if the remote commands can only read it as a
    path: not empty, no leading ``-`` (``mkdir -p -x``, ``git clone ... -x``), no
    ``//`` or ``=`` (the ``--tx`` spec splits on them), no control character.

    :raise SetupError: one line naming it and the fix.
    """
    if (not directory or directory.startswith("-") or "//" in directory or "=" in directory
            or any(not c.isprintable() for c in directory)):
        raise SetupError(f"--dir {directory!r} is not a plain path (empty, a leading '-', "
                         "'//', '=' or a control character)",
                         "pass a path such as /srv/kph or kph (relative to the remote home)")
    return directory


class Ssh:
    """``ssh`` to one target (``[user@]host``, or a Host of ``ssh_config``), batch mode.
    The target is checked (``check_target``) and follows ``--`` on ssh's command line."""

    def __init__(self, target: str, ssh_config: str | None = None) -> None:
        self.target = check_target(target)
        self.base = ["ssh", "-o", "BatchMode=yes"]
        if ssh_config:
            self.base += ["-F", ssh_config]

    def run(self, script: str, *, stdin: bytes | None = None, timeout: float = 600,
            progress: Progress | None = None, what: str = "") -> str:
        """Run ``script`` with the remote ``sh``; stream its stderr lines to ``progress``.

        :raise SetupError: ssh failed or the script exited non-zero (its last lines).
        """
        cmd = [*self.base, "--", self.target, "sh -c " + shlex.quote(script)]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if stdin is not None else
                                    subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as exc:
            raise SetupError("ssh is not available", "apt-get install openssh-client") from exc
        import threading

        err_lines: list[str] = []

        def pump() -> None:
            assert proc.stderr is not None
            for raw in proc.stderr:
                ln = raw.decode(errors="replace").rstrip("\n")
                err_lines.append(ln)
                if progress and ln.startswith(("==>", "image:", "qemu:", "snapshot:", "apt:",
                                               "toolchain:")):
                    progress(f"{self.target}: {ln}")
        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            if stdin is not None:
                assert proc.stdin is not None
                try:
                    proc.stdin.write(stdin)
                    proc.stdin.close()
                except BrokenPipeError:
                    pass    # ssh ended before reading it: its status and stderr say why
            assert proc.stdout is not None
            out_box: list[bytes] = []
            outr = threading.Thread(target=lambda: out_box.append(proc.stdout.read()), daemon=True)
            outr.start()
            proc.wait(timeout)
            outr.join(10)
            reader.join(10)
            out = out_box[0] if out_box else b""
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise SetupError(f"{self.target}: {what or 'remote command'} took more than "
                             f"{timeout:.0f} s") from None
        if proc.returncode != 0:
            tail = " | ".join(err_lines[-3:]) or f"exit {proc.returncode}"
            raise SetupError(f"{self.target}: {what or 'remote command'} failed: {tail}",
                             "check that the host is reachable with ssh (BatchMode) and "
                             "runs Debian 12 as root")
        return out.decode(errors="replace")


def prepare(target: str, *, directory: str, commit: str = "HEAD", kernels: list[str] | None = None,
            cache: str | None = None, ssh_config: str | None = None,
            progress: Progress = print) -> dict[str, Any]:
    """Make ``target`` a worker: the harness at ``commit`` in ``directory``, set up, its
    images built, identical to this checkout. Returns its identity plus ``tx``, the
    ``--tx`` spec for pytest-xdist (one worker per core of the host).

    :raise SetupError: the host is unreachable, setup failed there, or its identity
        differs from this checkout's (the message names every difference).
    """
    ssh = Ssh(target, ssh_config)
    check_directory(directory)
    # ^{commit}: a tag names its commit (git checkout --detach lands there, not on the tag)
    rev = _git("rev-parse", "--verify", "--end-of-options", f"{commit}^{{commit}}").strip()
    d = shlex.quote(directory)
    env = f"KPH_CACHE={shlex.quote(cache)} " if cache else ""
    with tempfile.TemporaryDirectory(prefix="kph-bundle-") as tmp:
        bundle = Path(tmp) / "kph.bundle"
        _git("bundle", "create", str(bundle), rev, "--branches", "--tags")
        progress(f"{target}: sending commit {rev[:12]} ({bundle.stat().st_size // 1024} KiB bundle)")
        ssh.run(f"mkdir -p -- {d} && cat > {d}.bundle", stdin=bundle.read_bytes(), what="upload")
    head = ssh.run(f"set -e; if [ -d {d}/.git ]; then cd {d} && git fetch -q {d}.bundle; "
                   f"else git clone -q -- {d}.bundle {d} && cd {d}; fi; git checkout -q --detach {rev}; "
                   f"rm -f {d}.bundle; git rev-parse HEAD", what="checkout")
    check_checkout(target, rev, head.strip())
    progress(f"{target}: running setup.sh")
    ssh.run(f"cd {d} && {env}./setup.sh", timeout=PREPARE_TIMEOUT, progress=progress,
            what="setup.sh")
    for k in kernels or []:
        progress(f"{target}: building the {k} image")
        ssh.run(f"cd {d} && {env}.venv/bin/kph image build --kernel {shlex.quote(k)}",
                timeout=PREPARE_TIMEOUT, progress=progress, what=f"kph image build --kernel {k}")
    wrapper = ("#!/bin/sh\n# The pytest-xdist interpreter of this worker (kph worker prepare).\n"
               + (f"export KPH_CACHE={shlex.quote(cache)}\n" if cache else "")
               + f"exec {shlex.quote(directory)}/.venv/bin/python \"$@\"\n")
    ssh.run(f"mkdir -p -- {d}/{WORKER_DIR} && cat > {d}/{WORKER_DIR}/python && "
            f"chmod 755 {d}/{WORKER_DIR}/python", stdin=wrapper.encode(), what="worker wrapper")
    remote = json.loads(ssh.run(f"cd {d} && {env}.venv/bin/kph worker identity --json --kernels "
                                + shlex.quote(",".join(["default", *(kernels or [])])),
                                what="kph worker identity"))
    check_checkout(target, rev, remote["commit"])       # setup.sh may not move it either
    local = local_identity(["default", *(kernels or [])])
    diff = differences(local, remote)
    if diff:
        raise SetupError(f"{target} is not identical to this checkout: {'; '.join(diff)}",
                         "results from different kernels, QEMUs or harness versions must not "
                         "be pooled; rebuild there (kph worker prepare) or here")
    remote["tx"] = (f"{remote['cores']}*ssh={target}"
                    + (f"//ssh_config={ssh_config}" if ssh_config else "")
                    + f"//python={directory}/{WORKER_DIR}/python//chdir={directory}")
    progress(f"{target}: ready: {remote['cores']} core(s); pytest --tx {remote['tx']}")
    return remote
