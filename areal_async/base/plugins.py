"""Load plug-ins (reward functions, rollout hooks, losses) named by a dotted path.

Covered: ``"package.module:attr"`` (preferred; ``attr`` may be nested, ``"mod:Cls.method"``) and
``"package.module.attr"``; results are cached so a hot path can call ``load_callable`` freely.
Not covered: file paths, entry points, or installing anything.

``contract_problem(path, kind)`` is the static half of a plug-in's contract (it imports and
inspects, runs nothing): ``areal-async check-plugin`` runs the plug-in after it, the preflight of
``areal-async run`` stops at it.
"""

from __future__ import annotations

import functools
import importlib
import inspect

__all__ = [
    "load_callable",
    "contract_problem",
    "REWARD_SIGNATURE",
    "WORKFLOW_SIGNATURE",
    "FILTER_SIGNATURE",
    "AGENT_SIGNATURE",
]

REWARD_SIGNATURE = "f(completion: str, solutions: list[str], **kwargs) -> float"
WORKFLOW_SIGNATURE = "'async def arun_episode(self, engine, prompt)'"
FILTER_SIGNATURE = "f(scores: list[float], **kwargs) -> bool (True keeps the group)"
AGENT_SIGNATURE = "async def fn(client, task) -> float | (float, info)"


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


def contract_problem(path: str, kind: str = "auto") -> tuple[str, str | None]:
    """(kind, what breaks the contract or None) of the plug-in ``path``: it loads, and a reward fn
    binds ``(completion, solutions)``; a workflow is a class with ``async arun_episode(self, engine,
    prompt)``. ``kind`` auto: a class is a workflow, anything else a reward fn. Runs nothing."""
    try:
        obj = load_callable(path)
    except ValueError as e:
        return "unknown", f"cannot load: {e}"
    if kind == "auto":  # a class is a workflow, an async function an agent, anything else a reward fn
        kind = "workflow" if inspect.isclass(obj) else "agent" if inspect.iscoroutinefunction(obj) else "reward"
    if kind == "dynamic_filter":
        return kind, _filter_problem(path, obj)
    if kind == "agent":
        return kind, _agent_problem(path, obj)
    if kind not in ("reward", "workflow"):
        raise ValueError(f"kind={kind!r}: expected auto | reward | workflow | dynamic_filter | agent")
    return kind, (_workflow_problem(path, obj) if kind == "workflow" else _reward_problem(path, obj))


def _filter_problem(path: str, fn) -> str | None:
    """rollout.dynamic_filter: called as f(scores, prompt_id=..., n_output_tokens=[...])."""
    try:
        inspect.signature(fn).bind([1.0, 0.0], prompt_id="p", n_output_tokens=[1, 1])
    except TypeError as e:
        return f"wrong signature: dynamic filter {path!r} ({e}); it must be callable as {FILTER_SIGNATURE}"
    except ValueError:  # a builtin without a signature
        return None
    return None


def _agent_problem(path: str, fn) -> str | None:
    """rollout.agent: awaited as fn(client, task) in the rollout worker's event loop."""
    if inspect.isclass(fn) or not inspect.iscoroutinefunction(fn):
        return f"wrong signature: agent {path!r} is not an async function; expected {AGENT_SIGNATURE}"
    bad = signature_problem(fn, (None, {}))
    if bad:
        return f"wrong signature: agent {path!r} is {bad}; expected {AGENT_SIGNATURE}"
    return None


def _reward_problem(path: str, fn) -> str | None:
    bad = signature_problem(fn, ("completion", ["12"]))
    if bad:
        return f"wrong signature: reward fn {path!r} is {bad}; a reward fn must be callable as {REWARD_SIGNATURE}"
    return None


def _workflow_problem(path: str, cls) -> str | None:
    if not inspect.isclass(cls):
        return f"not a class: workflow {path!r} is a {type(cls).__name__}; expected a class with {WORKFLOW_SIGNATURE}"
    method = getattr(cls, "arun_episode", None)
    if method is None or not inspect.iscoroutinefunction(method):
        found = "missing" if method is None else f"a plain {type(method).__name__}"
        return f"wrong signature: workflow {path!r} has arun_episode {found}; expected {WORKFLOW_SIGNATURE}"
    bad = signature_problem(method, (None, None, None))
    if bad:
        return f"wrong signature: workflow {path!r}: arun_episode is {bad}; expected {WORKFLOW_SIGNATURE}"
    return None


def signature_problem(fn, args: tuple) -> str | None:
    """Why ``fn(*args)`` cannot bind, or None (builtins without a signature pass)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        sig.bind(*args)
    except TypeError as e:
        return f"{getattr(fn, '__name__', fn)}{sig} ({e})"
    return None
