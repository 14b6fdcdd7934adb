"""The base floor: what every process of the fleet stands on, below the config and the role libraries.

``control`` (a worker's link to the scheduler), ``endpoints`` (where the peers listen),
``affinity`` (cpu lists, pinning), ``process`` (worker logging, torch threads), ``plugins``
(dotted-path loading). Imports only the standard library, third-party packages and ``protocols``;
nothing here knows the config or any role (tests/unit/house/test_import_floors.py checks it).
"""
