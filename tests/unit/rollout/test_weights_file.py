"""save_state_file: the one safetensors writer of the SGLang and vLLM disk weight updates."""

import torch
from safetensors.torch import load_file

from areal_async.rollout.clients.weights_file import save_state_file


def test_tied_tensors_are_written_once_and_the_values_round_trip(tmp_path):
    embed = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    wide = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    sd = {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: the same storage
        "proj.weight": wide.t(),  # not contiguous
    }
    save_state_file(sd, tmp_path / "model.safetensors")
    back = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(back) == ["embed.weight", "proj.weight"]
    assert back["embed.weight"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert back["proj.weight"].tolist() == [[0, 2, 4, 6], [1, 3, 5, 7]]
