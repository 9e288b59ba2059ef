"""In-guest probes through the guest kernel's own tracefs ``kprobe_events`` (and
``uprobe_events`` for uprobe lines, with ``uprobe_profile`` for their counts).

Each spec line is appended to ``/sys/kernel/tracing/kprobe_events`` as written (the
grammar is the kernel's, so the kernel is the judge: a refusal comes back as the write's
errno and the ``error_log`` text), its event enabled, and the trace buffer read back and
parsed (``harness.fetchargs.parse_trace_line``). ``kprobe_profile`` gives nhit/nmissed and
``/sys/kernel/debug/kprobes/list`` the mode of each probe (ftrace, optimized or int3).
"""
from __future__ import annotations

import errno as _errno
import logging
import os
import shlex
from typing import Any, Sequence

from ..fetchargs import parse_trace_line
from ..probespec import ProbeSpec, kernel_format
from ..records import Counters, Hit, Outcome

log = logging.getLogger(__name__)

TRACING = "/sys/kernel/tracing"
KPROBES_LIST = "/sys/kernel/debug/kprobes/list"
#: glibc's strerror() text -> errno, for the shell's "write error: ..." message.
_STRERROR = {os.strerror(n): n for n in range(1, 134)}


def probe_modes(listing: str) -> dict[int, str]:
    """address -> ftrace / optimized / int3 (or disabled), from the debugfs kprobes list."""
    modes: dict[int, str] = {}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        try:
            addr = int(parts[0], 16)
        except ValueError:
            continue
        mode = "ftrace" if "[FTRACE]" in line else "optimized" if "[OPTIMIZED]" in line else "int3"
        modes.setdefault(addr, mode)
    return modes


def _events_file(spec: ProbeSpec) -> str:
    """``uprobe_events`` for a uprobe line, else ``kprobe_events``."""
    return "uprobe_events" if spec.is_uprobe else "kprobe_events"


class EventsBackend:
    """``kprobe_events`` in the guest. One instance per Machine and run."""

    side = "events"

    def __init__(self, vm: Any) -> None:
        self.vm = vm
        self.specs: dict[str, ProbeSpec] = {}
        self.outcomes: list[Outcome] = []

    def _sh(self, cmd: str, *, check: bool = True, timeout: float = 60) -> str:
        return self.vm.run(cmd, check=check, timeout=timeout).stdout

    def register(self, specs: Sequence[ProbeSpec]) -> list[Outcome]:
        """All specs in one guest script (one agent round trip), each line's fate reported."""
        script = [f"cd {TRACING}", "echo 0 > tracing_on", "echo > trace",
                  "grep -q '^16384' buffer_size_kb || echo 16384 > buffer_size_kb"]
        for spec in specs:
            line = shlex.quote(kernel_format(spec))
            script.append(f"if echo {line} >> {_events_file(spec)} 2>/tmp/kph.err; then "
                          f"echo 1 > events/{spec.group}/{spec.event}/enable && echo '@ok'; "
                          "else echo \"@err $(cat /tmp/kph.err)\"; "
                          "tail -n 3 error_log | grep 'error:' | tail -n 1; fi")
        script.append(f"echo '@list'; cat {KPROBES_LIST}")
        text = self._sh("\n".join(script), timeout=120)
        results, _, listing = text.partition("@list\n")
        out, lines, i = [], results.splitlines(), 0
        for spec in specs:
            name = f"{spec.group}/{spec.event}"
            while i < len(lines) and not lines[i].startswith("@"):
                i += 1
            status = lines[i] if i < len(lines) else "@err unknown"
            detail = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("@") else ""
            i += 1
            if status == "@ok":
                self.specs[name] = spec
                out.append(Outcome(name, True))
            else:
                msg = status[5:].strip().rsplit("write error: ", 1)[-1]
                text_err = detail.split("error:", 1)[1].strip() if "error:" in detail else msg
                out.append(Outcome.rejected(name, _STRERROR.get(msg, _errno.EINVAL), text_err))
        modes = probe_modes(listing)
        self.outcomes = [self._with_mode(o, modes) for o in out]
        return self.outcomes

    def _with_mode(self, o: Outcome, modes: dict[int, str]) -> Outcome:
        spec = self.specs.get(o.probe)
        if not o.accepted or spec is None:
            return o
        if spec.is_uprobe:
            return Outcome(o.probe, True, mode="uprobe")
        try:
            addr = spec.addr if spec.addr is not None else \
                self.vm.symbols.lookup(spec.symbol_name).addr + spec.offset
        except KeyError:
            return o
        # An IBT kernel places SYM+0 at +4, past the ENDBR (arch_adjust_kprobe_addr).
        mode = modes.get(addr) or (modes.get(addr + 4) if not spec.offset else None)
        return Outcome(o.probe, True, mode=mode or "int3")

    def enable(self) -> None:
        # Through the agent's file API, not a shell: the only process that opens
        # tracing_on is then qemu-ga, whose hits the diff leaves out on both sides.
        self.vm.write_file(f"{TRACING}/trace", b"\n")
        self.vm.write_file(f"{TRACING}/tracing_on", b"1\n")

    def disable(self) -> None:
        self.vm.write_file(f"{TRACING}/tracing_on", b"0\n")

    def collect(self) -> list[Hit]:
        text = self._sh(f"cat {TRACING}/trace", timeout=120)
        names = {spec.event: (name, spec) for name, spec in self.specs.items()}
        modes = {o.probe: o.mode for o in self.outcomes}
        hits = []
        for line in text.splitlines():
            head = parse_trace_line(line)
            if head is None or head.event not in names:
                continue
            name, spec = names[head.event]
            rec = parse_trace_line(line, [a.name for a in spec.args])
            assert rec is not None
            hits.append(Hit(side=self.side, probe=name, kind="r" if spec.is_return else "p",
                            seq=len(hits), cpu=rec.cpu, pid=rec.pid, comm=rec.comm,
                            ip=rec.ip_text, ret_from=rec.ret_from,
                            args=tuple((a.name, rec.raw_fields.get(a.name, "")) for a in spec.args),
                            mode=modes.get(name, "")))
        return hits

    def counters(self) -> dict[str, Counters]:
        out = {}
        by_event = {spec.event: name for name, spec in self.specs.items()}
        text = self._sh(f"cat {TRACING}/kprobe_profile; echo @u; cat {TRACING}/uprobe_profile")
        kprobes, _, uprobes = text.partition("@u\n")
        for line in kprobes.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] in by_event:
                name = by_event[parts[0]]
                out[name] = Counters(name, int(parts[1]), int(parts[2]))
        for line in uprobes.splitlines():       # "PATH EVENT NHIT": uprobes count no misses
            parts = line.split()
            if len(parts) >= 3 and parts[1] in by_event:
                name = by_event[parts[1]]
                out[name] = Counters(name, int(parts[2]), 0)
        return out

    def close(self) -> None:
        """Disable and delete our events; tracing is left on, the buffer empty."""
        if self.vm.aborting:  # interrupted: the guest is about to vanish
            self.specs.clear()
            return
        cmds = []
        for spec in self.specs.values():
            cmds.append(f"echo 0 > {TRACING}/events/{spec.group}/{spec.event}/enable")
            cmds.append(f"echo '-:{spec.group}/{spec.event}' >> {TRACING}/{_events_file(spec)}")
        cmds.append(f"echo > {TRACING}/trace; echo 1 > {TRACING}/tracing_on")
        self.vm.run("; ".join(cmds), timeout=60)
        self.specs.clear()
