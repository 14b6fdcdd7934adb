"""An agent's segments (template drift, ``rollout.agent_drift: segments``) trained apart inside one trajectory.

A trajectory P1 C1 | P2 C2 with a segment start at P2 must give C1 the log-probs of P1 C1 alone and C2 those
of P2 C2 alone: the reference is a plain unpacked forward of each segment on its own (log_softmax written
out here, float64), for each attention path the trainer packs with (the dense block mask, the bucketed
per-sequence sdpa, and the lean forward; the trainer's logits are float32, so within 1e-5), beside an
unsegmented sequence in the same micro-batch. Without the restart (the segments attending to each other)
C2's log-probs move: checked too, so the test can fail. The layout crosses the trajectory wire and the
trainer ranks' broadcast with its segment starts."""

from __future__ import annotations

import pytest
import torch
import transformers

from areal_async.trainer.compute.dp import decode_batch, encode_batch
from areal_async.trainer.compute.packing import (
    VARLEN_IMPL,
    Segmented,
    forward_packed,
    pack,
    unpack,
    use_varlen_attention,
)
from protocols.trajectories import Trajectory
from protocols.trajectories import TrajectoryBatch

VOCAB = 41
P1, C1 = [3, 9, 4, 22, 7], [11, 5, 2]
P2, C2 = [3, 9, 4, 30, 31, 8], [12, 2]
OTHER = [5, 6, 7, 8, 9, 10, 11]


def model(attn: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa" if attn == VARLEN_IMPL else attn
    m = transformers.LlamaForCausalLM(cfg).double().eval()
    return use_varlen_attention(m) if attn == VARLEN_IMPL else m


def alone(m, ids: list[int]) -> torch.Tensor:
    """Log-prob of each token after the first, from an ordinary forward of ``ids`` alone."""
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double()
    logq = torch.log_softmax(logits, -1)
    return logq[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def segmented_traj() -> Trajectory:
    out = C1 + P2 + C2
    return Trajectory(
        "s0", "g0", torch.tensor(P1), torch.tensor(out), torch.zeros(len(out)), torch.zeros(len(out), dtype=torch.long),
        1.0, torch.tensor([1] * len(C1) + [0] * len(P2) + [1] * len(C2)), [len(C1)],
    )  # fmt: skip


@pytest.mark.parametrize("attn,lean", [("eager", False), ("sdpa", False), (VARLEN_IMPL, False), (VARLEN_IMPL, True)])
def test_each_segment_gets_the_logprobs_of_its_own_context(attn, lean):
    m, ref = model(attn), model("eager")  # the same seed: the same weights; the reference forward unpacked
    t = segmented_traj()
    assert isinstance(t.seq_parts, Segmented) and t.seq_parts.breaks == (len(P1) + len(C1),)
    packed = pack([torch.tensor(OTHER), t.seq_parts])
    assert packed.lengths == [len(OTHER), len(P1 + C1 + P2 + C2)]  # one entry a trajectory
    assert packed.position_ids_T.tolist() == [*range(7), *range(len(P1 + C1)), *range(len(P2 + C2))]
    with torch.no_grad():
        logp_T, _ = forward_packed(m, packed, lean=lean, chunk_tokens=0)
    other, seq = (x.double() for x in unpack(logp_T, packed.cu_seqlens))  # the trainer's logits are float32
    n1 = len(P1 + C1)
    torch.testing.assert_close(seq[: n1 - 1], alone(ref, P1 + C1), rtol=0, atol=1e-5)
    torch.testing.assert_close(seq[n1:], alone(ref, P2 + C2), rtol=0, atol=1e-5)
    torch.testing.assert_close(other, alone(ref, OTHER), rtol=0, atol=1e-5)


def test_without_the_restart_the_second_segment_would_be_misaligned():
    m = model("eager")
    packed = pack([(torch.tensor(P1), torch.tensor(C1 + P2 + C2))])  # the same ids as one sequence
    with torch.no_grad():
        (seq,) = unpack(forward_packed(m, packed, lean=False, chunk_tokens=0)[0], packed.cu_seqlens)
    c2 = slice(len(P1 + C1 + P2) - 1, None)
    assert (seq[c2] - alone(m, P2 + C2)[len(P2) - 1 :]).abs().max() > 1e-3


def test_segment_starts_cross_the_trajectory_wire_and_the_rank_broadcast():
    t = segmented_traj()
    b = TrajectoryBatch.group("g0", ["s0", "s1"], P1, [len(t.output_ids), 2], t.output_ids.tolist() + [4, 2],
                              [0.0] * 13, [0] * 13, loss_mask=t.loss_mask.tolist() + [1, 1],
                              segment_starts=[[3], []])  # fmt: skip
    key, tensors, meta = b.encode()
    assert meta["segment_starts"] == [[3], []]
    views = TrajectoryBatch.decode(key, meta, tensors).samples()
    assert [v.segment_starts for v in views] == [[3], None]
    back = decode_batch(encode_batch([v.scored(1.0) for v in views]))
    assert [x.segment_starts for x in back] == [[3], None]
    assert back[0].seq_parts.breaks == (len(P1) + 3,)
    bad = dict(meta, segment_starts=[[13], []])
    with pytest.raises(Exception, match="segment_starts"):
        TrajectoryBatch.decode(key, bad, tensors)
