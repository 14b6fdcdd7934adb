"""The applications: what wires the libraries into processes (the top floor below the command line).

Subrooms, lowest floor first: ``workers`` (each role's worker built from the run directory, the shared
life of a worker process, and the parts they share: wiring, channels, the initial policy and its
warm-up cache, evaluation), then ``commands`` (the one-shot commands of ``areal-async``: doctor, verify,
replay, plot, status, data, sft, train-only, check-plugin), which may use the workers' builders.
Nothing below this floor imports it (tests/unit/house/test_import_floors.py).
"""
