"""Worker processes: ``worker`` (the shared life of one: logging, signals, uvloop, exit code), ``<role>_worker``
(each role built from the run directory, importing only what the role needs: the scheduler and reward
workers never import torch), ``wiring`` and ``channels``; the initial ``policy`` (with ``warmup_cache``)
and ``evaluate``, which the trainer worker runs and the eval/sft/data-filter commands reuse."""
