"""One probe set and workload on several kernels: per kernel a host-vs-guest diff on one
execution, then what the *guests* do differently from one kernel to the next.

Pure: per-kernel results in (``KernelRun``), a ``MatrixResult`` out, no I/O; running the
kernels is ``harness.diff.runner.run_matrix``, printing is ``harness.diff.report``.

Between kernels the guests are compared probe by probe, on what a kernel decides and
prints, not on what differs between any two boots:

- ``registration``: accepted on one kernel, refused on another, or refused with another
  errno or message;
- ``mode``: how the kernel placed the probe (ftrace, int3, optimized, uprobe);
- ``events``: how many events the workload produced;
- ``ip``, ``ret_from`` and each fetch argument: the first event where the printed text
  differs. Two texts that read as the same number (``0x79`` and ``121``) are reported as
  a change of *format*, not of value.

pid, comm and cpu are not compared across kernels (every boot numbers its tasks afresh).
Symbolized addresses lose their ``/size`` (every build lays functions out anew), and a
return probe's ip (the caller's return site) is compared by the caller's name only: which
function called, not where in its code.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .verdict import AGENT_COMMS, DiffResult
from ..records import Hit, Outcome, SideResult

#: Fields of a guest event compared across kernels (pid, comm, cpu are per boot).
COMPARED = ("ip", "ret_from")


@dataclass
class KernelRun:
    """One kernel's part: its image, the host-vs-guest diff and the guest's own record."""

    name: str                     # the row's name: the series, or a tree's (6.12 src+fix)
    abi: str
    diff: DiffResult | None = None
    guest: SideResult | None = None
    host: SideResult | None = None
    error: str = ""               # the kernel could not be run at all (image, boot)
    rules: str = ""               # the kernel-series rules the host side used

    @property
    def equivalent(self) -> bool | None:
        """Host and guest agree (None: not measured)."""
        return None if self.diff is None else self.diff.equivalent


@dataclass(frozen=True)
class KernelDifference:
    """Where the guests of two or more kernels differ for one probe."""

    probe: str
    what: str                     # registration, mode, events, ip, ret_from, arg:NAME
    values: tuple[tuple[str, str], ...]   # (series, value) per kernel, in matrix order
    index: int = -1               # the event (0-based) for field differences
    note: str = ""                # "same value, different format", ...

    def groups(self) -> list[tuple[str, list[str]]]:
        """Values with the kernels that show each, in first-seen order."""
        out: dict[str, list[str]] = {}
        for series, v in self.values:
            out.setdefault(v, []).append(series)
        return list(out.items())


@dataclass
class MatrixResult:
    workload: str
    kernels: list[KernelRun] = field(default_factory=list)
    differences: list[KernelDifference] = field(default_factory=list)

    @property
    def all_equivalent(self) -> bool:
        return all(k.equivalent for k in self.kernels)


def _outcome_text(o: Outcome | None) -> str:
    if o is None:
        return "not registered"
    if o.accepted:
        return "accepted"
    import errno as _e
    return f"refused {_e.errorcode.get(o.errno, o.errno)}: {o.message}".rstrip(": ")


def _events(run: SideResult, probe: str) -> list[Hit]:
    return [h for h in run.hits if h.probe == probe and h.comm not in AGENT_COMMS]


def _as_number(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def compare_kernels(runs: list[KernelRun]) -> list[KernelDifference]:
    """What differs between the kernels' guests, probe by probe (module docstring)."""
    ran = [k for k in runs if k.guest is not None]
    if len(ran) < 2:
        return []
    probes: dict[str, None] = {}
    for k in ran:
        assert k.guest is not None
        probes.update(dict.fromkeys(o.probe for o in k.guest.outcomes))
    out: list[KernelDifference] = []
    for probe in probes:
        outcomes = {k.name: next((o for o in k.guest.outcomes if o.probe == probe), None)
                    for k in ran if k.guest is not None}
        texts = tuple((s, _outcome_text(o)) for s, o in outcomes.items())
        if len({t for _, t in texts}) > 1:
            out.append(KernelDifference(probe, "registration", texts))
        modes = tuple((s, o.mode or "?") for s, o in outcomes.items() if o and o.accepted)
        if len({m for _, m in modes}) > 1:
            out.append(KernelDifference(probe, "mode", modes))
        events = {k.name: _events(k.guest, probe) for k in ran if k.guest is not None
                  and outcomes.get(k.name) is not None and outcomes[k.name].accepted}
        if not events:
            continue
        counts = tuple((s, str(len(ev))) for s, ev in events.items())
        if len({c for _, c in counts}) > 1:
            out.append(KernelDifference(probe, "events", counts))
        out += _field_differences(probe, events)
    return out


def _field_differences(probe: str, events: dict[str, list[Hit]]) -> list[KernelDifference]:
    out = []
    n = min(len(ev) for ev in events.values())
    names: dict[str, None] = dict.fromkeys(COMPARED)
    for ev in events.values():
        for h in ev[:1]:
            names.update(dict.fromkeys(f"arg:{k}" for k, _ in h.args))
    for name in names:
        for i in range(n):
            vals = tuple((s, _field(ev[i], name)) for s, ev in events.items())
            distinct = {v for _, v in vals}
            if len(distinct) > 1:
                out.append(KernelDifference(probe, name, vals, i, _format_note(vals)))
                break
    return out


def _format_note(vals: tuple[tuple[str, str], ...]) -> str:
    """Say when the kernels print numbers in different bases (the values may differ too:
    pids, addresses)."""
    nums = {v: _as_number(v) for _, v in vals}
    if None in nums.values():
        return ""
    hexed = [s for s, v in vals if v.lower().startswith(("0x", "-0x"))]
    dec = [s for s, v in vals if not v.lower().startswith(("0x", "-0x"))]
    if hexed and dec:
        same = len(set(nums.values())) == 1
        return (f"{'same value, ' if same else ''}printed in hex on {', '.join(hexed)} and "
                f"in decimal on {', '.join(dec)}")
    return "same value, printed differently" if len(set(nums.values())) == 1 else ""


def _field(h: Hit, name: str) -> str:
    if name == "ip":
        if h.ip.startswith("["):            # [unknown/kretprobe'd]: a name, not sym/size
            return h.ip
        ip = h.ip.split("/", 1)[0]
        return ip.split("+", 1)[0] if h.kind == "r" else ip
    if name == "ret_from":
        return (h.ret_from or "").split("/", 1)[0]
    try:
        return h.arg(name[4:])
    except KeyError:
        return "<none>"
