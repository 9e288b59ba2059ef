"""The machine: one QEMU process and what talks to it, below any kprobe semantics.

``harness.vmctl`` (Machine) and ``harness.gdbstub`` (GdbStub) rank here too; they stay at the
package's top because the project's design names them.

- ``qemu``        the private QEMU build and its identity;
- ``agent``       the guest agent (exec, files, tracefs);
- ``pluginlink``  the Python side of the QEMU TCG plugin (``probes/plugin/`` is its C side):
                  build, load, the control socket and the rings;
- ``handlerctx``  what runs while the guest is stopped, and what it may not call;
- ``snapshot``    boot once, restore many: the snapshot store;
- ``memo``        what was read from a guest once, kept per machine while it lives;
- ``boot``        restore-or-build, the step ``Machine.boot`` runs;
- ``replay``      record/replay of a whole run (QEMU's ``-icount rr``);
- ``image/``      the image store, its build, the kernels and their facts.
"""
