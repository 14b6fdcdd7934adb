"""A group's prompt trained once: the samples of one prompt share its tokens in the forward.

GRPO samples ``n`` outputs per prompt, and the trainer's packed batch lays each sample out whole:
prompt, then output. The prompt's hidden states are the same in every copy (causal attention: a
prompt token never sees an output), so the lean forward can compute them once per run of samples
that share a prompt and give each output its own branch::

    virtual (what the actor indexes):  [P o1] [P o2] [P o3] [P o4]
    physical (what the forward runs):  [P o1 o2 o3 o4], o_k attending to P and to itself only

Positions are the virtual ones (o_k starts at len(P)); attention is causal within the physical
sequence and masked across branches (``branch_P``: 0 on the prompt, k on output k). ``rows_T``
maps every virtual position to the physical row whose hidden state it has, so every consumer keeps
the virtual layout (``cu_seqlens``, ``scored_T``, ``MicroBatchOut.tails``) and only the forward's
layers run on fewer tokens. In backward the gather adds each copy's gradient into the one
prompt row: the same sum the copies' rows would have sent through the weights. Same arithmetic up
to float summation order.

At the smollm2 preset's shapes (8 prompts of 37 tokens, 4 outputs of ~12 each) a step's ~1,600 tokens
through the layers became ~700 (``n_layer_tokens`` p50 686-733, 2.2-2.3x fewer), and the fleet's step at
eta = 1 went 6.3 -> 3.8 s (docs/performance-notes.md).

Covered: plain (prompt, output) sequences through the lean forward (``lean_forward.supports``
and the 'packed_sdpa' attention). Not covered, and left to the virtual layout: segmented
(multi-turn) sequences, HF's forward (its attention takes no branch mask), FSDP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from areal_async.trainer.compute.micro_batches import allocate_micro_batches, refuse_oversize


@dataclass
class SharedPrefix:
    """The physical layout of a packed batch whose runs of samples share their prompt."""

    ids_P: torch.Tensor  # int64 (P,): each run's prompt once, then its samples' outputs
    pos_P: torch.Tensor  # int64 (P,): the virtual positions (an output continues its prompt's)
    cu_P: torch.Tensor  # int32 (runs + 1,): a run is one attention sequence
    branch_P: torch.Tensor  # int64 (P,): 0 on a prompt, k on the run's k-th output (k >= 1)
    rows_T: torch.Tensor  # int64 (T,): the physical row of every virtual position

    def to(self, device: torch.device | str) -> "SharedPrefix":
        return SharedPrefix(*(getattr(self, f).to(device) for f in ("ids_P", "pos_P", "cu_P", "branch_P", "rows_T")))

    @property
    def tokens(self) -> int:
        return self.ids_P.numel()


def prompt_runs(keys: Sequence[Optional[str]], prompts: Sequence[torch.Tensor]) -> list[int]:
    """Lengths of the runs of consecutive sequences that share a prompt: the same key (a group id; None never
    shares) and equal prompt tokens (checked, not trusted). A run of one shares nothing."""
    runs: list[int] = []
    for i, (key, prompt) in enumerate(zip(keys, prompts)):
        if runs and key is not None and key == keys[i - 1] and torch.equal(prompt, prompts[i - 1]):
            runs[-1] += 1
        else:
            runs.append(1)
    return runs


def allocate_runs(
    runs: Sequence[int], n_prompt: Sequence[int], n_out: Sequence[int], budget: int, oversize: str
) -> list[list[int]]:
    """Micro-batches (positions into the sequences, ascending) under the token budget. A run costs the tokens its
    forward runs, its prompt once and every output; one over the budget is cut into consecutive parts that fit
    (each paying the prompt again), a sequence over it alone stays as ``allocate_micro_batches`` treats it. Runs
    of one: the sequences' own lengths, as ``allocate_micro_batches`` allocates them."""
    units, cost, at = [], [], 0
    for run in runs:
        p = n_prompt[at]
        for j in range(at, at + run):
            if units and units[-1][0] + units[-1][1] == j and j > at and cost[-1] + n_out[j] <= budget:
                units[-1][1] += 1
                cost[-1] += n_out[j]
            else:
                units.append([j, 1])
                cost.append(p + n_out[j])
        at += run
    if oversize == "error":  # named as the sequence it is (a unit over the budget is one sequence)
        refuse_oversize([p + o for p, o in zip(n_prompt, n_out)], budget)
    mbs = allocate_micro_batches(cost, budget, oversize)
    return [[j for u in sorted(mb) for j in range(units[u][0], units[u][0] + units[u][1])] for mb in mbs]


def share_prefixes(
    ids_T: torch.Tensor, pos_T: torch.Tensor, n_prompt: Sequence[int], n_out: Sequence[int], runs: Sequence[int]
) -> SharedPrefix:
    """The physical layout of a virtual packed batch (``ids_T``, ``pos_T``: sequences of ``n_prompt[i] +
    n_out[i]`` tokens end to end) whose consecutive runs of ``runs[j]`` sequences share their prompt."""
    if sum(runs) != len(n_prompt) or len(n_prompt) != len(n_out):
        raise ValueError(f"runs {list(runs)} cover {sum(runs)} sequences; the batch has {len(n_prompt)}")
    lens = np.asarray(n_prompt, dtype=np.int64) + np.asarray(n_out, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    rows = np.empty(int(lens.sum()), dtype=np.int64)
    keep, branch, cu = [], [], [0]
    i, base = 0, 0
    for run in runs:
        p = int(n_prompt[i])
        if any(int(n_prompt[j]) != p for j in range(i, i + run)):
            raise ValueError(f"sequences {i}..{i + run - 1} share a prompt but their prompt lengths differ")
        keep.append(np.arange(starts[i], starts[i] + p))  # the run's prompt, from its first sequence
        branch.append(np.zeros(p, dtype=np.int64))
        at = base + p
        for k, j in enumerate(range(i, i + run), start=1):
            o = int(n_out[j])
            rows[starts[j] : starts[j] + p] = np.arange(base, base + p)
            rows[starts[j] + p : starts[j] + p + o] = np.arange(at, at + o)
            keep.append(np.arange(starts[j] + p, starts[j] + p + o))
            branch.append(np.full(o, k, dtype=np.int64))
            at += o
        cu.append(at)
        i, base = i + run, at
    take = torch.from_numpy(np.concatenate(keep))
    return SharedPrefix(
        ids_T.index_select(0, take),
        pos_T.index_select(0, take),
        torch.tensor(cu, dtype=torch.int32),
        torch.from_numpy(np.concatenate(branch)),
        torch.from_numpy(rows),
    )


def branch_mask(branch_NL: torch.Tensor) -> torch.Tensor:
    """(N, 1, L, L) bool, True where query i may attend to key j: j <= i, and j on the prompt (branch 0) or on
    i's own branch. Padding repeats a sequence's last token (``varlen_plan``): a padded query sees itself."""
    L = branch_NL.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=branch_NL.device).tril()
    key = branch_NL[:, None, :]
    return (causal & ((key == 0) | (key == branch_NL[:, :, None])))[:, None]
