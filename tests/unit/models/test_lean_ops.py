"""oneDNN's matmul for the trainer's float32 linears (models/lean_ops.py: ``use_onednn``, ``any_linear``, ``mm_t``):
values and gradients against float64 references computed here, proof that oneDNN ran (and F.linear did not), the
process switch restored, bad kernels refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers

from areal_async.models import lean_ops
from areal_async.trainer.compute.packing import forward_packed, pack, use_varlen_attention

pytestmark = pytest.mark.skipif(not lean_ops.onednn_usable(torch.empty(0)), reason="torch built without oneDNN")


@pytest.fixture
def onednn():
    """This process's linears on oneDNN for one test, F.linear again after it."""
    lean_ops.use_onednn("onednn", 8, 8)
    try:
        yield
    finally:
        lean_ops.use_onednn("blas", 8, 8)


def calls_to(monkeypatch, name: str) -> list:
    """Count the calls of ``lean_ops.<name>`` (still running it)."""
    seen, real = [], getattr(lean_ops, name)
    monkeypatch.setattr(lean_ops, name, lambda *a, **k: seen.append(1) or real(*a, **k))
    return seen


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


def test_a_linear_and_its_three_gradients_equal_float64(onednn, monkeypatch):
    """y = x W^T + b for a 3-D x, and dL/dx, dL/dW, dL/db of L = sum(g * y): each within 1e-6 (relative) of the
    same computed in float64 by F.linear and autograd, every product on oneDNN (3 calls: forward, dx, dW)."""
    g = torch.Generator().manual_seed(0)
    x, w, b, gy = (torch.randn(*s, generator=g) for s in ((3, 5, 24), (40, 24), (40,), (3, 5, 40)))
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    F.linear(x64, w64, b64).backward(gy.double())
    x32, w32, b32 = (t.clone().requires_grad_() for t in (x, w, b))
    seen = calls_to(monkeypatch, "onednn_mm")
    monkeypatch.setattr(lean_ops.F, "linear", lambda *a, **k: pytest.fail("F.linear ran"))
    y = lean_ops.any_linear(x32, w32, b32)
    assert y.shape == (3, 5, 40) and rel(y, x64 @ w64.T + b64) < 1e-6
    y.backward(gy)
    assert len(seen) == 3
    for got, want in ((x32.grad, x64.grad), (w32.grad, w64.grad), (b32.grad, b64.grad)):
        assert rel(got, want) < 1e-6


def test_a_frozen_weight_gets_no_gradient_and_costs_no_product(onednn, monkeypatch):
    """A LoRA base weight (requires_grad False): dx only, no dW product (2 oneDNN calls, not 3)."""
    x = torch.randn(7, 16, requires_grad=True)
    w = torch.randn(12, 16)
    seen = calls_to(monkeypatch, "onednn_mm")
    lean_ops.any_linear(x, w).sum().backward()
    assert len(seen) == 2 and w.grad is None
    assert rel(x.grad, torch.ones(7, 12).double() @ w.double()) < 1e-6


def test_off_by_default_and_outside_float32_cpu(monkeypatch):
    """Without ``use_onednn`` (or for float64) every linear is F.linear's: oneDNN never runs."""
    monkeypatch.setattr(lean_ops, "onednn_mm", lambda *a, **k: pytest.fail("oneDNN ran"))
    assert not lean_ops.onednn_chosen()
    lean_ops.any_linear(torch.randn(2, 3), torch.randn(4, 3))
    lean_ops.mm_t(torch.randn(2, 3), torch.randn(4, 3))
    lean_ops.use_onednn("onednn", 8, 8)
    try:
        lean_ops.any_linear(torch.randn(2, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64))
    finally:
        lean_ops.use_onednn("blas", 8, 8)


def test_bad_kernels_are_refused_and_auto_follows_the_timing(monkeypatch):
    with pytest.raises(ValueError, match="linears='mkl': expected one of"):
        lean_ops.use_onednn("mkl", 8, 8)
    monkeypatch.setattr(lean_ops, "onednn_usable", lambda w: False)
    with pytest.raises(ValueError, match="no oneDNN matmul"):
        lean_ops.use_onednn("onednn", 8, 8)
    monkeypatch.undo()
    for pays in (True, False):  # auto: whatever onednn_pays says at a micro-batch's 512 rows
        monkeypatch.setattr(lean_ops, "onednn_pays", lambda n_in, n_out, rows, pays=pays: rows == 512 and pays)
        assert lean_ops.use_onednn("auto", 8, 8) is pays and lean_ops.onednn_chosen() is pays
    lean_ops.use_onednn("blas", 8, 8)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    return use_varlen_attention(transformers.LlamaForCausalLM(cfg).train())


@pytest.mark.parametrize("chunk", [0, 8])
def test_the_trainers_step_on_onednn_equals_float64(onednn, monkeypatch, chunk):
    """The lean forward and the lm head (whole, and chunked: 8 tokens at a time) with the layers and the head on
    oneDNN: logprobs and every parameter's gradient within 1e-5 (relative) of the float64 model's on F.linear;
    oneDNN ran every product (7 layer linears x 2 layers + the head, forward and backward)."""
    model = _model()
    ref = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(1)
    packed = pack([torch.randint(0, 97, (n,), generator=g) for n in (9, 4, 12)])  # 25 tokens
    lean_ops.use_onednn("blas", 8, 8)
    want, _ = forward_packed(ref, packed, 0.7, chunk_tokens=chunk)  # float64: F.linear whatever the switch
    want.double().sum().backward()
    lean_ops.use_onednn("onednn", 8, 8)
    seen = calls_to(monkeypatch, "onednn_mm")
    got, _ = forward_packed(model, packed, 0.7, chunk_tokens=chunk)
    got.sum().backward()
    forward_calls = 2 * 7 + (25 + chunk - 1) // chunk if chunk else 2 * 7 + 1
    assert len(seen) >= 3 * forward_calls  # fwd + dx + dW each (the chunked head: its logits twice, dh, dW)
    assert rel(got, want) < 1e-5
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel(p.grad, grads[name].grad) < 1e-5, name


def test_onednn_bounds_its_caches_unless_the_environment_says(monkeypatch):
    """Choosing oneDNN sets both shape caches to 32 entries (read at the process's first oneDNN primitive), keeps
    a value the environment gives, and 'blas' sets nothing."""
    for name in lean_ops.ONEDNN_CACHES:
        monkeypatch.delenv(name, raising=False)
    lean_ops.use_onednn("blas", 8, 8)
    assert not any(name in lean_ops.os.environ for name in lean_ops.ONEDNN_CACHES)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    lean_ops.use_onednn("onednn", 8, 8)
    lean_ops.use_onednn("blas", 8, 8)
    assert lean_ops.os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "32"
    assert lean_ops.os.environ["LRU_CACHE_CAPACITY"] == "7"
