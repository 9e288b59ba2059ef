"""What the kernel does, as data and pure functions: no process, no socket, no file of the run.

Each module mirrors one kernel concept and names its source (file and function of the
kernel version it mirrors):

- ``kprobes``   the kprobes API as values (``include/linux/kprobes.h``): Kprobe, Kretprobe, PtRegs;
- ``rules``     what each kernel series decides differently (``kernel/kprobes.c``,
                ``kernel/trace/trace_kprobe.c``), keyed by version;
- ``symbols``   kallsyms, the KASLR slide, the blacklist, instruction boundaries;
- ``btf``       BTF types for ``$arg``/``->field`` fetch args (``kernel/bpf/btf.c``);
- ``ringbuf``   the trace ring buffer's event layout (``kernel/trace/ring_buffer.c``);
- ``dynevent``  what the trace-event layer decides between a parsed line and
                ``register_kprobe()`` (``kernel/trace/trace_dynevent.c``, ``trace_kprobe.c``);
- ``unwind``    frame-pointer stack walking (``arch/x86/kernel/unwind_frame.c``);
- ``emulate``, ``emucheck``  the probed instruction, single-stepped or emulated out of line
                (``arch/x86/kernel/kprobes/core.c``);
- ``elf``       the ELF images uprobes probe (``kernel/events/uprobes.c``'s view of a file);
- ``grammar/``  the dynamic-event grammar: one argument parser, two users (``trace_probe.c``,
                ``trace_kprobe.c``, ``trace_uprobe.c``).

Imports only the ground modules (``errors``, ``constants``, ``records``, ...).
"""
