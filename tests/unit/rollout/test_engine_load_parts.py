"""TorchEngine.update_weights with a state dict that can release pages (a version received over shm):
copied part by part (``LOAD_PART_BYTES``), each part released after its copy, and the engine then
generates exactly what an engine loaded the ordinary way generates."""

import torch

from areal_async.config import ModelConfig
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import build_char_tokenizer
from areal_async.rollout.engines import torch_engine
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.engines.torch_engine import TorchEngine

TOK = build_char_tokenizer()
SMALL = ModelConfig(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)


class Releasing(dict):
    """A state dict that records what a loader released, part by part."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.parts: list[list[int]] = []

    def release(self, tensors):
        self.parts.append([t.data_ptr() for t in tensors])


def _generate(engine) -> list[list[int]]:
    engine.add_request(GenRequest("g", TOK.encode("7+5="), n=3, max_new_tokens=8))
    out = []
    while engine.has_work():
        out += [s.output_ids.tolist() for b in engine.step() for s in b.samples()]
    return out


def test_a_releasing_state_dict_is_copied_part_by_part_and_every_tensor_released_once(monkeypatch):
    monkeypatch.setattr(torch_engine, "LOAD_PART_BYTES", 16 << 10)  # 16 KiB parts of a ~100 KiB model
    trained = build_model(SMALL, len(TOK), seed=5).state_dict()
    plain = TorchEngine(build_model(SMALL, len(TOK), seed=0), TOK, seed=3, version=0)
    parted = TorchEngine(build_model(SMALL, len(TOK), seed=0), TOK, seed=3, version=0)
    plain.update_weights(1, {k: v.clone() for k, v in trained.items()})
    sd = Releasing({k: v.clone() for k, v in trained.items()})
    parted.update_weights(1, sd)
    released = [p for part in sd.parts for p in part]
    ptrs = {t.data_ptr() for t in sd.values()}
    assert len(sd.parts) > 2 and sorted(released) == sorted(t.data_ptr() for t in sd.values())
    assert len(released) == len(ptrs)  # each once
    for name, t in parted.model.state_dict().items():
        assert torch.equal(t, trained[name]), name
    assert _generate(parted) == _generate(plain)
