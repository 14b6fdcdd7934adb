"""Rollout engines: the ``RolloutEngine`` seam (``engine``) and the embedded ``TorchEngine``.

The package root imports nothing: the supervisor reads torch-free modules through it
(``server_auth``), and ``import areal_async.cli`` must not load torch (tests/unit/house/test_import_floors.py).
"""
