"""Differential runs: the same probes host-side and in the guest, and the verdict.

- ``runner``   one run of a probe set on one side, and the sides' registry;
- ``worlds``   the two worlds of a diff (host engine vs guest backend) on one machine;
- ``verdict``  the comparison: rules, normalizations, DiffResult (``compare``);
- ``matrix``   the same diff over the kernel matrix;
- ``report``   text, JSON and HTML renderings: it renders, never decides.
"""
