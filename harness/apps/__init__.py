"""What users run, built on the layers below.

- ``repro``, ``repro_rr``, ``scenario``  reproducers, recorded and replayed;
- ``fuzz``, ``fuzzshard``                grammar fuzzing against the kernel;
- ``trapflow``                           the kprobe trap-flow demo;
- ``doctor``                             what this machine can run;
- ``remote``, ``loopback_sshd``          SSH scale-out workers;
- ``pytest_plugin``                      the pytest plugin (fixtures and options).
"""
