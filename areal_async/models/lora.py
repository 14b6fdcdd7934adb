"""LoRA adapters (``actor.lora``): what the trainer trains, what the weight channel carries, what engines apply.

An adapter on a linear layer ``y = x W^T`` (W: out x in) adds ``s (x A^T) B^T`` with A: r x in,
B: out x r and s = alpha / r (Hu et al. 2021, arXiv 2106.09685); B starts at zero, so a fresh adapter
changes nothing. Its size is ``r (in + out)`` numbers per adapted layer (``adapter_numel``).

Names: an adapter tensor is named after the layer it adapts, ``<layer>.lora_A.weight`` and
``<layer>.lora_B.weight`` (``<layer>`` as in the HF model: ``model.layers.0.self_attn.q_proj``); that
is PEFT's saved format without its ``base_model.model.`` prefix, which ``save_adapter`` adds so the
directory loads with ``peft``, vLLM (``/v1/load_lora_adapter``) and SGLang (``/load_lora_adapter``).

- trainer: ``inject`` puts PEFT's LoRA layers into the HF model in place (the model keeps its class
  and module tree, so the packed and lean forwards run as before: they call wrapped projections) and
  freezes everything else; ``adapter_params`` are the trainable tensors under the names above.
- engines: ``EngineAdapter`` applies a received adapter to an inference model, ``merged`` (W + s B A
  written into the layer's weight, computed from a kept copy of W) or unmerged (the layer replaced by
  ``LoraLinear``: the base matmul plus two thin ones per call).
- files: ``save_adapter`` / ``load_adapter`` (PEFT layout), ``merge_into`` (a full state dict with the
  adapter folded in), ``export_merged`` (``areal-async export-lora``: a checkpoint's adapter merged into
  its base, written as an HF model directory).

``peft`` is an optional extra (``pip install -e '.[lora]'``), imported only by ``inject``.
Not covered: adapters on embeddings or the lm head, DoRA / rsLoRA, several adapters at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.nn.functional as F

from areal_async.models.tiny import load_model
from areal_async.models.tokenizer import load_tokenizer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
LORA_BASE = "lora_base"  # a LoRA run's frozen base model: RUN_DIR/lora_base (HF directory, written once)
PEFT_INSTALL = "pip install -e '.[lora]' (the peft package)"


@dataclass(frozen=True)
class LoraSpec:
    """An adapter's shape: rank r, alpha (scale alpha / r), the adapted layers' names (the last part of
    their module path: ``q_proj``), dropout (training only)."""

    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0

    @classmethod
    def of(cls, cfg) -> Optional["LoraSpec"]:
        """From ``actor.lora`` (a ``LoraConfig`` section); None when its rank is 0 (LoRA off)."""
        if cfg.rank == 0:
            return None
        return cls(cfg.rank, float(cfg.alpha), tuple(cfg.target_modules), float(cfg.dropout))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def is_adapter_key(name: str) -> bool:
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def target_linears(model: torch.nn.Module, targets: Iterable[str]) -> dict[str, torch.nn.Linear]:
    """The model's ``nn.Linear`` layers whose last name part is in ``targets``, by module path; a
    ``ValueError`` names the targets that match no linear layer."""
    targets = tuple(targets)
    found = {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and name.rsplit(".", 1)[-1] in targets
        and name.rsplit(".", 1)[-1] != "lm_head"
    }
    missing = sorted(set(targets) - {n.rsplit(".", 1)[-1] for n in found})
    if missing:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"no linear layer named {missing} in {type(model).__name__} (its linear layers: {names})")
    return found


def adapter_shapes(model: torch.nn.Module, spec: LoraSpec) -> dict[str, tuple[int, int]]:
    """Every adapter tensor's name and shape: A (r, in), B (out, r) per adapted layer."""
    out: dict[str, tuple[int, int]] = {}
    for name, lin in target_linears(model, spec.target_modules).items():
        out[f"{name}.lora_A.weight"] = (spec.rank, lin.in_features)
        out[f"{name}.lora_B.weight"] = (lin.out_features, spec.rank)
    return out


def adapter_numel(model: torch.nn.Module, spec: LoraSpec) -> int:
    """Numbers in the adapter: r (in + out) summed over the adapted layers."""
    return sum(a * b for a, b in adapter_shapes(model, spec).values())


# ---- trainer ----------------------------------------------------------------------------------


