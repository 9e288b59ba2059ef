#!/usr/bin/env bash
# Set up kprobe-harness on Debian 12, idempotently: system packages, a virtualenv with
# the package and its test and documentation tools, a QEMU >= 10.2 (private, only if the
# system's is older), the kernel headers for the image's kernel, and the embedded default
# image.
# Safe to run again: every step skips what is already done.
set -euo pipefail
cd "$(dirname "$0")"
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
say() { printf '==> %s\n' "$*" >&2; }

# The last line: what `kph kernel build` needs to build a kernel from source (BTF: pahole).
PKGS="qemu-system-x86 qemu-utils gdb busybox-static cpio qemu-guest-agent python3-venv
      python3-pip make gcc libc6-dev chromium
      flex bison bc libelf-dev libssl-dev dwarves ccache"
# Another apt (a second setup.sh, unattended-upgrades) may hold apt's locks: wait for them.
APT_WAIT="-o DPkg::Lock::Timeout=600"
apt_update() {
  for _ in $(seq 120); do
    $SUDO apt-get update -q $APT_WAIT >/dev/null 2>/tmp/kph-apt-update.$$ && { rm -f /tmp/kph-apt-update.$$; return 0; }
    grep -q "Could not get lock" /tmp/kph-apt-update.$$ || { cat /tmp/kph-apt-update.$$ >&2; rm -f /tmp/kph-apt-update.$$; return 1; }
    sleep 5
  done
  echo "error: apt's lists stayed locked for 10 minutes" >&2; return 1
}
say "apt: updating package lists"
apt_update
missing=$(for p in $PKGS; do dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed' || echo "$p"; done)
if [ -n "$missing" ]; then
  say "apt: installing" $missing
  $SUDO apt-get install -y -q $APT_WAIT --no-install-recommends $missing >/dev/null
fi

abi=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-/{sub("linux-image-","",$2); print $2; exit}')
[ -n "$abi" ] || { echo "error: apt knows no linux-image-cloud-amd64; check /etc/apt/sources.list.d" >&2; exit 2; }
if ! dpkg-query -W -f='${Status}\n' "linux-headers-$abi" 2>/dev/null | grep -q '^install ok installed'; then
  say "apt: installing linux-headers-$abi (for the in-guest kprobes module)"
  $SUDO apt-get install -y -q $APT_WAIT --no-install-recommends "linux-headers-$abi" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  say "python: creating .venv"
  python3 -m venv .venv
fi
if ! .venv/bin/python -c 'import harness, pygdbmi, qemu.qmp, elftools, xdist, pytest_timeout, mkdocs, mkdocstrings_handlers.python' 2>/dev/null \
   || [ pyproject.toml -nt .venv/.kph-installed ]; then
  say "python: installing kprobe-harness, its test and documentation tools into .venv"
  .venv/bin/pip install -q --disable-pip-version-check -e '.[test,docs]'
  touch .venv/.kph-installed
fi
# harness' bytecode, written once: every kph process imports ~140 of its modules, and
# with PYTHONDONTWRITEBYTECODE set (containers often set it) each process would compile
# them again (0.2 s a process); a module edited later is compiled in memory, as without
.venv/bin/python -m compileall -q harness

.venv/bin/kph qemu provision
.venv/bin/kph image build
say "ready: .venv/bin/kph doctor"
