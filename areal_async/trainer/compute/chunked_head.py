"""The LM head fused with log-softmax, in chunks of tokens: per-token logprobs and entropies of a
packed micro-batch without a (T, V) float32 tensor for the whole micro-batch.

``head_logprobs(h_TE, weight_VE, bias_V, next_T, temperature, ...)`` returns what
``z = (h @ W.T + b).float() / temperature; logp = z[t, next_t] - logsumexp(z); H = -sum p log p``
returns, computing ``z`` for ``chunk`` tokens at a time. Backward recomputes each chunk's logits
(one more head matmul per chunk, the cost of not keeping them) and applies the analytic gradients

    d logp_t / d z_t = onehot(next_t) - p_t          d H_t / d z_t = -p_t (log p_t + H_t)

then ``dz / temperature`` in the weight's dtype into ``dh = dz W`` and ``dW = dz^T h`` (``dW`` and
``db`` accumulated over chunks in float32, cast to the weight's dtype once). That is the same
arithmetic autograd applies to the whole-logits computation, up to float rounding (the test
compares them in float64).

Memory, with C = chunk, V = vocabulary, T = micro-batch tokens: forward holds one chunk's logits
(C x V float32, plus the head's output in the weight dtype when it is not float32) and its
softmax (C x V float32), backward one chunk's logits, probabilities and gradient (3 C x V float32)
plus ``dW`` in float32 (V x E), and, where this process runs its linears on oneDNN (``lean_ops.use_onednn``),
one chunk's ``dz^T h`` (V x E float32) before it is added: oneDNN has no in-place accumulate, and its product and
the add took 389 ms where ``addmm_`` took 509 (C 1,024, SmolLM2's 49,152 x 576 head, 1 thread); the two other
products 320 / 271 ms where F.linear / ``@`` took 607 / 512. Saved for backward: h (T x E), and 2 floats per token.
Whole logits (``packing.forward_packed`` with chunking off) keep T x V float32 logits and, with an
entropy that has a gradient, T x V float32 probabilities alive from forward to backward.

Not covered: heads that are not a plain ``nn.Linear`` (quantised, LoRA-wrapped) or models that
scale or cap their logits after the head (Gemma2, Cohere): ``packing.forward_packed`` keeps the
whole-logits path for them, and for FSDP-sharded models (the head's parameters are gathered by the
root module's forward hooks, which a head applied outside that forward would skip).
"""

from __future__ import annotations

from typing import Optional

import torch

from areal_async.base import cores
from areal_async.models.lean_ops import mm_t, runs_on_onednn

DEFAULT_CHUNK_TOKENS = 1024  # actor.logits_chunk_tokens' default (benchmarks/memory.py: its peak)


def head_logprobs(
    h_TE: torch.Tensor,
    weight_VE: torch.Tensor,
    bias_V: Optional[torch.Tensor],
    next_T: torch.Tensor,
    temperature: float,
    chunk: int,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(logp_T float32, entropy_T float32 or None); see the module docstring.
    ``entropy_grad=False``: the entropy is a statistic (no gradient flows from it)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: expected >= 1 token")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: expected > 0")
    logp_T, ent_T = _FusedHead.apply(h_TE, weight_VE, bias_V, next_T, temperature, chunk, with_entropy)
    if ent_T is not None and not entropy_grad:
        ent_T = ent_T.detach()
    return logp_T, ent_T


def _chunk_logits(h_CE, weight_VE, bias_V, temperature: float) -> torch.Tensor:
    """(C, V) float32 logits / temperature, computed as ``packing._logits`` does (the head in the
    weight's dtype, then float32)."""
    z_CV = mm_t(h_CE, weight_VE, bias_V)
    z_CV = z_CV.float() if z_CV.dtype != torch.float32 else z_CV
    return z_CV.div_(temperature)