def inject(model: torch.nn.Module, spec: LoraSpec, seed: int) -> torch.nn.Module:
    """PEFT's LoRA layers put into ``model`` in place (A seeded from ``seed``, B zero), every other
    parameter frozen; returns the model. ``RuntimeError`` when peft is not installed."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise RuntimeError(f"actor.lora.rank={spec.rank} needs peft: {PEFT_INSTALL}") from e
    target_linears(model, spec.target_modules)  # a clear error before peft's own
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.target_modules),
        lora_dropout=spec.dropout,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):  # seeded A without moving the caller's RNG
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def canonical_name(peft_name: str) -> Optional[str]:
    """``<layer>.lora_A.default.weight`` (PEFT's parameter) -> ``<layer>.lora_A.weight``; None for
    a parameter that is not an adapter's."""
    for part in ("lora_A", "lora_B"):
        tag = f".{part}.default.weight"
        if peft_name.endswith(tag):
            return peft_name[: -len(tag)] + f".{part}.weight"
    return None


def adapter_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters of a model ``inject`` wrapped, under the canonical names (the
    tensors themselves: DTensors when the model is sharded)."""
    out = {}
    for name, p in model.named_parameters():
        key = canonical_name(name)
        if key is not None:
            out[key] = p
    return out


def base_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict of a model ``inject`` wrapped, under the HF names (no adapter,
    ``<layer>.base_layer.weight`` back to ``<layer>.weight``)."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" not in name:
            out[name.replace(".base_layer.", ".")] = t
    return out


@torch.no_grad()
def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The HF-named state dict of a model ``inject`` wrapped, every LoRA layer folded in with its own
    rank and scaling (W + s B A): what a plain model of the same class loads (one process)."""
    out = base_state(model)
    for name, m in model.named_modules():
        scaling = getattr(m, "scaling", None)
        if isinstance(scaling, dict) and "default" in scaling and hasattr(m, "base_layer"):
            a, b = m.lora_A["default"].weight.float(), m.lora_B["default"].weight.float()
            w = out[f"{name}.weight"]
            out[f"{name}.weight"] = (w.float() + scaling["default"] * (b @ a)).to(w.dtype)
    return out


# ---- applying an adapter ------------------------------------------------------------------------


def check_adapter(expected: Mapping[str, tuple[int, ...]], sd: Mapping[str, torch.Tensor]) -> None:
    """``ValueError`` naming the first missing, unexpected or misshapen adapter tensor."""
    extra = sorted(set(sd) - set(expected))
    if extra:
        raise ValueError(f"adapter tensor {extra[0]!r} is not one of this adapter's ({len(expected)} tensors)")
    for name, shape in expected.items():
        if name not in sd:
            raise ValueError(f"adapter is missing {name!r} (shape {tuple(shape)})")
        if tuple(sd[name].shape) != tuple(shape):
            raise ValueError(f"adapter tensor {name!r} has shape {tuple(sd[name].shape)}, expected {tuple(shape)}")


def delta(sd: Mapping[str, torch.Tensor], layer: str, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """s B A of one layer, computed in float32, in ``dtype``."""
    a, b = sd[f"{layer}.lora_A.weight"].float(), sd[f"{layer}.lora_B.weight"].float()
    return (b @ a).mul_(scale).to(dtype)


class LoraLinear(torch.nn.Module):
    """``base(x) + s (x A^T) B^T``: an unmerged adapter on a linear layer (the engines' unmerged mode)."""

    def __init__(self, base: torch.nn.Linear, rank: int, scale: float):
        super().__init__()
        self.base_layer, self.scale = base, scale
        w = base.weight
        self.lora_A = torch.nn.Parameter(torch.zeros(rank, base.in_features, dtype=w.dtype, device=w.device), False)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank, dtype=w.dtype, device=w.device), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scale


class EngineAdapter:
    """An adapter applied to an inference model: ``load(sd)`` checks a received adapter in full (names
    and shapes; on a mismatch nothing changes) and applies it, ``merged`` or not; ``load_base(sd)``
    replaces the base weights under it (HF names, the whole model). ``base``: a function returning the
    base's state dict, called once, at the first ``load`` (a rollout worker reads the run's base
    directory then: the trainer writes it before it publishes the first adapter)."""

    def __init__(
        self, model: torch.nn.Module, spec: LoraSpec, merged: bool, base: Optional[Callable[[], Mapping]] = None
    ):
        self.model, self.spec, self.merged, self.base_source = model, spec, merged, base
        self.params = dict(model.state_dict(keep_vars=True))  # the base's tensors, before any wrapping
        self.layers = target_linears(model, spec.target_modules)
        self.shapes = adapter_shapes(model, spec)
        self.base: dict[str, torch.Tensor] = {}
        if merged:  # W is rewritten from its copy at every load
            self.base = {n: lin.weight.detach().clone() for n, lin in self.layers.items()}
        else:
            self.wrapped = {n: self._wrap(n, lin) for n, lin in self.layers.items()}

    def _wrap(self, name: str, lin: torch.nn.Linear) -> LoraLinear:
        parent_name, _, attr = name.rpartition(".")
        wrapped = LoraLinear(lin, self.spec.rank, self.spec.scale)
        setattr(self.model.get_submodule(parent_name), attr, wrapped)
        return wrapped

    @torch.no_grad()
    def load(self, sd: Mapping[str, torch.Tensor]) -> None:
        check_adapter(self.shapes, sd)
        if self.base_source is not None:
            self.load_base(self.base_source())
            self.base_source = None
        for name, lin in self.layers.items():
            if self.merged:
                w = self.base[name]
                lin.weight.copy_(w + delta(sd, name, self.spec.scale, torch.float32).to(w.device, w.dtype))
            else:
                self.wrapped[name].lora_A.copy_(sd[f"{name}.lora_A.weight"])
                self.wrapped[name].lora_B.copy_(sd[f"{name}.lora_B.weight"])

    @torch.no_grad()
    def load_base(self, sd: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(self.params) - set(sd))
        unexpected = sorted(set(sd) - set(self.params))
        if unexpected or missing:
            raise ValueError(
                f"base weights: unexpected {unexpected[:3]}, missing {missing[:3]}; expected the model's state dict"
            )
        for name, t in sd.items():
            self.params[name].copy_(t)
        for name in self.base:
            self.base[name].copy_(sd[f"{name}.weight"])


# ---- files --------------------------------------------------------------------------------------


def peft_config(spec: LoraSpec, base_model: str = "") -> dict:
    """``adapter_config.json`` as PEFT writes it for a plain LoRA (the keys vLLM and SGLang read)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def save_adapter(path: str | Path, sd: Mapping[str, torch.Tensor], spec: LoraSpec, base_model: str = "") -> Path:
    """Write ``sd`` (canonical names) as a PEFT adapter directory; returns it."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in sd.items()}
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    (path / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec, base_model), indent=1) + "\n")
    return path


