"""The in-process loops ``benchmarks.overhead`` compares the fleet with: the project's engine, reward
function and PPO actor in one Python loop, ``plain`` (as first written) or ``matched`` (with every
optimisation of the fleet's roles that one thread can use; ``MATCHED`` lists them all, with the
ones that do not apply and why). ``run_inprocess`` runs one leg: a fresh loop, ms per phase."""

from __future__ import annotations

import copy
import gc
import statistics
import time

import torch

from areal_async.base.plugins import load_callable
from areal_async.base.process import setup_torch_process
from areal_async.data.prompts import PromptCursor, load_problems, prompt_encoder
from areal_async.models.tiny import load_policy
from areal_async.models.tokenizer import batch_decoder
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.service import _split_list
from areal_async.rollout.engines.torch_engine import TorchEngine
from areal_async.trainer.actor import PPOActor
from areal_async.trainer.compute.packing import select_attn_implementation
from protocols.trajectories import Trajectory

PHASES = ("gen", "reward", "train", "publish", "wait")

# What the fleet's roles do to go faster, and whether the matched in-process loop does it too
# (``matched``: True = it does; a string = why it does not apply to one thread).
MATCHED = {
    "gc.freeze() after the build (app/worker.run_worker)": True,
    "completions decoded in one call (models.tokenizer.batch_decoder, rollout/service)": True,
    "trajectories as views of the group's packed tensors, one prompt tensor per group "
    "(rollout/service._split_list, trainer/service._split_samples)": True,
    "freed heap kept (cluster.retained_heap_mb) and torch threads (base/process.setup_torch_process)": "both loops",
    "proximal logprobs from the update's forward, lean forward/decode (PPOActor, TorchEngine)": "both loops",
    "trainer pinned to a CPU of its own (cluster.cpu_affinity)": "both loops run on the trainer's CPU",
    "forward ahead at eta = 0 (PPOActor.forward_ahead)": "an overlap with scoring in another thread: in one "
    "thread the same forward runs in the same order",
    "publication after TrainStepDone (trainer/service)": "an overlap with planning; in-process the engine "
    "takes the trainer's tensors with no copy, cheaper than any channel",
    "reward checks batched per pool child (reward/pool)": "no pool in-process: the reward function is called directly",
    "scheduler drains up to DRAIN_MAX frames per wakeup, uvloop (scheduler/router)": "no event loop or socket "
    "in-process",
}
VARIANTS = ("plain", "matched")


