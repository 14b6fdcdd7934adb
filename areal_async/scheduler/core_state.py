"""The scheduler core's checkpointable state: what a resumed run needs to continue the same books, and
how ``SchedulerCore.restore`` takes it back (split from ``core.py``, which calls these)."""

from __future__ import annotations

from collections import deque

from areal_async.scheduler.ledger import Ledger


def core_state(core) -> dict:
    """Everything a resumed run needs to continue the same books (JSON-able). Taken between
    steps only: the trainer saves it before its next step, so no batch may be planned then."""
    if core.trainer_busy:
        raise ValueError(f"scheduler state asked for while step {core.next_step} is planned; only between steps")
    return {
        "version": core.version,
        "next_step": core.next_step,
        "cursor": core.cursor.state(),
        "reissue": [list(x) for x in core.reissue],
        "ledger": core.ledger.to_state(),
        "resumes": core.resumes,
        "reissues": dict(core.reissues),
        "n_reissued": dict(core.n_reissued),
        "wasted_tokens": core.tail.wasted,
    } | ({"prompt_memory": core.memory.state()} if core.memory is not None else {})


def restore_core(core, state: dict, at_least: int = 0) -> list:
    """Continue from a checkpoint's state. Groups that were open at the checkpoint (their
    samples neither trained nor aborted then) are aborted now with a reason and their
    prompts re-issued first; returns those records (already logged). New ids get the prefix
    ``r<k>-``, k = the checkpoint's resumes + 1, or ``at_least`` if more: two attempts resumed
    from the same checkpoint (a recovery that failed again before a newer one) must not
    issue the same ids."""
    core.version, core.next_step = int(state["version"]), int(state["next_step"])
    c = core.cursor
    core.cursor = type(c).from_state(c.n, c.seed, c.shuffle, state["cursor"])
    core.resumes = max(int(state.get("resumes", 0)) + 1, at_least)
    core.ledger = Ledger.from_state(state["ledger"])
    core.ledger.id_prefix = f"r{core.resumes}-"
    core.reissue = deque(tuple(x) for x in state["reissue"])
    core.reissues = {str(k): int(v) for k, v in state.get("reissues", {}).items()}
    core.n_reissued.update({k: int(v) for k, v in state.get("n_reissued", {}).items()})
    core.tail.wasted = int(state.get("wasted_tokens", 0))
    if core.memory is not None:
        core.memory.restore(state.get("prompt_memory", {}))
    core.accepted = core.next_step * core.p.batch_size  # every group still open is re-issued below
    core.finished = core.next_step >= core.p.total_steps
    out = []
    for g in core.ledger.open_groups():
        out += core._abort(
            g.group_id,
            f"recovered: in flight at the checkpoint after step {core.next_step - 1}; prompt re-issued",
            reissue=True,
        )
    core.ledger.forget_final()
    core.aborted_since_plan = []
    core.short_steps, core.revisions = set(), {}
    return out
