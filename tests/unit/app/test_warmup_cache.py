"""The warm-up cache (app/workers/warmup_cache.py): a hit gives the weights, training mode and metrics the warm-up
itself gives, to the bit; the reference is the warm-up run with the cache off (the code as it was), in
this process and in a fresh interpreter. The key moves with what decides the weights and only with it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_async.app.workers import warmup_cache
from areal_async.app.workers.policy import warmup
from areal_async.app.workers.warmup_cache import KEEP, cache_root, cacheable, cached_warmup, warmup_key
from areal_async.config import load_config
from areal_async.models.tiny import load_policy

ROOT = Path(__file__).resolve().parents[3]
FAST = ["sft_warmup.steps=4", "sft_warmup.batch_size=16"]


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_ASYNC_CACHE", str(tmp_path / "cache"))


def _cfg(*overrides: str):
    return load_config(str(ROOT / "configs/tiny_arith.yaml"), [*FAST, *overrides])


def _warm(cfg):
    model, tok = load_policy(cfg.model, cfg.seed)
    return model, warmup(cfg, model, tok)


def _digest(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode() + v.numpy().tobytes())
    return h.hexdigest()


def _never():
    raise AssertionError("the warm-up ran on a hit")


def test_a_hit_is_the_warm_up_to_the_bit():
    ref, ref_metrics = _warm(_cfg("sft_warmup.cache=false"))
    assert not cache_root().exists()  # the cache off writes nothing
    miss, miss_metrics = _warm(_cfg())  # trains and stores
    (entry,) = cache_root().iterdir()
    assert sorted(p.name for p in entry.iterdir()) == ["metrics.json", "model.safetensors"]
    cfg = _cfg()
    hit, _ = load_policy(cfg.model, cfg.seed)
    assert not hit.training  # built in eval mode; the warm-up's steps leave it training
    hit_metrics = cached_warmup(cfg, hit, _never)
    for m in (miss, hit):
        for k, v in ref.state_dict().items():
            assert torch.equal(m.state_dict()[k], v), k
    assert ref.training and miss.training and hit.training
    assert len(ref_metrics) == 4 and ref_metrics == miss_metrics == hit_metrics


def test_a_fresh_interpreter_warms_up_to_the_same_bits():
    """What one run stores another loads: the warm-up (cache off) in a new process, against a hit here."""
    code = (
        "import hashlib, sys; from tests.unit.app.test_warmup_cache import _cfg, _warm, _digest; "
        "print(_digest(_warm(_cfg('sft_warmup.cache=false'))[0]))"
    )
    env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    torch_threads = torch.get_num_threads()
    _warm(_cfg())  # store
    cfg = _cfg()
    hit, _ = load_policy(cfg.model, cfg.seed)
    cached_warmup(cfg, hit, _never)
    assert torch.get_num_threads() == torch_threads
    assert done.stdout.strip().splitlines()[-1] == _digest(hit)


def test_the_key_moves_with_what_decides_the_weights_and_only_with_it():
    base = warmup_key(_cfg())
    moves = [
        "seed=2", "sft_warmup.steps=5", "sft_warmup.lr=0.001", "sft_warmup.batch_size=8", "model.hidden_size=64",
        "train_dataset.size=50", "train_dataset.max_operand=8", "actor.mb_spec.max_tokens_per_mb=1024",
        "model.dtype=bfloat16",
    ]  # fmt: skip
    for o in moves:
        assert warmup_key(_cfg(o)) != base, o
    same = ("sft_warmup.cache=false", "total_train_steps=7", "rollout.max_head_offpolicyness=0", "actor.eps_clip=0.3")
    for o in same:
        assert warmup_key(_cfg(o)) == base, o


def test_the_key_moves_with_the_code(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(warmup_cache, "PACKAGE", pkg)
    before = warmup_key(_cfg())
    (pkg / "a.py").write_text("x = 2\n")
    assert warmup_key(_cfg()) != before


def test_an_entry_that_does_not_load_is_trained_again_and_replaced():
    ref, ref_metrics = _warm(_cfg("sft_warmup.cache=false"))
    _warm(_cfg())
    (entry,) = cache_root().iterdir()
    (entry / "model.safetensors").write_bytes(b"not a safetensors file")
    again, metrics = _warm(_cfg())  # trains (a miss), stores a good entry
    assert metrics == ref_metrics and _digest(again) == _digest(ref)
    cfg = _cfg()
    hit, _ = load_policy(cfg.model, cfg.seed)
    cached_warmup(cfg, hit, _never)
    assert _digest(hit) == _digest(ref)


def test_only_a_built_model_on_cpu_is_cached():
    cfg = _cfg()
    model, _ = load_policy(cfg.model, cfg.seed)
    assert cacheable(cfg, model)
    assert not cacheable(_cfg("sft_warmup.cache=false"), model)
    assert not cacheable(_cfg("cluster.device=cuda"), model)
    assert not cacheable(_cfg("model.path=/nowhere"), model)
    calls = []
    cached_warmup(_cfg("cluster.device=cuda"), model, lambda: calls.append(1) or [])
    cached_warmup(_cfg("cluster.device=cuda"), model, lambda: calls.append(1) or [])
    assert calls == [1, 1] and not cache_root().exists()


def test_the_newest_entries_are_kept():
    root = cache_root()
    root.mkdir(parents=True)
    for i in range(KEEP + 3):
        (root / f"e{i:03d}").mkdir()
        os.utime(root / f"e{i:03d}", (1000 + i, 1000 + i))
    (root / ".e-tmp").mkdir()
    os.utime(root / ".e-tmp", (0, 0))  # a writer that died long ago
    warmup_cache._prune(root)
    assert sorted(p.name for p in root.iterdir()) == [f"e{i:03d}" for i in range(3, KEEP + 3)]
