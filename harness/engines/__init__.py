"""The host engines: Linux kprobes semantics run from outside the guest.

- ``base``             what both host engines share (registration rules, jprobes, function args,
                       the exception table): one core, two ways of stopping the guest;
- ``gdbstub_engine``   the gdbstub engine: breakpoints and stops through GDB (``HostEngine``);
- ``plugin_engine``    the plugin engine: QEMU's TCG plugin runs the trap, the host runs handlers;
- ``plugin_handlers``  the plugin engine's handler side;
- ``uprobes``          host-side uprobes and uretprobes.

"Host engine" is the general term; each engine is named by how it stops the guest.
"""