def load_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], LoraSpec]:
    """(canonical state dict, spec) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file():
        raise FileNotFoundError(f"{str(path)!r} holds no {ADAPTER_CONFIG}; expected a LoRA adapter directory")
    c = json.loads((path / ADAPTER_CONFIG).read_text())
    spec = LoraSpec(int(c["r"]), float(c["lora_alpha"]), tuple(c["target_modules"]), float(c.get("lora_dropout", 0)))
    sd = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}
    return sd, spec


def merge_into(base: Mapping[str, torch.Tensor], sd: Mapping[str, torch.Tensor], spec: LoraSpec) -> dict:
    """A full state dict (HF names): ``base`` with W + s B A at every adapted layer."""
    layers = {k.removesuffix(".lora_A.weight") for k in sd if k.endswith(".lora_A.weight")}
    out = dict(base)
    for layer in layers:
        w = base[f"{layer}.weight"]
        out[f"{layer}.weight"] = (w.float() + delta(sd, layer, spec.scale, torch.float32)).to(w.dtype)
    return out


def export_merged(adapter_dir: str | Path, out: str | Path, base_dir: Optional[str | Path] = None) -> Path:
    """The merged model (base + s B A at every adapted layer) as an HF directory ``out``, with the base's
    tokenizer; ``base_dir`` defaults to the base the adapter names (``base_model_name_or_path``)."""
    sd, spec = load_adapter(adapter_dir)
    base_dir = base_dir or json.loads((Path(adapter_dir) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base_dir:
        raise ValueError(f"{str(adapter_dir)!r} names no base model; give its directory (--base)")
    model = load_model(base_dir)
    model.load_state_dict(merge_into(model.state_dict(), sd, spec))
    model.save_pretrained(str(out))
    load_tokenizer(str(base_dir)).save_pretrained(str(out))
    return Path(out)
