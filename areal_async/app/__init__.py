"""The applications: what wires the libraries into processes (the top floor below the command line).

``worker`` is the shared life of a worker process (logging, signals, uvloop, exit code);
``<role>_worker`` builds that role's service from the run directory, importing only what the
role needs (the scheduler and reward workers never import torch); ``wiring`` and ``channels``
are the parts they share; ``sft`` is the one-process ``areal-async sft`` application.
Nothing below this floor imports it (tests/unit/house/test_import_floors.py).
"""
