"""The trained policy an RL run keeps: ``RUN_DIR/model``, an HF directory written after the run's last step.

    last trainer step ─> weights published ─> (evaluation, when due) ─> RUN_DIR/model ─> TrainStepDone

It holds ``config.json``, ``model.safetensors`` (in ``model.dtype``), ``generation_config.json`` and the
tokenizer with its chat template: ``AutoModelForCausalLM.from_pretrained(RUN_DIR/model)`` and
``areal-async eval RUN_DIR/config.yaml --model RUN_DIR/model`` load it, as they load SFT's ``RUN_DIR/model``.
A LoRA run's is merged (base + s B A at every adapted layer), a plain model: the adapter alone stays in the
run's checkpoints. With several trainer ranks every rank takes part in the gather (``CMD_EXPORT``) and
rank 0 writes.

The directory is written under a temporary name and renamed, so ``RUN_DIR/model`` is either absent or
complete; it is written before the last ``TrainStepDone``, so a run that ends cleanly has it. A run
stopped by a signal before its last step keeps the checkpoint of its final grace instead
(``checkpoints/step_<k>``, which loads the same way).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from areal_async.models import lora
from areal_async.trainer.persist.sharded_ckpt import ADAPTER_DIR, export_adapter, export_full

FINAL_DIR = "model"


def exporter(
    model: torch.nn.Module, dtype: torch.dtype, rank: int, spec: Optional[lora.LoraSpec] = None, base_dir: str = ""
) -> Callable[[str], None]:
    """What every rank runs to write the policy into a directory (a collective when sharded; rank 0
    writes): the full model in ``dtype``, or a LoRA run's adapter merged into its base (``base_dir``)."""

    def export(path: str) -> None:
        if spec is None:
            export_full(path, model, dtype, rank)
            return
        export_adapter(path, model, spec, base_dir, rank)
        if rank == 0:
            adapter = Path(path) / ADAPTER_DIR
            lora.export_merged(adapter, path, base_dir)
            shutil.rmtree(adapter)

    return export


def write_final(run_dir: str | Path, export: Callable[[str], None], tokenizer, on_all_ranks=None) -> Path:
    """``RUN_DIR/model`` from ``export`` (rank 0's; ``on_all_ranks(tmp)`` first tells the other ranks to
    export into the same directory) and ``tokenizer``, atomically; returns the directory."""
    final = Path(run_dir) / FINAL_DIR
    tmp = final.with_name(f".{FINAL_DIR}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed writer's leftover
    tmp.mkdir()
    if on_all_ranks is not None:
        on_all_ranks(str(tmp))
    export(str(tmp))
    tokenizer.save_pretrained(str(tmp))  # with its chat template (chat_template.jinja)
    if final.exists():  # a resumed run that had finished before: the newer policy replaces it
        trash = final.with_name(f".trash-{FINAL_DIR}-{os.getpid()}")
        os.rename(final, trash)
        shutil.rmtree(trash)
    os.rename(tmp, final)
    return final
