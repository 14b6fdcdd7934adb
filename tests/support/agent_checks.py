"""An agent episode's per-turn trace (``RUN_DIR/agent_traces``: the ids each turn's engine handle was given and
returned) against the trajectory the trainer trained (``RUN_DIR/recording``, ``rollout.dump_tensors``): two
records written by two processes, compared turn by turn (used by the e2e test and by docs/agents.md's run)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from areal_async.trainer.persist.recording import read_step, recording_dir


def trained_samples(run_dir: Path) -> dict[str, dict]:
    """sample id -> its trained ids (prompt + output), mask, logprobs and versions, from the recording."""
    out = {}
    for path in sorted(recording_dir(run_dir).glob("step_*.safetensors")):
        for t in read_step(path).trajs:
            mask = torch.ones(t.output_ids.numel(), dtype=torch.bool) if t.loss_mask is None else t.loss_mask
            out[t.sample_id] = {
                "group_id": t.group_id,
                "ids": torch.cat([t.prompt_ids, t.output_ids]).tolist(),
                "n_prompt": t.prompt_ids.numel(),
                "mask": mask.tolist(),
                "logprobs": t.logprobs.tolist(),
                "versions": t.versions.tolist(),
                "segments": list(t.segment_starts or []),
            }
    return out


def traces(run_dir: Path) -> list[dict]:
    return [json.loads(x) for p in sorted((Path(run_dir) / "agent_traces").glob("*.jsonl")) for x in p.open()]


def turn_table(trace: dict, sample: dict) -> list[dict] | None:
    """Per turn of an episode (its segments too): where its prompt and completion sit in the trained sequence and
    whether the ids, mask, log-probs and versions there equal the turn's; None if the trace is not this sample's."""
    ids, n_p = sample["ids"], sample["n_prompt"]
    drift_turns = {int(d.split()[1]) for d in trace["drifts"]}  # "turn K (template ...): ..."
    bases = [0] + [n_p + x for x in sample["segments"]]  # where each segment's own prompt starts
    rows, seg = [], -1
    for k, t in enumerate(trace["turns"]):
        seg += k == 0 or k in drift_turns
        base = bases[seg] if seg < len(bases) else None
        if base is None:
            return None
        p, c = t["prompt_ids"], t["output_ids"]
        at = slice(base + len(p) - n_p, base + len(p) - n_p + len(c))  # the completion's place in the output
        if ids[base : base + len(p)] != p or ids[base + len(p) : base + len(p) + len(c)] != c:
            return None
        rows.append(
            {
                "turn": k,
                "prompt_tokens": len(p),
                "completion_ids": c,
                "trained_ids": ids[len(p) : len(p) + len(c)],
                "mask_all_1": all(sample["mask"][at]),
                "versions_equal": sample["versions"][at] == t["versions"],
                "logprob_max_abs_diff": max(
                    (abs(a - b) for a, b in zip(sample["logprobs"][at], t["logprobs"])), default=0.0
                ),
            }
        )
    last = trace["turns"][-1]
    full = bases[seg] + len(last["prompt_ids"]) + len(last["output_ids"]) == len(ids)
    return rows if full and seg == len(bases) - 1 else None


def match(run_dir: Path) -> list[tuple[str, dict, list[dict]]]:
    """(sample id, trace, per-turn table) for every trained sample whose episode trace is found."""
    samples = trained_samples(run_dir)
    by_group: dict[str, list[dict]] = {}
    for tr in traces(run_dir):
        by_group.setdefault(tr["group_id"], []).append(tr)
    out = []
    for sid, s in samples.items():  # a group's episodes may share their ids (not their versions): each trace once,
        pool = by_group.get(s["group_id"], [])  # the one that agrees in everything first
        found = [(tr, rows) for tr in pool if (rows := turn_table(tr, s)) is not None]
        if found:
            tr, rows = next(((t, r) for t, r in found if all(_same(x) for x in r)), found[0])
            pool.remove(tr)
            out.append((sid, tr, rows))
    return out


def _same(row: dict) -> bool:
    return row["completion_ids"] == row["trained_ids"] and row["mask_all_1"] and row["versions_equal"]
