"""An agent episode's turns, exactly as sampled, and the trajectory built from their token ids.

Every request an agent makes inside one episode (a chat or a text completion on the rollout worker's
OpenAI-compatible endpoint) is one ``Turn``: the prompt ids the engine was given and the completion it
sampled (ids, behaviour logprobs, per-token versions). ``EpisodeTrace.add`` records it; ``to_episode``
lays the turns out as one trajectory from those ids only, never from text:

    segment 1:  P1  C1  (P2 - P1 - C1)  C2  (P3 - ...)  C3      P_k+1 extends P_k + C_k token by token
                ^prompt  ^trained  ^env (loss mask 0)  ^trained
    segment 2:  P4  C4  ...                                     P4 does NOT extend P3 + C3: template drift

A turn whose prompt is not a token-level extension of the previous turn's prompt + completion (a chat
template that drops ``<think>`` from past assistant turns, re-serialises a tool call, changes a
separator; an agent that rewrites its history) starts a new segment. ``Drift`` says where and why
(the first differing position, and whether the new prompt is shorter, or differs inside the previous
completion or inside the previous prompt). Per ``rollout.agent_drift``:

- ``refuse``: an episode with drift raises ``DriftRefused`` (the group is aborted with the reason and
  re-issued; the count is in the worker's drift counters);
- ``segments``: every segment is trained on its own: the trajectory holds them end to end, each later
  segment's own prompt as loss-mask-0 tokens, and ``segment_starts`` (output offsets where a new
  sequence begins) tells the trainer to restart positions and attention there, so each segment is
  trained on exactly the tokens its turns were sampled from.

Torch-free. Not covered: branching agents (several turns continuing one earlier turn: each branch after
the first is a drift here), a turn whose completion is empty (nothing to train; recorded, laid out as
context).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from areal_async.workflows.base import Episode, Generation

DRIFT_MODES = ("refuse", "segments")


@dataclass
class Turn:
    """One request of an agent episode: what the engine was given and what it sampled."""

    prompt_ids: list[int]
    gen: Generation
    kind: str = "chat"  # chat | completion
    template: str = ""  # the chat template's name (drift is counted per template)


@dataclass(frozen=True)
class Drift:
    """Turn ``turn``'s prompt does not extend turn ``turn - 1``'s prompt + completion."""

    turn: int
    position: int  # first token index where they differ (or where the new prompt ends)
    where: str  # "shorter" | "in the previous completion" | "in the previous prompt"
    template: str
    expected: tuple[int, ...]  # a few ids of the previous prompt + completion from ``position``
    got: tuple[int, ...]  # the new prompt's ids from ``position``

    def describe(self) -> str:
        return (
            f"turn {self.turn} (template {self.template or '?'}): its prompt is not a token-level extension of "
            f"turn {self.turn - 1}'s prompt + completion: they differ at token {self.position} ({self.where}): "
            f"expected {list(self.expected)}, got {list(self.got)}"
        )


class DriftRefused(RuntimeError):
    """An episode with template drift under ``rollout.agent_drift: refuse``."""

    def __init__(self, drift: Drift):
        super().__init__(f"template_drift: {drift.describe()} (rollout.agent_drift=refuse)")
        self.drift = drift


def find_drift(prev_ids: list[int], n_prev_prompt: int, prompt_ids: list[int], turn: int, template: str):
    """None when ``prompt_ids`` starts with ``prev_ids`` (the previous prompt + completion); else a ``Drift``."""
    n = len(prev_ids)
    if prompt_ids[:n] == prev_ids:
        return None
    at = next((i for i, (a, b) in enumerate(zip(prev_ids, prompt_ids)) if a != b), min(n, len(prompt_ids)))
    where = "shorter" if at >= len(prompt_ids) else "in the previous prompt" if at < n_prev_prompt else None
    where = where or "in the previous completion"
    return Drift(turn, at, where, template, tuple(prev_ids[at : at + 8]), tuple(prompt_ids[at : at + 8]))


@dataclass
class EpisodeTrace:
    """The turns of one agent episode, in the order their requests were answered."""

    turns: list[Turn] = field(default_factory=list)
    drifts: list[Drift] = field(default_factory=list)

    def add(self, turn: Turn) -> Optional[Drift]:
        """Record ``turn``; returns its drift against the previous turn (also kept in ``drifts``), or None."""
        drift = None
        if self.turns:
            last = self.turns[-1]
            prev = list(last.prompt_ids) + list(last.gen.output_ids)
            drift = find_drift(prev, len(last.prompt_ids), list(turn.prompt_ids), len(self.turns), turn.template)
            if drift is not None:
                self.drifts.append(drift)
        self.turns.append(turn)
        return drift

    def segments(self) -> list[list[Turn]]:
        """The turns split where a prompt does not extend the previous turn (one list per segment)."""
        breaks = {d.turn for d in self.drifts}
        out: list[list[Turn]] = []
        for i, t in enumerate(self.turns):
            if i == 0 or i in breaks:
                out.append([])
            out[-1].append(t)
        return out

    def to_episode(self, reward: float, mode: str = "refuse") -> tuple[Episode, list[int]]:
        """(the episode laid out from the turns' ids, ``segment_starts``): see the module docstring.
        ``DriftRefused`` for drift under ``refuse``; ``ValueError`` for an episode with no turn."""
        if mode not in DRIFT_MODES:
            raise ValueError(f"agent drift mode {mode!r}: expected one of {' | '.join(DRIFT_MODES)}")
        if not self.turns:
            raise ValueError("the agent made no request in this episode: nothing was sampled to train on")
        if self.drifts and mode == "refuse":
            raise DriftRefused(self.drifts[0])
        segs = self.segments()
        ep = Episode(prompt_ids=list(segs[0][0].prompt_ids))
        starts: list[int] = []
        for k, seg in enumerate(segs):
            if k:  # a new sequence: its own prompt, not trained
                starts.append(len(ep.output_ids))
                _context(ep, seg[0].prompt_ids)
            _lay_segment(ep, seg)
        ep.reward, ep.turns = float(reward), len(self.turns)
        ep.finish_reason = self.turns[-1].gen.finish_reason
        return ep, starts


def _lay_segment(ep: Episode, seg: list[Turn]) -> None:
    """A segment's turns after its first prompt: each completion (trained), and between two turns the
    tokens the next prompt adds after the previous prompt + completion (context, not trained)."""
    done = len(seg[0].prompt_ids)
    for i, t in enumerate(seg):
        if i:
            _context(ep, t.prompt_ids[done:])
        g = t.gen
        ep.output_ids += list(g.output_ids)
        ep.logprobs += list(g.logprobs)
        ep.versions += list(g.versions)
        ep.loss_mask += [1] * len(g.output_ids)
        done = len(t.prompt_ids) + len(g.output_ids)


def _context(ep: Episode, ids) -> None:
    ids = list(ids)
    ep.output_ids += ids
    ep.logprobs += [0.0] * len(ids)
    ep.versions += [-1] * len(ids)
    ep.loss_mask += [0] * len(ids)


def share_prompt(episodes: list[Episode]) -> list[Episode]:
    """The group's episodes with one prompt: the longest common prefix of their prompts; each episode's
    rest of its prompt moves to the front of its output as context (loss mask 0), its segment starts
    shifted. ``ValueError`` when the episodes share no first token (a trajectory group has one prompt)."""
    first = episodes[0].prompt_ids
    n = min(len(e.prompt_ids) for e in episodes)
    n = next((i for i in range(n) if any(e.prompt_ids[i] != first[i] for e in episodes)), n)
    if n == 0:
        raise ValueError("the group's episodes share no first prompt token; a trajectory group has one prompt")
    for e in episodes:
        rest = e.prompt_ids[n:]
        k = len(rest)
        e.prompt_ids = e.prompt_ids[:n]
        e.output_ids = rest + e.output_ids
        e.logprobs = [0.0] * k + e.logprobs
        e.versions = [-1] * k + e.versions
        e.loss_mask = [0] * k + e.loss_mask
        e.segment_starts = [s + k for s in e.segment_starts]
    return episodes
