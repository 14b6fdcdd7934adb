"""trainer/algo/loss.py against TRL's GRPO loss run as a test-only reference (trl 1.16.0,
``GRPOTrainer._compute_loss``).

TRL runs in an environment of its own (``scripts/setup_trl.sh``: its trainer module imports datasets, pandas
and pyarrow, which the package does not take on); this test skips, saying how to make it, when that
environment is absent. One subprocess (``tests/support/trl_reference.py``) computes every case's loss and
its gradient with respect to the per-token logprobs; the same tensors go through ``policy_loss`` with the
matching keys. The pairs (TRL loss_type / settings -> ours):

    grpo                      -> loss_agg_mode seq-mean-token-mean
    bnpo                      -> token-mean
    dr_grpo                   -> seq-mean-token-sum-norm, max_new_tokens = max_completion_length
    dapo, epsilon_high 0.28   -> token-mean (one minibatch: TRL's num_items_in_batch = its tokens), eps_clip_higher
    grpo at sequence level    -> importance_sampling_level sequence (GSPO), seq-mean-token-mean
    grpo, beta 0.04           -> kl_in loss, kl_estimator k3, kl_ctl 0.04 (TRL's KL is k3)

Ratios exp(logp - old) spread over about 0.6-1.7, so both clip branches are taken (checked below: a case
in which nothing was clipped could not tell the clip bounds apart).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from areal_async.config import ActorConfig
from areal_async.trainer.algo.loss import agg_scale, policy_loss

REPO = Path(__file__).resolve().parents[2]
LENS = [5, 3, 7, 2]
ADV = [1.2, -0.7, 0.4, -1.5]
CASES = {
    "grpo": ({"loss_type": "grpo"}, {"loss_agg_mode": "seq-mean-token-mean"}),
    "bnpo": ({"loss_type": "bnpo"}, {"loss_agg_mode": "token-mean"}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"loss_agg_mode": "seq-mean-token-sum-norm"}),
    "dapo": ({"loss_type": "dapo", "epsilon_high": 0.28}, {"loss_agg_mode": "token-mean", "eps_clip_higher": 0.28}),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        {"loss_agg_mode": "seq-mean-token-mean", "importance_sampling_level": "sequence"},
    ),
    "kl_k3": (
        {"loss_type": "grpo", "beta": 0.04},
        {"loss_agg_mode": "seq-mean-token-mean", "kl_in": "loss", "kl_estimator": "k3", "kl_ctl": 0.04},
    ),
}
MAX_NEW = 8


def trl_python_or_skip() -> Path:
    env = Path(os.environ.get("AREAL_TRL_ENV", Path.home() / ".cache" / "areal-async" / "trl-1.16.0"))
    if not (env / "READY").exists():
        pytest.skip(f"TRL reference environment absent ({env}): run scripts/setup_trl.sh (one time, ~2 min, 1.5 GB)")
    return env / "bin" / "python"


def tensors():
    g = torch.Generator().manual_seed(5)
    mask = torch.zeros(len(LENS), max(LENS), dtype=torch.long)
    for i, n in enumerate(LENS):
        mask[i, :n] = 1
    logp = -0.2 - 2.5 * torch.rand(mask.shape, generator=g, dtype=torch.float64)
    old = logp + 0.3 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    ref = logp + 0.2 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    return mask, logp, old, ref, torch.tensor(ADV, dtype=torch.float64)


def ours(mask, logp, old, ref, adv, keys: dict) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = ActorConfig(recompute_logprob=True, eps_clip=0.2, **keys)
    lp = logp.clone().requires_grad_(True)
    m = mask.bool()
    flat_mask = torch.ones(int(m.sum()), dtype=torch.bool)
    scale = agg_scale(flat_mask, LENS, cfg.loss_agg_mode, MAX_NEW)
    adv_t = adv.repeat_interleave(torch.tensor(LENS))
    loss, _ = policy_loss(lp[m], old[m], old[m], adv_t, cfg, scale=scale, seq_lens=LENS, ref_logp=ref[m])
    loss.backward()
    return loss.detach(), lp.grad


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    py = trl_python_or_skip()
    d = tmp_path_factory.mktemp("trl")
    mask, logp, old, ref, adv = tensors()
    base = {"importance_sampling_level": "token", "epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.0}
    cases = [
        {
            "settings": base | {"max_completion_length": MAX_NEW} | trl,
            "logp": logp,
            "old_logp": old,
            "ref_logp": ref,
            "mask": mask,
            "advantages": adv,
        }
        for trl, _ in CASES.values()
    ]
    torch.save(cases, d / "cases.pt")
    script = REPO / "tests" / "support" / "trl_reference.py"
    run = subprocess.run(
        [str(py), str(script), str(d / "cases.pt"), str(d / "out.pt")], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, f"TRL reference failed:\n{run.stderr[-3000:]}"
    return dict(zip(CASES, torch.load(d / "out.pt")))


@pytest.mark.parametrize("name", list(CASES))
def test_policy_loss_equals_trls_grpo_loss(reference, name):
    mask, logp, old, ref, adv = tensors()
    loss, grad = ours(mask, logp, old, ref, adv, CASES[name][1])
    want = reference[name]
    torch.testing.assert_close(loss, want["loss"].to(loss.dtype), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(grad, want["grad"].to(grad.dtype), rtol=1e-6, atol=1e-9)
    assert grad.abs().sum() > 0 and (grad[mask == 0] == 0).all()


def test_the_cases_take_both_clip_branches():
    """Token ratios exp(logp - old) outside [0.8, 1.2] with advantages of either sign: the clip matters."""
    mask, logp, old, _, adv = tensors()
    r = torch.exp(logp - old)[mask.bool()]
    a = adv.repeat_interleave(torch.tensor(LENS))
    assert ((r > 1.28) & (a > 0)).any() and ((r < 0.8) & (a < 0)).any() and ((r > 0.8) & (r < 1.2)).any()
