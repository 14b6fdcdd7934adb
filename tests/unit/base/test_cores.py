"""cluster.share_cores (base/cores.py): the CPU table the torch workers of a run share, the shares it gives,
and the pacing of a training step's threads by it, layer by layer in forward and in backward."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from areal_async.base import cores
from areal_async.base.cores import CoreShare, fair_share, runnable_now, slot_of
from areal_async.config import from_dict
from areal_async.config.base import ConfigError


@pytest.mark.parametrize(
    "cpus, busy, me, want",
    [
        (2, [], 0, 2),  # alone: every CPU
        (2, [0], 0, 2),  # listed or not, ``me`` counts once
        (2, [1], 0, 1),  # one other busy worker: half
        (2, [0, 1], 1, 1),
        (2, [1, 2], 0, 1),  # three workers on two CPUs: at least one thread each
        (4, [1, 2], 0, 2),  # 4 CPUs over 3: 2, 1, 1 (the remainder to the lowest slot)
        (4, [0, 1], 2, 1),
        (5, [3], 0, 3),  # 5 over 2: 3 and 2
        (5, [0], 3, 2),
        (1, [1], 0, 1),
    ],
)
def test_fair_share_splits_the_cpus_among_the_busy_workers(cpus, busy, me, want):
    assert fair_share(cpus, busy, me) == want


def test_slots_put_trainer_ranks_first_then_rollout_workers():
    assert [slot_of("trainer", r, 2) for r in range(2)] == [0, 1]
    assert [slot_of("rollout", i, 2) for i in range(3)] == [2, 3, 4]
    with pytest.raises(ValueError, match="reward"):
        slot_of("reward", 0, 2)


def _busy_worker(path: str, started, release) -> None:
    share = CoreShare(path, 3, 2, cpus=2, running=lambda: 1)
    with share.busy():
        started.set()
        release.wait(30)


def test_another_process_busy_halves_the_share_and_its_end_restores_it(tmp_path):
    """Two real processes on one table file: the child's busy byte is what the parent's share reads."""
    path = str(tmp_path / "cores")
    me = CoreShare(path, 3, 0, cpus=2, running=lambda: 1)
    assert me.share() == 2 and me.busy_slots() == []
    ctx = mp.get_context("spawn")
    started, release = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_busy_worker, args=(path, started, release))
    child.start()
    try:
        assert started.wait(60)
        assert me.busy_slots() == [2] and me.share() == 1
    finally:
        release.set()
        child.join(30)
    assert child.exitcode == 0 and me.busy_slots() == [] and me.share() == 2
    me.close()


def test_threads_stay_within_the_cpus_nothing_else_runs_on(tmp_path):
    """Another program's runnable threads count too: an OpenMP team larger than the free CPUs waits at every
    barrier for a thread the kernel has not scheduled."""
    running = [1]
    me = CoreShare(tmp_path / "cores", 2, 0, cpus=4, running=lambda: running[0])
    assert me.share() == 4  # alone on 4 CPUs
    running[0] = 2  # one thread: this one (no team yet); one other runs: 3 CPUs free
    assert me.share() == 3
    me.threads = 3  # a team of 3 now: 3 runnable may all be its own; a 4th is foreign
    running[0] = 3
    assert me.share() == 4
    running[0] = 4
    assert me.share() == 3
    CoreShare(tmp_path / "cores", 2, 1, cpus=4, running=lambda: 1).set_busy(True)
    assert me.share() == 2  # the table's half is less than the 3 free
    running[0] = 9  # a crowded machine: still one thread
    assert me.share() == 1


def test_the_runnable_count_is_read_from_the_kernel():
    n = runnable_now()
    assert n >= 1  # this very process is running while it reads


def test_a_bad_slot_is_refused(tmp_path):
    with pytest.raises(ValueError, match="0 <= slot < 2"):
        CoreShare(tmp_path / "cores", 2, 2)


def test_pace_follows_the_table_in_forward_and_in_backward(tmp_path):
    """A layer's input paced in forward registers a hook that paces again when its gradient comes: a worker
    turning busy between forward and backward takes a thread from the backward."""
    before = torch.get_num_threads()
    share = CoreShare(tmp_path / "cores", 2, 0, cpus=2, running=lambda: 1)
    other = CoreShare(tmp_path / "cores", 2, 1, cpus=2, running=lambda: 1)
    seen = []
    cores.install(share)
    try:
        x = torch.ones(3, requires_grad=True)
        y = cores.pace(x * 2.0)  # forward of a "layer": the other worker idle
        seen.append(torch.get_num_threads())
        y.register_hook(lambda g: seen.append(torch.get_num_threads()))  # runs after pace's hook
        other.set_busy(True)
        y.sum().backward()
        assert seen == [2, 1] and x.grad.tolist() == [2.0, 2.0, 2.0]  # the gradient untouched by the hook
    finally:
        cores.install(None)
        torch.set_num_threads(before)
    assert cores.pace(x) is x  # no sharing installed: nothing happens


def test_share_cores_is_one_machines_and_off_by_default():
    assert from_dict({}).cluster.share_cores is False
    assert from_dict({}, ["cluster.share_cores=true"]).cluster.share_cores is True
    with pytest.raises(ConfigError, match="share_cores"):
        from_dict({}, ["cluster.share_cores=true", "cluster.n_nodes=2"])
