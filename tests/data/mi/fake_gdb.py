#!/usr/bin/env python3
"""A scripted stand-in for ``gdb --interpreter=mi3`` (tests/unit/test_gdbstub_races.py).

It answers the commands GdbStub sends with the records a real GDB 13 sent in a recorded
run (DEBUG log of harness.gdbstub, 2026-11-25), in the same order, including the race
that once killed the probe dispatcher: a breakpoint hit that arrives while -thread-info
is refused because the target was running. ``FAKE_GDB_ONE_READ=1``: a step's records
all come in one write.
"""
import os
import re
import sys
import time

BP = "0xffffffff817b6594"
AFTER_STEP = "0xffffffffc0405000"
NAMES = ("rax rbx rcx rdx rsi rdi rbp rsp r8 r9 r10 r11 r12 r13 r14 r15 rip eflags "
         "cs ss ds es fs gs").split()
RUNNING_ERR = ('^error,msg="Cannot execute this command while the target is running.\\n'
               'Use the \\"interrupt\\" command to stop the target\\nand then try again."')
running = False


def out(*lines):
    for ln in lines:
        sys.stdout.write(ln + "\n")
    sys.stdout.write("(gdb) \n")
    sys.stdout.flush()


def stopped(reason, addr, extra=""):
    return (f'*stopped,reason="{reason}"{extra},frame={{addr="{addr}",func="??",args=[],'
            f'arch="i386:x86-64"}},thread-id="1",stopped-threads="all"')


for line in sys.stdin:
    m = re.match(r"(\d*)(.*)", line.rstrip("\n"))
    tok, cmd = m[1], m[2]
    if cmd.startswith("-data-list-register-names"):
        out(f'{tok}^done,register-names=[{",".join(chr(34) + n + chr(34) for n in NAMES)}]')
    elif cmd.startswith("-thread-info"):
        if running:
            # the hit's *stopped comes with the refusal (as recorded: ^error first)
            running = False
            out(tok + RUNNING_ERR, '=breakpoint-modified,bkpt={number="85"}',
                stopped("breakpoint-hit", BP, ',disp="keep",bkptno="85"'))
        else:
            out(f'{tok}^done,threads=[{{id="1",state="stopped"}}],current-thread-id="1"')
    elif cmd.startswith("-data-list-register-values"):
        out(f'{tok}^done,register-values=[{{number="16",value="{BP}"}}]')
    elif cmd.startswith(("-exec-jump", "-exec-continue")):
        running = True
        out(f"{tok}^running", '*running,thread-id="all"')
    elif cmd.startswith("-exec-step-instruction") and os.environ.get("FAKE_GDB_ONE_READ"):
        # as recorded under load (2026-12-03): the step's answer, its *running and its
        # *stopped reach the reader in one read
        out(f"{tok}^running", '*running,thread-id="1"', stopped("end-stepping-range", AFTER_STEP))
    elif cmd.startswith("-exec-step-instruction"):
        running = True
        out(f"{tok}^running", '*running,thread-id="1"')
        time.sleep(0.05)
        running = False
        out(stopped("end-stepping-range", AFTER_STEP))
    elif cmd.startswith("-exec-interrupt"):
        running = False
        out(f"{tok}^done", stopped("signal-received", BP, ',signal-name="SIGINT"'))
    elif cmd.startswith("-gdb-exit"):
        out(f"{tok}^exit")
        break
    else:
        out(f"{tok}^{'connected' if cmd.startswith('-target-select') else 'done'}")
