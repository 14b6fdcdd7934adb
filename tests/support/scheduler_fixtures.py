"""Driving a ``SchedulerCore`` without sockets: the messages a simulated fleet sends for one group."""

from __future__ import annotations

from protocols.messages import RewardResult, TrajectoryReady


def finish_group(core, req, v0: int, lengths: list[int], scores: list[float]) -> None:
    """Report group ``req`` (a GenerateRequest) generated from version ``v0`` on (``lengths`` output tokens a
    sample) and scored ``scores``, as its rollout and reward workers would; the core must take both."""
    n = len(req.sample_ids)
    traj = TrajectoryReady(
        group_id=req.group_id,
        worker_id="r0",
        n_prompt_tokens=3,
        sample_ids=list(req.sample_ids),
        n_output_tokens=list(lengths),
        version_min=[v0] * n,
        version_max=[core.version] * n,
        finish_reasons=["stop"] * n,
    )
    rew = RewardResult(req.group_id, "w", list(req.sample_ids), list(scores), ["ok"] * n, [""] * n)
    assert core.on_trajectory(traj) is None and core.on_reward(rew) is None