class _FusedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_TE, weight_VE, bias_V, next_T, temperature, chunk, with_entropy):
        T = h_TE.shape[0]
        logp_T = torch.empty(T, dtype=torch.float32, device=h_TE.device)
        lse_T = torch.empty_like(logp_T)
        ent_T = torch.empty_like(logp_T) if with_entropy else None
        for a in range(0, T, chunk):
            b = min(a + chunk, T)
            cores.pace()  # cluster.share_cores: each chunk's threads (base/cores.py)
            z_CV = _chunk_logits(h_TE[a:b], weight_VE, bias_V, temperature)
            lse_C = torch.logsumexp(z_CV, dim=-1)
            lse_T[a:b] = lse_C
            logp_T[a:b] = z_CV.gather(-1, next_T[a:b, None])[:, 0] - lse_C
            if with_entropy:  # H = lse - sum p z, p = exp(z - lse) (one more C x V, then reduced)
                ent_T[a:b] = lse_C - (z_CV - lse_C[:, None]).exp_().mul_(z_CV).sum(-1)
        ctx.save_for_backward(h_TE, weight_VE, bias_V, next_T, lse_T, ent_T)
        ctx.temperature, ctx.chunk = temperature, chunk
        return logp_T, ent_T

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T):
        h_TE, weight_VE, bias_V, next_T, lse_T, ent_T = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        T, temp = h_TE.shape[0], ctx.temperature
        dh_TE = torch.empty_like(h_TE) if need_h else None
        dw_VE = torch.zeros(weight_VE.shape, dtype=torch.float32, device=weight_VE.device) if need_w else None
        db_V = torch.zeros(bias_V.shape, dtype=torch.float32, device=bias_V.device) if need_b else None
        for a in range(0, T, ctx.chunk):
            b = min(a + ctx.chunk, T)
            cores.pace()
            g_logp_C, g_ent_C, ent_C = (None if x is None else x[a:b] for x in (g_logp_T, g_ent_T, ent_T))
            dz_CV = _chunk_grad(h_TE[a:b], weight_VE, bias_V, next_T[a:b], lse_T[a:b], ent_C, g_logp_C, g_ent_C, temp)
            dz_CV = dz_CV.to(h_TE.dtype)
            if need_h:
                dh_TE[a:b] = mm_t(dz_CV, weight_VE.t())  # dz W
            if need_w:
                _accumulate(dw_VE, dz_CV.t(), h_TE[a:b])
            if need_b:
                db_V.add_(dz_CV.float().sum(0))
        dw = dw_VE.to(weight_VE.dtype) if need_w else None
        db = db_V.to(bias_V.dtype) if need_b else None
        return dh_TE, dw, db, None, None, None, None


def _accumulate(acc_VE: torch.Tensor, dzt_VC: torch.Tensor, h_CE: torch.Tensor) -> None:
    """acc += dz^T h: in place when the operands are float32, else through one V x E product in
    their dtype (as autograd's whole-logits backward computes dW, per chunk here)."""
    if runs_on_onednn(dzt_VC, h_CE):
        acc_VE.add_(mm_t(dzt_VC, h_CE.t()))  # oneDNN's product into a V x E temporary: still the faster (module doc)
    elif dzt_VC.dtype == torch.float32:
        acc_VE.addmm_(dzt_VC, h_CE)
    else:
        acc_VE.add_(dzt_VC @ h_CE)


def _chunk_grad(h_CE, weight_VE, bias_V, next_C, lse_C, ent_C, g_logp_C, g_ent_C, temp: float):
    """d loss / d (head output) for one chunk, float32 (C, V): the analytic log-softmax and entropy
    gradients (module docstring), divided by the temperature."""
    logq_CV = _chunk_logits(h_CE, weight_VE, bias_V, temp).sub_(lse_C[:, None])  # log p
    p_CV = logq_CV.exp()
    if g_ent_C is not None:  # -g_H p (log p + H), in place on log p
        dz_CV = logq_CV.add_(ent_C[:, None]).mul_(p_CV).mul_(-g_ent_C[:, None])
    else:
        dz_CV = logq_CV.zero_()
    if g_logp_C is not None:  # g (onehot - p)
        dz_CV.sub_(p_CV.mul_(g_logp_C[:, None]))
        dz_CV.scatter_add_(-1, next_C[:, None], g_logp_C[:, None])
    return dz_CV.div_(temp)


def whole_logprobs(z_TV: torch.Tensor, next_T: torch.Tensor, with_entropy: bool) -> tuple:
    """(logp_T, entropy_T or None) of whole float32 logits ``z_TV`` (already divided by the temperature), the
    entropy a statistic (no gradient): what ``z[t, next_t] - logsumexp(z_t)`` and ``-sum p log p`` return,
    computed once into the softmax p, which is kept for backward instead of the logits, so backward is
    ``g (onehot(next) - p)`` in one pass over p (autograd's logsumexp and gather backward make p again, a zero
    (T, V) gradient for the gather, and their sum). At SmolLM2's 49,152-token head this is most of what a
    whole-logits step spends outside the matmuls."""
    return _WholeHead.apply(z_TV, next_T, with_entropy)


class _WholeHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z_TV, next_T, with_entropy):
        max_T1 = z_TV.amax(-1, keepdim=True)
        p_TV = torch.sub(z_TV, max_T1).exp_()
        sum_T1 = p_TV.sum(-1, keepdim=True)
        p_TV.div_(sum_T1)
        lse_T = (max_T1 + sum_T1.log()).squeeze(1)
        logp_T = z_TV.gather(-1, next_T[:, None]).squeeze(1) - lse_T
        ent_T = None
        if with_entropy:  # H = lse - sum p z, the row dots as one batched matmul (no (T, V) product)
            ent_T = lse_T - torch.bmm(p_TV.unsqueeze(1), z_TV.unsqueeze(2)).view(-1)
        ctx.save_for_backward(p_TV, next_T)
        ctx.mark_non_differentiable(*(() if ent_T is None else (ent_T,)))
        return logp_T, ent_T

    @staticmethod
    def backward(ctx, g_logp_T, g_ent_T):
        p_TV, next_T = ctx.saved_tensors
        if g_logp_T is None:
            return None, None, None
        dz_TV = p_TV * -g_logp_T[:, None]
        dz_TV.scatter_add_(-1, next_T[:, None], g_logp_T[:, None])
        return dz_TV, None, None