class InProcessLoop:
    """Engine, reward function and PPO actor of the project in one loop (see the module docstring).
    ``matched``: with the fleet's optimisations that apply to one thread (``MATCHED``; ``gc.freeze``
    is the caller's, after the build: see ``run_inprocess``)."""

    def __init__(self, cfg, matched: bool = False):

        setup_torch_process(cfg.cluster)
        self.cfg, self.matched = cfg, matched
        model, self.tok = load_policy(cfg.model, cfg.seed)
        self.engine = TorchEngine(
            copy.deepcopy(model),
            self.tok,
            device="cpu",
            seed=cfg.seed * 1000,
            max_batch_groups=cfg.rollout.max_batch_groups,
        )
        model.set_attn_implementation(select_attn_implementation("cpu"))
        self.actor = PPOActor(model, cfg.actor, temperature=cfg.gconfig.temperature, total_steps=cfg.total_train_steps)
        self.reward_fn = load_callable(cfg.reward.fn)
        self.problems = load_problems(cfg.train_dataset, cfg.seed)
        self.cursor = PromptCursor(len(self.problems), cfg.seed, cfg.train_dataset.shuffle)
        self.encode = prompt_encoder(self.tok, cfg.train_dataset.template)
        self.decode_batch = batch_decoder(self.tok)
        self.version = 0

    def step(self) -> dict[str, float]:
        """One RL step; returns seconds per phase (and this process's CPU seconds as ``cpu``)."""
        c0, t0 = time.process_time(), time.perf_counter()
        self.engine.update_weights(self.version, {k: v.detach() for k, v in self.actor.model.state_dict().items()})
        t1 = time.perf_counter()
        groups = self._generate()
        t2 = time.perf_counter()
        trajs = self._score_packed(groups) if self.matched else self._score(groups)
        t3 = time.perf_counter()
        self.actor.train_step(trajs)
        self.version += 1
        t4 = time.perf_counter()
        cpu = time.process_time() - c0
        return {
            "publish": t1 - t0,
            "gen": t2 - t1,
            "reward": t3 - t2,
            "train": t4 - t3,
            "wait": 0.0,
            "step": t4 - t0,
            "cpu": cpu,
        }

    def _generate(self) -> list[tuple]:
        """[(TrajectoryBatch, problem, prompt ids)] of one batch, decoded as one engine batch."""
        g = self.cfg.gconfig
        reqs = {}
        for _ in range(self.cfg.train_dataset.batch_size):
            idx, pid = self.cursor.next()
            prompt = self.encode(self.problems[idx].prompt)
            reqs[pid] = (self.problems[idx], prompt)
            self.engine.add_request(
                GenRequest(pid, prompt, g.n_samples, g.max_new_tokens, g.temperature, g.top_p, g.greedy)
            )
        done = []
        while self.engine.has_work():
            done += self.engine.step()
        return [(out, *reqs[out.group_id]) for out in done]

    def _score(self, groups: list[tuple]) -> list:
        """The plain loop: the prompt encoded again per group, per sample one decode and the engine's
        per-sample views (``TrajectoryBatch.samples``), the prompt a list converted per trajectory."""
        trajs = []
        for out, problem, _ in groups:
            prompt, gid = self.encode(problem.prompt), out.group_id
            for i, s in enumerate(out.samples()):
                text = self.tok.decode(s.output_ids, skip_special_tokens=True)
                score = float(self.reward_fn(text, list(problem.solutions)))
                trajs.append(Trajectory(f"{gid}-{i}", gid, prompt, s.output_ids, s.logprobs, s.versions, score))
        return trajs

    def _score_packed(self, groups: list[tuple]) -> list:
        """The matched loop, as the rollout worker and the trainer do it: every completion of the
        batch decoded in one call (one ``tolist`` per group), and per group one prompt tensor and
        ``split_with_sizes`` views of its packed ids, logprobs and versions."""
        texts = iter(
            self.decode_batch([ids for out, _, _ in groups for ids in _split_list(out.output_ids, out.lengths)])
        )
        trajs = []
        for out, problem, prompt_ids in groups:
            p, gid, sols = out, out.group_id, list(problem.solutions)
            prompt = torch.as_tensor(prompt_ids, dtype=torch.int32)
            cols = (x.split_with_sizes(p.lengths) for x in (p.output_ids, p.logprobs, p.versions))
            for i, (ids, logp, vers) in enumerate(zip(*cols)):
                score = float(self.reward_fn(next(texts), sols))
                trajs.append(Trajectory(f"{gid}-{i}", gid, prompt, ids, logp, vers, score))
        return trajs


def run_inprocess(cfg, steps: int, warmup: int, matched: bool = False) -> dict:
    """One leg: a fresh loop, ``steps`` steps, means over the steps after ``warmup`` (ms). The
    previous leg's garbage is collected first; the matched loop freezes what its build made (as a
    fleet worker does) and unfreezes it after, so the next leg starts from the same heap."""
    gc.collect()
    loop = InProcessLoop(cfg, matched)
    if matched:
        gc.freeze()
    try:
        per_step = [loop.step() for _ in range(steps)][warmup:]
    finally:
        if matched:
            gc.unfreeze()
    return {k: 1000 * statistics.fmean(s[k] for s in per_step) for k in (*PHASES, "step", "cpu")}
