"""Load plug-ins (reward functions, rollout hooks, losses) named by a dotted path.

Covered: ``"package.module:attr"`` (preferred; ``attr`` may be nested, ``"mod:Cls.method"``) and
``"package.module.attr"``; results are cached so a hot path can call ``load_callable`` freely.
Not covered: file paths, entry points, or installing anything.
"""

from __future__ import annotations

import functools
import importlib

__all__ = ["load_callable"]


@functools.lru_cache(maxsize=None)
def load_callable(path: str):
    """Return the callable named by ``path``; ``ValueError`` names the path and what is wrong."""
    module_name, attr_path = _split(path)
    obj = _resolve(_import(module_name, path), attr_path, path)
    if not callable(obj):
        raise ValueError(f"plug-in {path!r} resolves to {obj!r} ({type(obj).__name__}), which is not callable")
    return obj


def _split(path) -> tuple[str, str]:
    """``"a.b:c"`` or ``"a.b.c"`` -> ``("a.b", "c")``."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"plug-in path must be a non-empty string 'package.module:function', got {path!r}")
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
    else:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path or ":" in attr_path:
        raise ValueError(
            f"plug-in path {path!r} is malformed: expected 'package.module:function' or 'package.module.function'"
        )
    return module_name.strip(), attr_path.strip()


def _import(module_name: str, path: str):
    try:
        return importlib.import_module(module_name)
    except ImportError as e:  # includes ModuleNotFoundError, of the module or of one it imports
        raise ValueError(f"plug-in {path!r}: cannot import module {module_name!r}: {e}") from e
    except Exception as e:  # a plug-in whose import crashes is as unusable as a missing one
        raise ValueError(f"plug-in {path!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from e


def _resolve(obj, attr_path: str, path: str):
    for name in attr_path.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError as e:
            raise ValueError(f"plug-in {path!r}: {obj!r} has no attribute {name!r}") from e
    return obj
