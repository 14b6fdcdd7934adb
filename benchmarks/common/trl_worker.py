"""The TRL side of ``benchmarks/trl_grpo.py``, run by the TRL environment's interpreter (``scripts/setup_trl.sh``:
trl 1.16.0, transformers, datasets, accelerate and the CPU torch; no areal_async, no reasoning-gym)::

    TRL_PYTHON benchmarks/common/trl_worker.py SPEC.json

SPEC.json (written by ``trl_grpo.run``): the model directory, the training rows in the order they are trained
(``prompt``: the templated text, ``prompt_ids``: the project's token ids of it, ``index``: the problem), the
GRPOConfig keyword arguments, the threads, the steps after which to save the model, the run's start on the
monotonic clock and two pipe descriptors of the scorer (``score_w``: requests, ``score_r``: replies).

TRL's ``GRPOTrainer`` trains as it would for a user; this file adds three things around it: the reward
function (the completions' token ids, their text and problem indices go to the runner, which scores them with
the project's reward pool and answers the scores; one JSON line each way per step), a callback that writes
one row per step to ``OUT/trl_steps.jsonl`` (the step's end on the shared monotonic clock, this process's CPU
seconds, the rewards returned, TRL's own logged metrics) and saves the model after the steps asked for, and a
check before training that TRL tokenizes every prompt to the ids the project's template gives (the fleet's
prompt ids): a difference ends the run naming the prompt.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


class Scorer:
    """The reward function TRL calls: one request line out, one reply line back, per generation batch."""

    __name__ = "project_reward"  # TRL names its reward metrics by the function's __name__

    def __init__(self, score_w: int, score_r: int):
        self.out = os.fdopen(score_w, "w", buffering=1)
        self.inp = os.fdopen(score_r, "r")
        self.last: list[float] = []
        self.last_tokens = 0

    def __call__(self, prompts, completions, completion_ids, index, **kwargs):
        req = {"index": list(index), "completion_ids": [list(c) for c in completion_ids], "texts": list(completions)}
        self.out.write(json.dumps(req) + "\n")
        line = self.inp.readline()
        if not line:
            raise RuntimeError("the scorer closed its pipe (the runner ended?)")
        self.last = json.loads(line)["scores"]
        self.last_tokens = sum(len(c) for c in completion_ids)
        return self.last


def make_callback(spec: dict, out: Path, scorer: Scorer):
    from transformers import TrainerCallback

    class StepRows(TrainerCallback):
        """A row per optimizer step; the model saved after the steps in ``spec['save_steps']`` (its time
        left out of the wall clock of later steps, as the fleet does not save mid-run)."""

        def __init__(self):
            self.paused = 0.0
            self.pending: dict | None = None
            self.rows = open(out / "trl_steps.jsonl", "a", buffering=1)

        def on_train_begin(self, args, state, control, optimizer=None, **kw):
            info = json.loads((out / "trl_info.json").read_text())
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds torch's
            groups = [{k: g[k] for k in ("lr", "eps", "betas", "weight_decay") if k in g} for g in inner.param_groups]
            info["optimizer"] = {"class": type(inner).__name__, "param_groups": groups}
            (out / "trl_info.json").write_text(json.dumps(info, indent=1) + "\n")

        def on_step_end(self, args, state, control, model=None, processing_class=None, **kw):
            now = time.monotonic()
            step = state.global_step
            self.pending = {
                "step": step - 1,
                "version": step,
                "wall_s": now - spec["t0"] - self.paused,
                "cpu_s": time.process_time(),
                "rewards": scorer.last,
                "reward_mean": sum(scorer.last) / len(scorer.last),
                "trained_tokens": scorer.last_tokens,
            }
            if step in spec["save_steps"]:
                t = time.monotonic()
                model.save_pretrained(out / f"model_v{step}")
                processing_class.save_pretrained(out / f"model_v{step}")
                self.paused += time.monotonic() - t
                self.pending["save_s"] = time.monotonic() - t

        def on_log(self, args, state, control, logs=None, **kw):
            if self.pending is not None and logs and "loss" in logs:
                self.rows.write(json.dumps(self.pending | {"trl": logs}) + "\n")
                self.pending = None

    return StepRows()


def check_prompt_ids(trainer, rows: list[dict]) -> int:
    """TRL's own tokenization of each distinct prompt equals the project's ids; the number checked."""
    seen = {}
    for r in rows:
        seen.setdefault(r["prompt"], r["prompt_ids"])
    texts = list(seen)
    ids = trainer._tokenize_prompts(texts)[0]
    for text, got in zip(texts, ids):
        if list(got) != seen[text]:
            raise SystemExit(f"TRL tokenizes prompt {text!r} to {list(got)}; the project's template gives {seen[text]}")
    return len(texts)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[1]).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    out = Path(spec["out"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(spec["model"])
    rows = spec["rows"]
    data = Dataset.from_list([{"prompt": r["prompt"], "index": r["index"]} for r in rows])
    scorer = Scorer(spec["score_w"], spec["score_r"])
    args = GRPOConfig(output_dir=str(out / "trl_output"), **spec["grpo"])
    trainer = GRPOTrainer(model=model, reward_funcs=scorer, args=args, train_dataset=data, processing_class=tok)
    trainer.add_callback(make_callback(spec, out, scorer))
    info = {
        "prompts_checked": check_prompt_ids(trainer, rows),
        "torch_threads": torch.get_num_threads(),
        "versions": {m: __import__(m).__version__ for m in ("trl", "transformers", "torch", "datasets", "accelerate")},
    }
    (out / "trl_info.json").write_text(json.dumps(info, indent=1) + "\n")
    trainer.train()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
