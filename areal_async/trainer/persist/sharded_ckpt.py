"""Weights and optimizer of a (possibly sharded) trainer in torch Distributed Checkpoint format.

Inside a checkpoint directory (``checkpoint.py`` makes it atomic):

    dcp/                 model + optimizer, one file per rank plus .metadata (DCP); tensors are
                         stored with their global shapes, so a run with any other number of ranks
                         (1 included: no process group) reads them back resharded
    model.safetensors    the full model in the publish dtype (HF ``save_pretrained``), gathered
                         from the shards; what rollouts, evaluation and ``from_pretrained`` read
    adapter/             instead of model.safetensors in a LoRA run (``actor.lora``): the adapter alone
                         (PEFT layout; dcp/ holds it and its optimizer state, not the frozen base, whose
                         directory ``adapter/adapter_config.json`` names); ``areal-async export-lora``
                         writes the merged model on demand

Every trainer rank calls ``save_shards`` and ``load_shards`` (DCP's are collective); only rank 0
writes the HF export. The full state dict for the export is gathered onto rank 0's CPU (the
whole model at once: an export is not on the weight-sync path).

Not covered: async DCP saves, exporting a model too big for rank 0's host memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from areal_async.base.private import check_private
from areal_async.models import lora

DCP_DIR = "dcp"
ADAPTER_DIR = "adapter"  # a LoRA run's checkpoint: the adapter (PEFT layout) instead of model.safetensors


def has_shards(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / DCP_DIR / ".metadata").is_file()


def _trained_only(msd: dict) -> dict:
    """The model state a checkpoint keeps: all of it, or a LoRA run's adapter alone (its base is frozen)."""
    adapter = {k: v for k, v in msd.items() if ".lora_" in k}
    return adapter or msd


def save_shards(checkpoint: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model (float32 master weights; a LoRA run's adapter alone) and optimizer state into
    ``checkpoint/dcp`` (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": _trained_only(msd), "optim": osd}, checkpoint_id=str(Path(checkpoint) / DCP_DIR))


def load_shards(checkpoint: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read ``checkpoint/dcp`` into this rank's shards of model and optimizer, whatever the rank
    count that wrote it (collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    if not has_shards(checkpoint):
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} has no {DCP_DIR}/.metadata; expected a trainer checkpoint "
            "written with distributed checkpoint shards"
        )
    for part in (Path(checkpoint), Path(checkpoint) / DCP_DIR, Path(checkpoint) / DCP_DIR / ".metadata"):
        check_private(part, "checkpoint")  # dcp.load unpickles .metadata: only this user may have written it
    msd, osd = get_state_dict(model, optimizer)  # also materialises empty optimizer state to load into
    state = {"model": _trained_only(msd), "optim": osd}
    dcp.load(state, checkpoint_id=str(Path(checkpoint) / DCP_DIR))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(strict=len(state["model"]) == len(msd)),  # a LoRA run's: the adapter alone
    )


def export_full(checkpoint: str | Path, model: torch.nn.Module, dtype: torch.dtype, rank: int) -> None:
    """The full model as HF safetensors in ``dtype`` (collective gather; rank 0 writes)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sharded = any(hasattr(p, "full_tensor") for p in model.parameters())
    if sharded:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        full = model.state_dict()
    if rank != 0:
        return
    full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    model.save_pretrained(str(checkpoint), state_dict=full, safe_serialization=True)


def export_adapter(checkpoint: str | Path, model: torch.nn.Module, spec, base_dir: str, rank: int) -> None:
    """A LoRA run's adapter as a PEFT directory ``checkpoint/adapter`` (float32; gathered from the
    shards, a collective; rank 0 writes), naming ``base_dir`` (the frozen base) as its base model."""
    params = lora.adapter_params(model)
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float() for k, v in params.items()}
    if rank == 0:
        lora.save_adapter(Path(checkpoint) / ADAPTER_DIR, full, spec, base_dir)
