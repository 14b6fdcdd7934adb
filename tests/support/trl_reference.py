"""Run TRL's GRPO loss (``GRPOTrainer._compute_loss``, trl 1.16.0) on given tensors: the test-only reference of
``tests/contract/test_trl_reference.py``, executed by the TRL environment's interpreter (``scripts/setup_trl.sh``)::

    python tests/support/trl_reference.py CASES.pt OUT.pt

CASES.pt: a list of dicts, one per case: ``settings`` (loss_type, importance_sampling_level, epsilon_low,
epsilon_high, beta, max_completion_length) and the padded tensors ``logp`` (B, T), ``old_logp`` (B, T),
``ref_logp`` (B, T), ``mask`` (B, T) and ``advantages`` (B,). OUT.pt: per case the loss and its gradient with
respect to ``logp``. TRL's own code computes the loss: the trainer object it runs on carries only the
settings above (train mode, one process, no gradient accumulation, no vLLM, no entropy terms), and its
per-token logprobs come from ``logp`` instead of a model forward. An attribute it reads that is not set
here raises AttributeError naming it, so a TRL that needs more fails loudly instead of defaulting.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from types import SimpleNamespace

import torch


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


class _Trainer:
    """What ``_compute_loss`` reads of ``self``; anything else raises."""

    def __init__(self, s: dict, logp: torch.Tensor):
        self.loss_type, self.importance_sampling_level = s["loss_type"], s["importance_sampling_level"]
        self.epsilon_low, self.epsilon_high, self.beta = s["epsilon_low"], s["epsilon_high"], s["beta"]
        self.max_completion_length = s["max_completion_length"]
        self.args = SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1)
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.use_vllm = self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = self._entropy_bonus_enabled = False
        self.current_gradient_accumulation_steps = 1
        self.model = SimpleNamespace(training=True)
        self.accelerator = _Accelerator()
        self._metrics = defaultdict(lambda: defaultdict(list))
        self._logp = logp

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kw):
        return self._logp, torch.zeros_like(self._logp), None


def run_case(compute_loss, case: dict) -> dict:
    logp = case["logp"].clone().requires_grad_(True)
    mask = case["mask"]
    B, T = mask.shape
    inputs = {
        "prompt_ids": torch.ones(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": case["advantages"],
        "old_per_token_logps": case["old_logp"],
        "ref_per_token_logps": case["ref_logp"],
        "num_items_in_batch": mask.sum().to(torch.float64),
    }
    loss = compute_loss(_Trainer(case["settings"], logp), None, inputs)
    loss.backward()
    return {"loss": loss.detach(), "grad": logp.grad.detach()}


def main(argv: list[str]) -> int:
    from trl.trainer.grpo_trainer import GRPOTrainer

    cases = torch.load(argv[1])
    torch.save([run_case(GRPOTrainer._compute_loss, c) for c in cases], argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
