"""One GPU check for the first GPU machine: ``scripts/gpu_check.sh`` (or ``python3 -m benchmarks.gpu_check``).

Each check prints one JSON line ``{"name", "status": pass|fail|skipped, "detail", "seconds", "data"}``;
the exit status is non-zero when any check failed. Checks that need CUDA say ``"skipped: no CUDA"``
on a machine without one. The checks are listed in ``registry.CHECKS`` (name, "module:function",
needs CUDA, timeout); a check module is imported only when its check runs, so a missing package
(pyzmq on a bare GPU box) fails that check with the import error instead of the whole run.

To add a check: write ``def my_check() -> Result`` in a module of this package (``dev`` argument when
it has a CPU twin, see ``registry.Check.cpu_twin``) and add one ``Check(...)`` line to ``CHECKS``.
"""
