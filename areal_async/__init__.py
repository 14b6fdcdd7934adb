"""areal-async: asynchronous RL post-training on ZeroMQ workers.

The Python API (``areal_async.api``): ``load_config(path, overrides)`` and ``Fleet(cfg)`` to start,
wait for, stream the metrics of and stop a run from a program. Loaded on first use, so importing
a submodule (``areal_async.config``, a worker) does not pay for it.
"""

__all__ = ["Fleet", "FleetError", "load_config"]


def __getattr__(name: str):
    if name in ("Fleet", "FleetError"):
        import areal_async.api

        return getattr(areal_async.api, name)
    if name == "load_config":
        from areal_async.config import load_config

        return load_config
    raise AttributeError(f"module 'areal_async' has no attribute {name!r}")
