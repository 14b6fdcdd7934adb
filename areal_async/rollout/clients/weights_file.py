"""One safetensors file of a state dict, as the remote engines' disk weight updates read it
(SGLang ``/update_weights_from_disk``, vLLM ``reload_weights``)."""

from __future__ import annotations

from pathlib import Path

import torch


def save_state_file(sd: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write ``sd`` to ``path``: CPU, contiguous, tied tensors once (safetensors refuses tensors
    sharing memory; the first name of each storage is kept, the server re-ties the rest)."""
    from safetensors.torch import save_file

    seen, out = set(), {}
    for k, v in sd.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape))
        if key not in seen:
            seen.add(key)
            out[k] = v.detach().to("cpu").contiguous()
    save_file(out, str(path))
