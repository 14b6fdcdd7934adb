"""The preflight of ``areal-async run`` / ``sft`` (and their ``--dry-run``): everything a run needs from
outside its YAML is looked at before any process starts.

Checks, in order (cheap first; ``run`` stops at the first error, ``--dry-run`` runs them all):
keys set for a type or backend that does not read them; the run directory; pinned CPUs, the
inference servers, the placement on the declared cluster and this machine (``supervisor/placement.py``;
the order of ``fleet.Supervisor.prepare``, which checks them again);
the dataset files; the plug-ins; the model directory and its tokenizer; the template on a first
prompt; free disk for the configured checkpoints. Model, data, template and plug-in checks live
in ``preflight_inputs.py``.

Unread keys: a key set for a type or backend that does not read it (``train_dataset.path`` with
``type: tiny_arith``, ``vllm.*`` with ``rollout.backend: torch``) is refused when the command line
sets it, or when the YAML file sets it against the file's own choice. It is a warning when the
YAML sets it and the command line switched the deciding key (``model.path=DIR`` on a preset that
describes the tiny model's shape), and for the sections presets carry on purpose (the other server
backend's settings, so one override switches; the reference model of a run with ``actor.kl_ctl:
0``; ``sft.*`` of a preset shared with ``areal-async sft``).

Every error is one line, ``<key>=<value>: <what is wrong>; <what to do>`` (the CLI prints it as
``areal-async: ...`` and exits 2).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import yaml

from areal_async.base.affinity import check_available
from areal_async.config import ExperimentConfig, ModelConfig, parse_override
from areal_async.models.context_limit import sglang_context, vllm_context
from areal_async.supervisor.plan import worker_specs
from areal_async.supervisor.placement import (
    PlacementError,
    check_gpus_present,
    gpus_needed_on,
    group_report,
    local_gpu_count,
    place,
    shape_of,
)
from areal_async.supervisor.preflight_findings import Context, Finding, error, ok, size_text as _size, warn
from areal_async.supervisor.preflight_inputs import (
    check_dataset,
    check_eval_data,
    check_lora,
    check_model,
    check_model_files,
    check_plugins,
    check_template,
)
from areal_async.supervisor.preflight_solo import check_recording, check_solo
from areal_async.supervisor.servers import launch_blocker, server_role, uses_servers
from areal_async.supervisor.weight_path import (
    DTYPE_BYTES,
    SHM_VERSIONS,
    account,
    gpu_memory,
    lora_param_count,
    param_count,
    server_gpu_overflow,
    version_bytes,
)
from areal_async.trainer.persist.checkpoint_dirs import checkpoint_to_resume

__all__ = ["Context", "Finding", "preflight", "set_keys", "report", "context_for"]

# ---- keys the chosen type or backend does not read -------------------------------------------

# the built tiny model's shape: every model.* key but the two a loaded model reads too
MODEL_SHAPE = tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig) if f.name not in ("path", "dtype"))


@dataclass(frozen=True)
class Unread:
    """Keys (a trailing '.' = a whole section) that no code reads when ``unread(ctx)``."""

    keys: tuple[str, ...]
    by: tuple[str, ...]  # the keys that decide (a preset's keys unread after the command line switched these: warned)
    unread: Callable[[Context], bool]
    why: Callable[[ExperimentConfig], str]
    todo: str
    on_purpose: bool = False  # presets set these on purpose: a warning when the YAML sets them


UNREAD = (
    Unread(
        ("train_dataset.path",),
        ("train_dataset.type",),
        lambda c: c.cfg.train_dataset.type != "jsonl",
        lambda c: f"train_dataset.type={c.train_dataset.type!r} generates its problems and reads no file",
        "set train_dataset.type=jsonl to train on that file, or drop the key",
    ),
    Unread(
        ("train_dataset.max_operand", "train_dataset.ops"),
        ("train_dataset.type",),
        lambda c: c.cfg.train_dataset.type != "tiny_arith",
        lambda c: f"read only by train_dataset.type='tiny_arith', not {c.train_dataset.type!r}",
        "drop the key",
    ),
    Unread(
        ("train_dataset.size",),
        ("train_dataset.type",),
        lambda c: c.cfg.train_dataset.type == "jsonl",
        lambda c: "read only by train_dataset.type='tiny_arith' or 'reasoning_gym', not 'jsonl'",
        "drop the key",
    ),
    Unread(
        ("train_dataset.tasks", "train_dataset.curriculum."),
        ("train_dataset.type",),
        lambda c: c.cfg.train_dataset.type != "reasoning_gym",
        lambda c: f"read only by train_dataset.type='reasoning_gym', not {c.train_dataset.type!r}",
        "set train_dataset.type=reasoning_gym to use it, or drop the key",
    ),
    Unread(
        MODEL_SHAPE,
        ("model.path",),
        lambda c: bool(c.cfg.model.path),
        lambda c: "model.path is set: the model and its shape come from that directory",
        "drop the key, or unset model.path to build the tiny model",
    ),
    Unread(
        ("sglang.",),
        ("rollout.backend",),
        lambda c: not c.cfg.rollout.backend.startswith("sglang"),
        lambda c: f"rollout.backend={c.rollout.backend!r} starts no SGLang server",
        "set rollout.backend=sglang to use it, or drop the key",
        on_purpose=True,
    ),
    Unread(
        ("vllm.",),
        ("rollout.backend",),
        lambda c: not c.cfg.rollout.backend.startswith("vllm"),
        lambda c: f"rollout.backend={c.rollout.backend!r} starts no vLLM server",
        "set rollout.backend=vllm to use it, or drop the key",
        on_purpose=True,
    ),
    Unread(
        ("ref.",),
        ("actor.kl_ctl",),
        lambda c: c.cfg.actor.kl_ctl == 0,
        lambda c: "actor.kl_ctl=0 loads no reference model",
        "set actor.kl_ctl > 0 to use it, or drop the key",
        on_purpose=True,
    ),
    Unread(
        ("sft.",),
        (),
        lambda c: c.cmd == "run",
        lambda c: "read only by `areal-async sft`",
        "run `areal-async sft` for it, or drop the key",
        on_purpose=True,
    ),
    Unread(
        ("sft_warmup.batch_size", "sft_warmup.lr"),
        ("sft_warmup.steps",),
        lambda c: c.cmd == "run" and c.cfg.sft_warmup.steps == 0,
        lambda c: "sft_warmup.steps=0: no warm-up runs",
        "set sft_warmup.steps > 0 to use it, or drop the key",
    ),
    Unread(
        ("actor.lora.alpha", "actor.lora.target_modules", "actor.lora.dropout", "actor.lora.engine_merge"),
        ("actor.lora.rank",),
        lambda c: c.cfg.actor.lora.rank == 0,
        lambda c: "actor.lora.rank=0: LoRA is off (full fine-tuning)",
        "set actor.lora.rank > 0 to train an adapter, or drop the key",
    ),
    Unread(
        ("cluster.slurm.",),
        ("cluster.launcher",),
        lambda c: c.cfg.cluster.launcher != "slurm",
        lambda c: f"cluster.launcher={c.cluster.launcher!r} submits no Slurm job",
        "set cluster.launcher=slurm to use it, or drop the key",
    ),
    Unread(
        ("cluster.ray_address",),
        ("cluster.launcher",),
        lambda c: c.cfg.cluster.launcher != "ray",
        lambda c: f"cluster.launcher={c.cluster.launcher!r} connects to no Ray cluster",
        "set cluster.launcher=ray to use it, or drop the key",
    ),
    Unread(
        ("solo.recording",),
        ("mode",),
        lambda c: c.cfg.mode != "train_only",
        lambda c: f"mode={c.mode!r} trains no recording",
        "set mode=train_only to train it, or drop the key",
    ),
    Unread(
        ("solo.weights",),
        ("mode",),
        lambda c: c.cfg.mode != "rollout_only",
        lambda c: f"mode={c.mode!r}: the trainer makes the weights",
        "set mode=rollout_only to schedule the weights from that run's checkpoints, or drop the key",
    ),
    Unread(
        ("rollout.dump_tensors",),
        ("mode",),
        lambda c: c.cfg.mode == "train_only",
        lambda c: "mode='train_only' trains a recording and records nothing",
        "drop the key, or set mode=fleet",
    ),
    Unread(
        ("saver.freq_steps", "saver.freq_secs", "recover.mode"),
        ("mode",),
        lambda c: c.cfg.mode == "rollout_only",
        lambda c: "mode='rollout_only': nothing learns, nothing is saved or resumed",
        "drop the key, or set mode=fleet",
    ),
    Unread(
        ("stats_logger.wandb_mode",),
        ("stats_logger.wandb_project",),
        lambda c: c.cfg.stats_logger.wandb_project is None,
        lambda c: "stats_logger.wandb_project is unset: nothing is logged to wandb",
        "set stats_logger.wandb_project to use it, or drop the key",
    ),
)


def set_keys(data: Any, prefix: str = "") -> set[str]:
    """Dotted leaf keys of plain YAML data (a mapping's leaves; an empty mapping counts as a leaf)."""
    if not isinstance(data, dict) or not data:
        return {prefix[:-1]} if prefix else set()
    return {k for name, v in data.items() for k in set_keys(v, f"{prefix}{name}.")}


def _matches(key: str, entries: Iterable[str]) -> bool:
    return any(key.startswith(e) if e.endswith(".") else key == e for e in entries)


def _value(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part, None)
    return cfg


def check_unread(ctx: Context) -> list[Finding]:
    out = []
    for rule in UNREAD:
        if not rule.unread(ctx):
            continue
        by_cli = sorted(k for k in ctx.from_overrides if _matches(k, rule.keys))
        in_file = sorted(k for k in ctx.from_file - set(by_cli) if _matches(k, rule.keys))
        switched = any(_matches(k, rule.by) for k in ctx.from_overrides)
        if by_cli or (in_file and not rule.on_purpose and not switched):
            key = (by_cli or in_file)[0]
            out.append(error(key, _value(ctx.cfg, key), f"{rule.why(ctx.cfg)}: the key is not read", rule.todo))
        elif in_file:
            more = f" (nor {len(in_file) - 1} more such key(s))" if len(in_file) > 1 else ""
            what = f"{rule.why(ctx.cfg)}: the preset's key is not read{more}"
            out.append(warn(in_file[0], _value(ctx.cfg, in_file[0]), what, rule.todo))
    return out


# ---- the run directory, the placement, the machine ---------------------------------------------


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_run_dir(ctx: Context) -> list[Finding]:
    d, mode = ctx.run_dir, ctx.cfg.recover.mode
    if d.exists() and not d.is_dir():
        return [error("--run-dir", str(d), "is a file, not a directory", "give a new directory")]
    base = _existing_parent(d)
    if not os.access(base, os.W_OK | os.X_OK):
        return [error("--run-dir", str(d), f"{base} is not writable", "choose a directory you can write")]
    books = d / "metrics.jsonl"
    if mode == "disabled" and books.is_file() and books.stat().st_size > 0:
        return [
            error(
                "--run-dir",
                str(d),
                "already holds a run (metrics.jsonl)",
                "use a new --run-dir, or recover.mode=auto to continue it",
            )
        ]
    try:
        resume = checkpoint_to_resume(d / "checkpoints", mode)
    except ValueError as e:
        return [error("recover.mode", mode, str(e), "use recover.mode=auto or disabled, or the run's --run-dir", e)]
    return [ok("--run-dir", str(d), "writable" + (f"; resumes from {resume.name}" if resume else ""))]


def check_placement(ctx: Context) -> list[Finding]:
    cfg, cl = ctx.cfg, ctx.cfg.cluster
    try:
        ctx.placement = place(shape_of(cfg))
    except PlacementError as e:
        return [
            error(
                "cluster.n_gpus_per_node",
                cl.n_gpus_per_node,
                str(e),
                "lower cluster.n_trainer_ranks or the rollout backend's dN, or declare the cluster's GPUs",
                e,
            )
        ]
    if cl.device != "cuda":
        return [ok("cluster.device", cl.device, f"{len(ctx.placement)} processes on {cl.n_nodes} node(s), no GPU")]
    need = gpus_needed_on(ctx.placement, 0)
    if cl.launcher != "local":
        return [ok("cluster.device", "cuda", f"the placement uses {need} GPU(s) of node 0 (checked on the nodes)")]
    have = local_gpu_count() if ctx.gpus_here is None else ctx.gpus_here
    try:
        check_gpus_present(ctx.placement, 0, have)
    except PlacementError as e:
        return [Finding("error", "cluster.device", f"cluster.device='cuda': {e}")]
    return [ok("cluster.device", "cuda", f"the placement uses {need} of this machine's {have} GPU(s)")]


def check_cpus(ctx: Context) -> list[Finding]:
    out = []
    for role, spec in dataclasses.asdict(ctx.cfg.cluster.cpu_affinity).items():
        try:
            if spec:
                check_available(spec, f"cluster.cpu_affinity.{role}")
        except ValueError as e:
            out.append(Finding("error", f"cluster.cpu_affinity.{role}", f"{e}; pin to CPUs of that list, or ''"))
    return out


def check_servers(ctx: Context) -> list[Finding]:
    if not uses_servers(ctx.cfg):
        return []
    why = launch_blocker(ctx.cfg)
    if why:
        return [Finding("error", "rollout.backend", f"{why}; or use rollout.backend=torch (the embedded engine)")]
    return [ok("rollout.backend", ctx.cfg.rollout.backend, "its servers can start here (or are attached to)")] + (
        _server_context(ctx.cfg)
    )


def _server_context(cfg: ExperimentConfig) -> list[Finding]:
    """The servers' context: what the server derives from model.path's config must hold the longest request
    (train_dataset.max_prompt_len + gconfig.max_new_tokens); the supervisor starts them capped at it."""
    if not cfg.model.path or not (Path(cfg.model.path) / "config.json").is_file():
        return []  # the built tiny model (config.py checks its positions), or the model check says why
    vllm = server_role(cfg) == "vllm"
    derived, source = vllm_context(cfg.model.path) if vllm else sglang_context(cfg.model.path)
    d, new = cfg.train_dataset, cfg.gconfig.max_new_tokens
    if derived is None or d.max_prompt_len + new <= derived:
        return []
    what = (
        f"+ gconfig.max_new_tokens={new} = {d.max_prompt_len + new} tokens, more than the {derived} the "
        f"{'vLLM' if vllm else 'SGLang'} servers derive from model.path ({source}); they would refuse such requests"
    )
    return [error("train_dataset.max_prompt_len", d.max_prompt_len, what, "lower it or gconfig.max_new_tokens")]


# ---- disk --------------------------------------------------------------------------------------


def _sizes(ctx: Context) -> tuple[Optional[int], int]:
    """(policy parameters, adapter parameters), or (None, 0) when the shape cannot be read here."""
    if ctx.cfg.model.path and not (Path(ctx.cfg.model.path) / "config.json").is_file():
        return None, 0
    vocab = len(ctx.tokenizer) if ctx.tokenizer is not None else 100
    try:
        return param_count(ctx.cfg, vocab), lora_param_count(ctx.cfg, vocab)
    except (KeyError, ValueError, TypeError, OSError, yaml.YAMLError):
        return None, 0


def check_gpu_memory(ctx: Context) -> list[Finding]:
    """A server's GPU must hold what the processes beside it allocate there (``weight_path.server_gpu_overflow``);
    refused on a known GPU size (cluster.gpu_memory_gib or nvidia-smi), warned on the assumed one."""
    params, lora_params = _sizes(ctx)
    if ctx.cfg.cluster.device != "cuda" or not ctx.placement or params is None:
        return []
    gpu, source = gpu_memory(ctx.cfg)
    nbytes = version_bytes(ctx.cfg, params, lora_params)
    over = server_gpu_overflow(ctx.cfg, ctx.placement, nbytes, params, gpu)
    if over is None:
        return [ok("cluster.device", "cuda", f"every server GPU holds what is placed beside it ({source} size)")]
    key, value, what = over
    todo = "use tensor_channel.weights=shm and trajectories=shm (the rollout workers then allocate nothing on the GPU)"
    if source == "assumed":
        return [warn(key, value, f"{what} (GPU size assumed)", todo + ", or set cluster.gpu_memory_gib")]
    return [error(key, value, what, todo + ", or lower the server's memory fraction")]


def check_disk(ctx: Context) -> list[Finding]:
    """Checkpoints kept at once (keep_last + the one being written) x (weights + Adam state + fp32 master)."""
    cfg, s = ctx.cfg, ctx.cfg.saver
    periodic = s.freq_steps > 0 or s.freq_secs > 0 or (ctx.cmd == "sft" and cfg.sft.save_freq_steps > 0)
    n_ckpt = s.keep_last + 1 if periodic else (1 if s.final_grace_s > 0 else 0)
    if n_ckpt == 0 or (cfg.model.path and not (Path(cfg.model.path) / "config.json").is_file()):
        return []  # nothing saved, or no shape to size it by (the model check said why)
    try:
        params = param_count(cfg, len(ctx.tokenizer) if ctx.tokenizer is not None else 100)
    except (KeyError, ValueError, TypeError, OSError, yaml.YAMLError):
        return []  # a model whose config the model check could not read: that check said why
    per = params * (DTYPE_BYTES[cfg.model.dtype] + 8 + (4 if cfg.model.dtype != "float32" else 0))
    need, free = n_ckpt * per, shutil.disk_usage(_existing_parent(ctx.run_dir)).free
    what = f"{n_ckpt} checkpoint(s) of about {_size(per)} ({params / 1e6:.1f}M parameters) need {_size(need)}"
    if need > free:
        return [
            error(
                "saver.keep_last",
                s.keep_last,
                f"{what} but {_size(free)} is free there",
                "free disk space, lower saver.keep_last, or use a --run-dir on a larger disk",
            )
        ]
    if need > free / 2:
        return [warn("saver.keep_last", s.keep_last, f"{what} of the {_size(free)} free", "watch the disk")]
    return [ok("saver.keep_last", s.keep_last, f"{what}; {_size(free)} free")]


def check_shm_space(ctx: Context) -> list[Finding]:
    """``tensor_channel.weights=shm`` on this machine (the local launcher): /dev/shm must hold the versions the
    trainer keeps at once (a container's default /dev/shm is 64 MiB)."""
    params, lora_params = _sizes(ctx)
    shm = Path("/dev/shm")
    if ctx.cfg.tensor_channel.weights != "shm" or ctx.cfg.cluster.launcher != "local" or params is None:
        return []
    if not shm.is_dir():
        return []  # the channel itself says it needs /dev/shm
    need, free = SHM_VERSIONS * version_bytes(ctx.cfg, params, lora_params), shutil.disk_usage(shm).free
    what = f"{SHM_VERSIONS} versions held at once need {_size(need)} of /dev/shm"
    if need > free:
        todo = "enlarge /dev/shm (docker run --shm-size), or use tensor_channel.weights=zmq"
        return [error("tensor_channel.weights", "shm", f"{what} but {_size(free)} is free", todo)]
    return [ok("tensor_channel.weights", "shm", f"{what}; {_size(free)} free")]


# ---- running the checks ------------------------------------------------------------------------

RUN_CHECKS = (
    check_unread,
    check_run_dir,
    check_cpus,
    check_servers,
    check_placement,
    check_dataset,
    check_eval_data,
    check_model_files,
    check_plugins,
    check_model,
    check_lora,
    check_template,
    check_disk,
    check_gpu_memory,
    check_shm_space,
    check_solo,
    check_recording,
)
SFT_CHECKS = tuple(
    c
    for c in RUN_CHECKS
    if c
    not in (check_placement, check_cpus, check_servers, check_solo, check_recording, check_gpu_memory, check_shm_space)
)


def preflight(ctx: Context, stop_at_error: bool = True) -> list[Finding]:
    """Every check's findings in order; with ``stop_at_error`` none after the first error."""
    out: list[Finding] = []
    for check in RUN_CHECKS if ctx.cmd == "run" else SFT_CHECKS:
        out += check(ctx)
        if stop_at_error and any(f.level == "error" for f in out):
            break
    ctx.loads = role_loads(ctx.cfg) if ctx.cmd == "run" else sft_loads(ctx.cfg)
    return out


def context_for(cfg: ExperimentConfig, config_path: str, overrides: list[str], cmd: str, run_dir: Path) -> Context:
    """The context of a CLI call: which keys the YAML file and which the command line set."""
    try:
        data = yaml.safe_load(Path(config_path).read_text()) or {}
    except (OSError, yaml.YAMLError):
        data = {}
    by_cli = set()
    for text in overrides:
        parts, value = parse_override(text)
        by_cli |= set_keys(value, ".".join(parts) + ".") if isinstance(value, dict) else {".".join(parts)}
    return Context(cfg, cmd, Path(run_dir), frozenset(set_keys(data)), frozenset(by_cli))


def _model_and_data(cfg: ExperimentConfig) -> tuple[str, str]:
    m, d = cfg.model, cfg.train_dataset
    model = f"{m.path} ({m.dtype})" if m.path else f"a built tiny {m.arch} ({m.dtype})"
    return model, (d.path if d.type == "jsonl" else f"{d.type} x{d.size}")


def sft_loads(cfg: ExperimentConfig) -> dict[str, str]:
    """`areal-async sft` runs in one process."""
    model, data = _model_and_data(cfg)
    return {"sft": f"policy {model}; prompts {data}; template {cfg.train_dataset.template}; reward.fn {cfg.reward.fn}"}


def role_loads(cfg: ExperimentConfig) -> dict[str, str]:
    """Worker id -> what it will load."""
    m, d = cfg.model, cfg.train_dataset
    model, data = _model_and_data(cfg)
    out = {}
    for wid, module, _ in worker_specs(cfg):
        role = module.rsplit(".", 1)[-1]
        out[wid] = {
            "scheduler": f"tokenizer of {m.path or 'the character set'}; prompts {data}; template {d.template}",
            "reward": (f"reward.judge {cfg.reward.judge}" if cfg.reward.judge else f"reward.fn {cfg.reward.fn}")
            + f" in {cfg.reward.n_procs} process(es)"
            + (" (idle: the workflow scores)" if cfg.rollout.episodic else ""),
            "trainer": f"policy {model}"
            + (f"; reference {cfg.ref.path or 'the initial policy'}" if cfg.actor.kl_ctl else ""),
            "rollout": f"{cfg.rollout.backend} engine of {model}"
            + (f"; workflow {cfg.rollout.workflow}" if cfg.rollout.workflow else "")
            + (f"; agent {cfg.rollout.agent} on an OpenAI-compatible endpoint" if cfg.rollout.agent else ""),
        }[role]
    return out


def _cluster_words(ctx: Context) -> str:
    """The cluster as declared, and on GPU runs what the placement needs of each node vs this machine."""
    cl = ctx.cfg.cluster
    if cl.device != "cuda" or not ctx.placement:
        return f"cluster.device={cl.device}, launcher {cl.launcher}"
    need = ", ".join(f"node {n}: {gpus_needed_on(ctx.placement, n)}" for n in range(cl.n_nodes))
    here = local_gpu_count() if ctx.gpus_here is None else ctx.gpus_here
    return (
        f"cluster.device=cuda, {cl.n_nodes} node(s) x {cl.n_gpus_per_node} GPU(s), launcher {cl.launcher}; "
        f"GPUs needed per node: {need}; this machine has {here}"
    )


def _where(slot) -> str:
    if slot is None:
        return "-"
    return f"node {slot.node}" + (f" GPU {','.join(map(str, slot.physical))}" if slot.gpus else "")


def report(ctx: Context, findings: list[Finding], cmd: str) -> str:
    """The dry run's account, as YAML comment lines (the printed config above them stays valid YAML)."""
    n = {lv: sum(f.level == lv for f in findings) for lv in ("ok", "warn", "error")}
    lines = [f"# preflight of `areal-async {cmd}`: {n['ok']} ok, {n['warn']} warning(s), {n['error']} error(s)"]
    lines += [f"#   {f.level:5s} {f.line}" for f in findings]
    lines.append(f"# placement ({_cluster_words(ctx)}):")
    for wid, what in ctx.loads.items():
        lines.append(f"#   {wid:12s} {_where(ctx.placement.get(wid)):16s} loads {what}")
    if ctx.cfg.cluster.device == "cuda" and ctx.placement:
        lines += group_report(ctx.placement, shape_of(ctx.cfg))
    if cmd == "run":
        params, lora_params = _sizes(ctx)
        if params is None:
            lines.append("# weight path: model.path has no config.json here, so the sizes per hop are unknown")
        else:
            lines += account(ctx.cfg, ctx.placement, params, lora_params)
    return "\n".join(lines) + "\n"
