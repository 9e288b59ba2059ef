"""The guest agent client against a scripted peer on a socketpair (no QEMU)."""
import json
import socket
import threading

import pytest

from harness.machine.agent import GuestAgent
from harness.errors import GuestAgentError, VMLostError


def _peer(sock, script):
    """Answer each request line with script(request) -> bytes."""
    buf = b""
    while True:
        data = sock.recv(65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.lstrip(b"\xff")
            if line:
                sock.sendall(script(json.loads(line)))


def _agent(script):
    a, b = socket.socketpair()
    threading.Thread(target=_peer, args=(b, script), daemon=True).start()
    return GuestAgent(a)


def test_sync_skips_stale_replies_and_junk():
    def script(req):
        if req["execute"] == "guest-sync-delimited":
            stale = b'\xff{"return": 1}\n'
            return b"garbage\n" + stale + b"\xff" + json.dumps({"return": req["arguments"]["id"]}).encode() + b"\n"
        return b'{"return": {"ok": 1}}\n'
    ag = _agent(script)
    ag.sync(2)
    assert ag.execute("guest-ping", timeout=2) == {"ok": 1}


def test_error_reply_is_typed():
    def script(req):
        if req["execute"] == "guest-sync-delimited":
            return b"\xff" + json.dumps({"return": req["arguments"]["id"]}).encode() + b"\n"
        return b'{"error": {"class": "GenericError", "desc": "no such file"}}\n'
    ag = _agent(script)
    with pytest.raises(GuestAgentError, match="no such file") as ei:
        ag.execute("guest-file-open", {"path": "/x"}, timeout=2)
    assert ei.value.error_class == "GenericError"


def test_silence_is_a_timeout_not_a_hang():
    ag = _agent(lambda req: b"")
    with pytest.raises(VMLostError):
        ag.sync(0.3)


def test_check_callback_interrupts_a_wait():
    class Boom(Exception):
        pass

    calls = []

    def check():
        calls.append(1)
        if len(calls) > 3:
            raise Boom

    a, b = socket.socketpair()
    ag = GuestAgent(a, check=check)
    with pytest.raises(Boom):
        ag.sync(30)
    b.close()


def test_exec_decodes_output_and_status():
    import base64

    def script(req):
        cmd = req["execute"]
        if cmd == "guest-sync-delimited":
            return b"\xff" + json.dumps({"return": req["arguments"]["id"]}).encode() + b"\n"
        if cmd == "guest-exec":
            return b'{"return": {"pid": 42}}\n'
        return json.dumps({"return": {"exited": True, "exitcode": 3,
                                      "out-data": base64.b64encode(b"hi\n").decode()}}).encode() + b"\n"
    ag = _agent(script)
    assert ag.exec(["/bin/sh", "-c", "x"], timeout=2) == (3, b"hi\n", b"")


def _synced_then(answer):
    """A peer that answers guest-sync-delimited, then ``answer(req)`` for the rest."""
    def script(req):
        if req["execute"] == "guest-sync-delimited":
            return b"\xff" + json.dumps({"return": req["arguments"]["id"]}).encode() + b"\n"
        return answer(req)
    return script


def test_an_overdue_reply_asks_stalled_which_may_end_the_wait():
    class Stopped(Exception):
        pass

    asked = []

    def stalled():
        asked.append(1)
        raise Stopped

    a, b = socket.socketpair()
    threading.Thread(target=_peer, args=(b, _synced_then(lambda req: b"")), daemon=True).start()
    ag = GuestAgent(a, stalled=stalled)
    ag.sync(2)
    import time
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        ag.execute("guest-ping", timeout=30)
    assert asked and time.monotonic() - t0 < 2.0


def test_no_reply_is_awaited_longer_than_the_reply_timeout(monkeypatch):
    import time

    import harness.machine.agent as agent_mod
    monkeypatch.setattr(agent_mod, "AGENT_REPLY_TIMEOUT", 0.4)
    ag = _agent(_synced_then(lambda req: b""))
    ag.sync(2)
    t0 = time.monotonic()
    with pytest.raises(VMLostError, match="did not answer guest-ping in time"):
        ag.execute("guest-ping", timeout=60)   # the command's own timeout is much longer
    assert time.monotonic() - t0 < 2.0


def test_an_abandoned_exchange_resyncs_before_the_next():
    """A reply that arrives after its request was given up (a Ctrl-C, a stall error) must
    not be taken for the next request's reply (seen: KeyError 'pid' from a stray reply)."""
    import time
    state = {"n": 0}

    def answer(req):
        state["n"] += 1
        if state["n"] == 1:
            time.sleep(0.8)           # late: the client has given up by then
            return b'{"return": {"late": true}}\n'
        return b'{"return": {"pid": 7}}\n'

    class Gone(Exception):
        pass

    calls = []

    def stalled():
        calls.append(1)
        if len(calls) == 1:
            raise Gone

    a, b = socket.socketpair()
    threading.Thread(target=_peer, args=(b, _synced_then(answer)), daemon=True).start()
    ag = GuestAgent(a, stalled=stalled)
    ag.sync(2)
    with pytest.raises(Gone):
        ag.execute("guest-ping", timeout=5)
    time.sleep(1.0)                    # the late reply is in the socket now
    assert ag.execute("guest-exec", {"path": "x"}, timeout=5) == {"pid": 7}


class _FakeQga:
    """qemu-ga's process list as qga/commands.c keeps it: an entry per guest-exec until
    its exited status is read, and guest-exec-status answers for the FIRST entry with
    the pid (guest_exec_info_find). ``pids`` are handed out in order, so a test can
    make a later process reuse an earlier pid; a command named "hang" never exits
    until it is killed."""

    def __init__(self, pids):
        import base64
        self.b64 = base64.b64encode
        self.pids = list(pids)
        self.entries = []          # [pid, argv, exited]

    def __call__(self, req):
        cmd, args = req["execute"], req.get("arguments", {})
        if cmd == "guest-sync-delimited":
            return b"\xff" + json.dumps({"return": args["id"]}).encode() + b"\n"
        if cmd == "guest-exec":
            pid = self.pids.pop(0)
            argv = [args["path"], *args.get("arg", [])]
            if argv[0] == "/bin/kill":
                for e in self.entries:
                    if e[0] == int(argv[2]) and not e[2]:
                        e[2] = True
            self.entries.append([pid, argv, argv[-1] != "hang"])
            return json.dumps({"return": {"pid": pid}}).encode() + b"\n"
        if cmd == "guest-exec-status":
            e = next((e for e in self.entries if e[0] == args["pid"]), None)
            if e is None:
                return b'{"error": {"class": "GenericError", "desc": "PID does not exist"}}\n'
            if not e[2]:
                return b'{"return": {"exited": false}}\n'
            self.entries.remove(e)
            out = "" if e[1][0] == "/bin/kill" else e[1][-1] + "\n"
            return json.dumps({"return": {"exited": True, "exitcode": 0,
                                          "out-data": self.b64(out.encode()).decode()}}).encode() + b"\n"
        return b'{"return": {}}\n'


def test_a_command_given_up_on_leaves_no_entry_to_answer_for_a_later_pid():
    """The command that timed out and the kill that ended it both get their status read,
    so a later process with either pid reads its own output (seen once in CI: an empty
    "exit 0" for `cat stats`)."""
    qga = _FakeQga([100, 101, 101, 100])
    ag = _agent(qga)
    with pytest.raises(VMLostError, match="did not finish"):
        ag.exec(["/bin/sh", "-c", "hang"], timeout=0.3)
    assert qga.entries == []
    assert ag.exec(["/bin/sh", "-c", "first"], timeout=2) == (0, b"first\n", b"")
    assert ag.exec(["/bin/sh", "-c", "second"], timeout=2) == (0, b"second\n", b"")


def test_an_entry_left_unread_is_drained_before_its_pid_is_polled_again():
    """A wait cut short (a stall error, Ctrl-C) leaves its entry; the next process with
    that pid must not be answered with the old one's status."""
    qga = _FakeQga([200, 200])
    a, b = socket.socketpair()
    threading.Thread(target=_peer, args=(b, qga), daemon=True).start()

    class Stop(Exception):
        pass

    ag = GuestAgent(a)
    real = ag.execute

    def once(cmd, args=None, **kw):
        if cmd == "guest-exec-status" and args["pid"] == 200 and not once.done:
            once.done = True
            raise Stop
        return real(cmd, args, **kw)
    once.done = False
    ag.execute = once
    with pytest.raises(Stop):
        ag.exec(["/bin/sh", "-c", "old"], timeout=2)
    assert ag.exec(["/bin/sh", "-c", "new"], timeout=2) == (0, b"new\n", b"")
    assert qga.entries == []


def _stalled_agent(script, stalled):
    a, b = socket.socketpair()
    threading.Thread(target=_peer, args=(b, script), daemon=True).start()
    return GuestAgent(a, stalled=stalled)


def test_a_guest_taking_host_probe_stops_gets_longer_than_the_reply_timeout(monkeypatch):
    """``stalled`` returning the time of the host's last probe stop: the guest runs,
    slowed by the host's probes, and the reply is awaited until the reply timeout after
    that stop (within the command's own timeout), not cut at the reply timeout."""
    import time

    import harness.machine.agent as agent_mod
    monkeypatch.setattr(agent_mod, "AGENT_REPLY_TIMEOUT", 0.8)  # past STALL_AFTER
    t0 = time.monotonic()

    def reply(req):
        time.sleep(1.5)         # later than the reply timeout
        return json.dumps({"return": {}}).encode() + b"\n"

    ag = _stalled_agent(_synced_then(reply), time.monotonic)  # a stop just now, each time
    ag.sync(2)
    assert ag.execute("guest-ping", timeout=5) == {}
    assert time.monotonic() - t0 >= 1.5


def test_host_probe_stops_do_not_stretch_the_commands_own_timeout(monkeypatch):
    import time

    import harness.machine.agent as agent_mod
    monkeypatch.setattr(agent_mod, "AGENT_REPLY_TIMEOUT", 0.8)  # past STALL_AFTER
    ag = _stalled_agent(_synced_then(lambda req: b""), time.monotonic)
    ag.sync(2)
    t0 = time.monotonic()
    with pytest.raises(VMLostError, match="did not answer guest-ping in time"):
        ag.execute("guest-ping", timeout=1.2)
    assert 1.1 <= time.monotonic() - t0 < 2.0


def test_a_pipeline_answers_each_request_in_order_and_returns_refusals():
    seen = []

    def answer(req):
        seen.append(req)
        n = req["arguments"]["n"]
        if n == 2:
            return (b'{"error": {"class": "GenericError", '
                    b'"desc": "Resource temporarily unavailable"}}\n')
        return json.dumps({"return": {"n": n}}).encode() + b"\n"
    ag = _agent(_synced_then(answer))
    got = ag.pipeline([("guest-file-read", {"n": i}) for i in range(5)], timeout=2)
    assert [g if isinstance(g, GuestAgentError) else g["n"] for g in got][:2] == [0, 1]
    assert isinstance(got[2], GuestAgentError) and "temporarily unavailable" in str(got[2])
    assert [g["n"] for g in got[3:]] == [3, 4]
    assert [r["arguments"]["n"] for r in seen] == list(range(5))
    assert ag.pipeline([], timeout=2) == []
    assert ag.execute("guest-file-read", {"n": 7}, timeout=2) == {"n": 7}     # still in step


def test_a_pipeline_missing_an_answer_is_a_timeout_and_the_next_call_resyncs():
    def answer(req):
        if req["arguments"]["n"] == 1:
            return b""                          # never answered
        return json.dumps({"return": {"n": req["arguments"]["n"]}}).encode() + b"\n"
    ag = _agent(_synced_then(answer))
    with pytest.raises(VMLostError):
        ag.pipeline([("x", {"n": i}) for i in range(3)], timeout=0.3)
    assert ag.execute("x", {"n": 5}, timeout=2) == {"n": 5}


def test_read_files_reads_each_whole_and_keeps_a_failed_open_apart():
    import base64
    content = {"/a": b"A" * 10, "/b": b"x" * ((1 << 20) + 5)}
    handles, pos, closed = {}, {}, []

    def answer(req):
        cmd, a = req["execute"], req["arguments"]
        if cmd == "guest-file-open":
            if a["path"] not in content:
                return b'{"error": {"class": "GenericError", "desc": "No such file"}}\n'
            h = len(handles) + 1
            handles[h], pos[h] = a["path"], 0
            return json.dumps({"return": h}).encode() + b"\n"
        if cmd == "guest-file-read":
            data = content[handles[a["handle"]]]
            chunk = data[pos[a["handle"]]:pos[a["handle"]] + a["count"]]
            pos[a["handle"]] += len(chunk)
            ret = {"count": len(chunk), "eof": pos[a["handle"]] >= len(data),
                   "buf-b64": base64.b64encode(chunk).decode()}
            return json.dumps({"return": ret}).encode() + b"\n"
        closed.append(a["handle"])
        return b'{"return": {}}\n'
    ag = _agent(_synced_then(answer))
    a, missing, b = ag.read_files(["/a", "/missing", "/b"], timeout=5)
    assert a == content["/a"] and b == content["/b"]
    assert isinstance(missing, GuestAgentError) and "No such file" in str(missing)
    assert sorted(closed) == [1, 2]


def test_write_files_writes_in_order_in_two_round_trips_and_closes_what_it_opened():
    import base64
    log, waves = [], []
    files = {"/a": "ok", "/b": "ok", "/bad-write": "EINVAL", "/no": "ENOENT"}

    def answer(req):
        cmd, a = req["execute"], req["arguments"]
        log.append((cmd, a.get("path") or a["handle"]))
        if cmd == "guest-file-open":
            if files[a["path"]] == "ENOENT":
                return b'{"error": {"class": "GenericError", "desc": "No such file"}}\n'
            return json.dumps({"return": list(files).index(a["path"]) + 1}).encode() + b"\n"
        if cmd == "guest-file-write":
            waves.append((a["handle"], base64.b64decode(a["buf-b64"])))
            if list(files)[a["handle"] - 1] == "/bad-write":
                return b'{"error": {"class": "GenericError", "desc": "Invalid argument"}}\n'
            return b'{"return": {"count": 1}}\n'
        return b'{"return": {}}\n'
    ag = _agent(_synced_then(answer))
    ag.sync(2)
    sends = []
    real_send = ag._send
    ag._send = lambda data: (sends.append(data), real_send(data))[1]
    ag.write_files([("/a", b"1\n"), ("/b", b"0\n")], timeout=2)
    assert waves == [(1, b"1\n"), (2, b"0\n")]            # in the items' order
    assert len(sends) == 2                                 # opens, then writes and closes
    assert [c for c, _ in log[-2:]] == ["guest-file-close"] * 2
    with pytest.raises(GuestAgentError, match="Invalid argument"):
        ag.write_files([("/a", b"x"), ("/bad-write", b"y"), ("/b", b"z")], timeout=2)
    assert [h for c, h in log[-3:] if c == "guest-file-close"] == [1, 3, 2]
    del log[:]
    with pytest.raises(GuestAgentError, match="No such file"):
        ag.write_files([("/a", b"x"), ("/no", b"y")], timeout=2)
    # nothing written when an open failed; what was opened is closed
    assert [c for c, _ in log] == ["guest-file-open", "guest-file-open", "guest-file-close"]


def test_a_pipeline_goes_in_half_duplex_waves_that_fit_one_read():
    """1,000 requests at once lost answers now and then, and requests sent while answers
    flowed back lost them every time (harness/machine/agent.py, PIPELINE_WAVE): the peer
    gets no request while any is unanswered, never more than a wave's bytes at once, and
    every answer comes back in order."""
    import harness.machine.agent as agent_mod
    wave = agent_mod.PIPELINE_WAVE
    seen = {"unanswered": 0, "early": 0, "most": 0, "waves": 0}

    def peer(sock):
        buf = b""
        while True:
            data = sock.recv(1 << 20)
            if not data:
                return
            if seen["unanswered"]:
                seen["early"] += 1
            buf += data
            seen["most"] = max(seen["most"], len(buf))
            lines = buf.split(b"\n")
            buf = lines.pop()
            reqs = [json.loads(x.lstrip(b"\xff")) for x in lines if x.lstrip(b"\xff")]
            seen["unanswered"] += len(reqs)
            seen["waves"] += 1
            for req in reqs:
                if req["execute"] == "guest-sync-delimited":
                    ans = b"\xff" + json.dumps({"return": req["arguments"]["id"]}).encode()
                else:
                    ans = json.dumps({"return": req["arguments"]}).encode()
                seen["unanswered"] -= 1
                sock.sendall(ans + b"\n")

    a, b = socket.socketpair()
    threading.Thread(target=peer, args=(b,), daemon=True).start()
    ag = GuestAgent(a)
    ag.sync(2)
    got = ag.pipeline([("x", {"n": i, "pad": "p" * 80}) for i in range(1000)], timeout=10)
    assert [g["n"] for g in got] == list(range(1000))
    assert seen["early"] == 0 and 0 < seen["most"] <= wave, seen
    assert seen["waves"] >= 1000 * 100 // wave, seen           # ~110 bytes a request
    ag.close()
    b.close()


def test_a_reply_timeout_names_the_file_of_a_handle(monkeypatch):
    import harness.machine.agent as agent_mod
    monkeypatch.setattr(agent_mod, "AGENT_REPLY_TIMEOUT", 0.3)

    def answer(req):
        if req["execute"] == "guest-file-open":
            return b'{"return": 7}\n'
        return b""                      # the write is never answered
    ag = _agent(_synced_then(answer))
    (h,) = ag.pipeline([("guest-file-open", {"path": "/sys/x/enable", "mode": "w"})], timeout=2)
    with pytest.raises(VMLostError, match=r"did not answer guest-file-write of /sys/x/enable"):
        ag.execute("guest-file-write", {"handle": h, "buf-b64": "MQo="}, timeout=10)


def test_a_running_commands_status_is_asked_often_while_young_then_seldom(monkeypatch):
    """GuestAgent.exec's polling (agent.py POLL_*): from 1 ms doubling, at most every
    POLL_SHORT while the command is younger than POLL_SHORT_FOR, then at most every
    POLL_LONG; on a clock of the test's own, the command exiting at 0.3 s."""
    import harness.machine.agent as agent_mod

    class Clock:
        now = 0.0
        slept: list[tuple[float, float]] = []

        def monotonic(self):
            return self.now

        def sleep(self, d):
            self.slept.append((self.now, d))
            self.now += d

    clock = Clock()
    monkeypatch.setattr(agent_mod, "time", clock)

    def answer(req):
        if req["execute"] == "guest-exec":
            return b'{"return": {"pid": 9}}\n'
        return json.dumps({"return": {"exited": clock.now >= 0.3, "exitcode": 0}}).encode() + b"\n"
    ag = _agent(_synced_then(answer))
    assert ag.exec(["/bin/true"], timeout=5) == (0, b"", b"")
    young = [d for t, d in clock.slept if t < agent_mod.POLL_SHORT_FOR]
    old = [d for t, d in clock.slept if t >= agent_mod.POLL_SHORT_FOR + agent_mod.POLL_SHORT]
    assert young[:3] == [0.001, 0.002, 0.004] and max(young) == agent_mod.POLL_SHORT
    assert old and set(old) == {agent_mod.POLL_LONG}
    assert clock.now - 0.3 < agent_mod.POLL_LONG        # asked again within one period
