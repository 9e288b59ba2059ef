"""The dynamic-event grammar, split as the kernel splits it.

- ``common``   fetch arguments as Linux 6.12 and 7.3 parse them (``kernel/trace/trace_probe.c``:
               ``traceprobe_parse_probe_arg()``), BTF arguments included;
- ``kprobe``   ``kprobe_events`` lines (``kernel/trace/trace_kprobe.c``), with the 6.1 argument
               parser, the error log and the line types both users share;
- ``uprobe``   ``uprobe_events`` lines (``kernel/trace/trace_uprobe.c``);
- ``fetch``    what fetch args are and yield: the tree, host-side evaluation, printed text
               (``kernel/trace/trace_probe_tmpl.h``: ``process_fetch_insn()``);
- ``program``  fetch args compiled for the QEMU plugin, and its captures read back.
"""
