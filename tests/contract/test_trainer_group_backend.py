"""The trainer group's process-group backend serves the device of every tensor its collectives carry.

The backend a multi-rank CUDA trainer asks for is read from ``trainer_worker._join_ranks`` (what a run
does); which device types that backend string serves is torch 2.13's own parsing of it
(``distributed_c10d.BackendConfig``: a bare "nccl" serves only ``backend_capability["nccl"] == ["cuda"]``,
"cpu:gloo,cuda:nccl" serves both). The tensors are recorded on two real gloo ranks running every
control collective of ``DataParallel`` and ``broadcast_module`` (the GPU check's rank body,
``benchmarks.gpu_check.trainer_checks``), whose results are checked against values computed by hand.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from areal_async.app.workers import trainer_worker
from areal_async.trainer.compute.dp import init_data_parallel, trainer_backend
from benchmarks.gpu_check.trainer_checks import control_problems, run_two_ranks, served_devices


def chosen_backend(monkeypatch, device: str) -> str:
    """The backend ``_join_ranks`` passes to ``init_data_parallel`` for 2 ranks on ``device``."""
    got = []
    monkeypatch.setattr(trainer_worker, "init_data_parallel", lambda rank, world, store, backend: got.append(backend))
    cfg = SimpleNamespace(cluster=SimpleNamespace(n_trainer_ranks=2, device=device))
    trainer_worker._join_ranks(cfg, "127.0.0.1:1", 0, torch.float32)
    assert len(got) == 1
    return got[0]


def test_backend_strings_as_torch_parses_them():
    assert served_devices("nccl") == {"cuda"}  # what the trainer asked for on CUDA before: no CPU tensors
    assert served_devices("cpu:gloo,cuda:nccl") == {"cpu", "cuda"}
    assert trainer_backend("cuda:3") == trainer_backend("cuda") and trainer_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match="trainer device 'mps'"):
        trainer_backend("mps")
    with pytest.raises(ValueError, match="backend='nccl'"):
        init_data_parallel(0, 2, "127.0.0.1:1", "nccl")


def test_every_control_collective_tensor_is_on_a_device_the_trainer_backend_serves(monkeypatch, tmp_path):
    cuda_backend = chosen_backend(monkeypatch, "cuda")
    assert chosen_backend(monkeypatch, "cpu") == "gloo"
    ranks = run_two_ranks("gloo", "cpu", str(tmp_path))  # the same collectives and tensors as on CUDA
    assert {s[2] for r in ranks for s in r["seen"]} == {"cpu"}  # all control tensors are on the host
    assert control_problems(ranks, "gloo") == []  # results as computed by hand, every phase seen
    assert control_problems(ranks, cuda_backend) == []
    # the checker itself: a backend that does not serve CPU is reported, phase by phase
    assert len(control_problems(ranks, "nccl")) == len({(s[0], s[1]) for r in ranks for s in r["seen"]})
