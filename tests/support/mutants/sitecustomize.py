"""Bugs injected into a real fleet, one per kind, for ``tests/e2e/test_verify_mutants.py``.

Python imports ``sitecustomize`` at start-up from the first ``sys.path`` entry that has one, so a fleet
started with this folder first on ``PYTHONPATH`` runs every process (scheduler, rollout, reward,
trainer) with the hooks below. They change nothing until the module they patch is imported: a
finder on ``sys.meta_path`` runs the module as usual, then patches it (``PATCHES``). Each bug is
injected once per run (claimed with an exclusive file in ``$AREAL_MUTANTS``, whichever process gets
there first) and logged there, one JSON line in ``applied.jsonl`` per injection: which bug, in which
role, the sample ids it hurt and the step, so the test can ask ``areal-async verify`` to name each one.
``AREAL_MUTANTS_ON`` picks the bugs (comma list; default all):

    dropped     scheduler  the books' line of one sample trained at step >= 1 is never written
    duplicated  trainer    step 2's batch trains its first sample twice
    truncated   trainer    step 3's batch trains a sample with its last output token cut off (all its
                           per-token tensors, so the trajectory stays self-consistent)
    misaligned  reward     the first group scored with unequal scores leaves with them rotated by one
                           (after the reward worker's own record was written: what a bug in the message
                           would do)
    mislabeled  rollout    the first group an engine finishes has every token stamped one version
                           above the one that made it (consistent in its record, message and tensors)

A test-only module: nothing in the package imports it.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import json
import os
import sys

DIR = os.environ.get("AREAL_MUTANTS", "")
ON = set(
    filter(None, os.environ.get("AREAL_MUTANTS_ON", "dropped,duplicated,truncated,misaligned,mislabeled").split(","))
)


def claim(name: str) -> bool:
    """True once per run (the first process to ask): the bug ``name`` is injected now."""
    if name not in ON:
        return False
    try:
        os.close(os.open(os.path.join(DIR, f"{name}.claimed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def applied(name: str, role: str, ids: list[str], step=None) -> None:
    with open(os.path.join(DIR, "applied.jsonl"), "a") as f:
        f.write(json.dumps({"mutation": name, "role": role, "ids": ids, "step": step, "pid": os.getpid()}) + "\n")


def patch_runlog(mod) -> None:
    orig = mod.RunLog.samples  # the lines of samples that ended together (RunLog.sample goes through it)

    def samples(self, recs):
        hit = next((r for r in recs if r.status == "trained" and r.train_step >= 1), None)
        if hit is not None and claim("dropped"):
            applied("dropped", "scheduler", [hit.sample_id], hit.train_step)
            recs = [r for r in recs if r is not hit]
        return orig(self, recs)

    mod.RunLog.samples = samples


def patch_trainer(mod) -> None:
    orig = mod.TrainerService._train_ranks

    def _train_ranks(self, step, trajs, ahead=None):
        if step == 2 and ahead is None and claim("duplicated"):
            applied("duplicated", "trainer", [trajs[0].sample_id], step)
            trajs = [*trajs, trajs[0]]
        if step == 3 and ahead is None:
            i = next((i for i, t in enumerate(trajs) if t.output_ids.numel() >= 2), None)
            if i is not None and claim("truncated"):
                applied("truncated", "trainer", [trajs[i].sample_id], step)
                trajs = [*trajs[:i], _cut(trajs[i]), *trajs[i + 1 :]]
        return orig(self, step, trajs, ahead)

    mod.TrainerService._train_ranks = _train_ranks


def _cut(t):
    """The trajectory with its last output token gone from every per-token tensor."""
    mask = t.loss_mask[:-1] if t.loss_mask is not None else None
    return dataclasses.replace(
        t, output_ids=t.output_ids[:-1], logprobs=t.logprobs[:-1], versions=t.versions[:-1], loss_mask=mask
    )


def patch_reward(mod) -> None:
    orig = mod.RewardService._results

    def _results(self, batch, per_group):
        from protocols.wire import Batch, unbatch

        msg = orig(self, batch, per_group)
        items = unbatch(msg)  # the RewardResult of each group the message carries
        for i, res in enumerate(items):
            scores = res.scores
            if len(set(scores)) > 1 and claim("misaligned"):
                rotated = scores[1:] + scores[:1]
                hurt = [sid for sid, a, b in zip(res.sample_ids, scores, rotated) if a != b]
                applied("misaligned", "reward", hurt)
                items[i] = dataclasses.replace(res, scores=rotated)
                return Batch.of(items) if type(msg) is Batch else items[0]
        return msg

    mod.RewardService._results = _results


def patch_rollout(mod) -> None:
    orig = mod.RolloutService._groups_from_thread

    def _groups_from_thread(self, groups, requests):
        if groups and claim("mislabeled"):
            g = groups[0]
            g.versions = g.versions + 1  # a new tensor: the engine's own buffers stay as they are
            applied("mislabeled", "rollout", list(requests[g.group_id].sample_ids[: g.n_samples]))
        return orig(self, groups, requests)

    mod.RolloutService._groups_from_thread = _groups_from_thread


PATCHES = {
    "areal_async.scheduler.runlog": patch_runlog,
    "areal_async.trainer.service": patch_trainer,
    "areal_async.reward.service": patch_reward,
    "areal_async.rollout.service": patch_rollout,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner, patch):
        self.inner, self.patch = inner, patch

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        self.patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, PATCHES[name])
        return spec


if DIR:
    sys.meta_path.insert(0, _Finder())
