"""Presets and the config surface: every YAML in configs/ validates and dry-runs, boba_grpo holds
the seed's numbers, bad overrides are refused naming the key (exit code 2 from the CLI), and
`areal-async knobs` documents every key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml


from areal_async.config import ConfigError, describe, from_dict, load_config, rollout_dp_degree, to_dict
from areal_async.models.gguf_import import PREFIX, resolve_model_path

ROOT = Path(__file__).resolve().parents[3]
PRESETS = sorted((ROOT / "configs").glob("*.yaml"))
BOBA = ROOT / "configs/boba_grpo.yaml"
TINY = ROOT / "configs/tiny_arith.yaml"


def test_the_expected_presets_exist():
    names = {p.name for p in PRESETS}
    assert {"tiny_arith.yaml", "tiny_sft.yaml", "boba_sft.yaml", "boba_grpo.yaml", "gsm8k_grpo.yaml"} <= names
    assert {f"tiny_{r}.yaml" for r in ("grpo", "dapo", "drgrpo", "gspo", "rloo")} <= names  # issue 26's recipes


# presets whose model.path and data are placeholders for files of a GPU machine: their dry run here
# says what is missing (exit 2); the others run on this machine as they are
GPU_PRESETS = {"boba_grpo.yaml", "boba_sft.yaml", "gsm8k_grpo.yaml"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_preset_loads_and_dry_run_prints_the_same_config(path, cli):
    cfg = load_config(path)
    if cfg.model.path and cfg.model.path.startswith(PREFIX):  # the real-model presets: printed as imported
        cfg.model.path = resolve_model_path(cfg.model.path)[0]
    proc = cli("run", str(path), "--dry-run")
    assert proc.returncode == (2 if path.name in GPU_PRESETS else 0), proc.stderr
    for section, key in ((cfg.model, "path"), (cfg.ref, "path"), (cfg.reward, "judge")):  # gguf:SOURCE: imported
        setattr(section, key, resolve_model_path(getattr(section, key) or None)[0] or getattr(section, key))
    assert from_dict(yaml.safe_load(proc.stdout)) == cfg  # the printed config is the resolved one
    assert "# preflight of `areal-async run`" in proc.stdout and "\n# placement (" in proc.stdout
    if path.name in GPU_PRESETS:  # every missing input is named, the refusal is one line
        assert f"error model.path={cfg.model.path!r}: no such directory" in proc.stdout
        assert f"error train_dataset.path={cfg.train_dataset.path!r}: no such file" in proc.stdout
        assert proc.stderr.startswith("areal-async: ") and proc.stderr.count("\n") == 1, proc.stderr
    if path.name in GPU_PRESETS - {"boba_sft.yaml"}:
        assert "node 0 needs 8 GPUs for this placement" in proc.stdout


def test_boba_grpo_holds_the_seed_numbers():
    c = load_config(BOBA)
    a, o = c.actor, c.actor.optimizer
    assert c.model.path.endswith("DeepSeek-R1-Distill-Qwen-1.5B") and c.model.path.startswith("/")
    g = c.gconfig
    assert (g.n_samples, g.max_new_tokens, g.temperature, g.greedy) == (16, 8192, 1.0, False)
    assert a.mb_spec.max_tokens_per_mb == 16384 and c.ref.mb_spec.max_tokens_per_mb == 16384
    assert a.ppo_n_minibatches == 4
    assert (o.lr, o.eps, o.weight_decay, o.beta1, o.beta2) == (1e-5, 1e-8, 0.01, 0.9, 0.999)
    assert (o.lr_scheduler_type, o.gradient_clipping) == ("constant", 1.0)
    assert a.eps_clip == 0.4
    assert (a.rejection_sampling.metric, a.rejection_sampling.upper) == ("ratio", 5.0)
    assert (a.reward_scaling, a.reward_bias) == (10.0, -0.5)
    assert (a.reward_norm.mean_level, a.reward_norm.std_level) == ("group", "group")
    assert (a.adv_norm.mean_level, a.adv_norm.std_level) == ("batch", "batch")
    assert a.kl_ctl == 0.0 and (a.discount, a.gae_lambda) == (1.0, 1.0)
    assert a.use_decoupled_loss is True and a.recompute_logprob is True
    assert c.rollout.backend == "sglang:d4" and rollout_dp_degree(c.rollout.backend) == 4
    assert c.rollout.max_concurrent_rollouts == 64
    d = c.train_dataset
    assert (d.type, d.batch_size, d.max_prompt_len) == ("jsonl", 512, 1024) and d.path.endswith(".jsonl")
    assert (c.sglang.context_length, c.sglang.mem_fraction_static) == (32768, 0.9)
    assert (c.vllm.max_model_len, c.vllm.gpu_memory_utilization) == (32768, 0.9)
    assert (c.cluster.n_nodes, c.cluster.n_gpus_per_node, c.cluster.device) == (1, 8, "cuda")
    assert c.seed == 1 and c.saver.freq_steps > 0 and c.recover.mode == "auto"
    assert (c.reward.timeout_s, c.reward.precision) == (5.0, 6)


def test_boba_sft_mirrors_the_seed_sft_path():
    c = load_config(ROOT / "configs/boba_sft.yaml")
    assert c.model.path.endswith("Qwen-32B") and c.model.path.startswith("/")
    assert c.train_dataset.type == "jsonl" and c.train_dataset.path.endswith(".jsonl")
    e = c.evaluator  # seed: SFT models at temperature 0.6, top_p 0.95, 32 samples
    assert (e.greedy, e.n_samples, e.temperature, e.top_p) == (False, 32, 0.6, 0.95)
    assert c.sft.steps == 0 and c.sft.epochs > 0  # steps follow the 200 samples


# ---- refusals ------------------------------------------------------------------------------

BAD = [
    ("rollout.max_head_offpolicy=1", "rollout.max_head_offpolicy", "unknown"),  # unknown key
    ("bogus_section.x=1", "bogus_section", "unknown"),
    ("gconfig.n_samples=many", "gconfig.n_samples", "integer"),  # wrong type
    ("gconfig.greedy=3", "gconfig.greedy", "true or false"),
    ("actor.optimizer.lr=[1]", "actor.optimizer.lr", "number"),
    ("sglang.mem_fraction_static=1.5", "sglang.mem_fraction_static", "(0, 1]"),  # out of range
    ("rollout.engine_linears=mkl", "rollout.engine_linears", "auto | blas | onednn | packed"),  # not one of the kernels
    ("actor.linears=packed", "actor.linears", "auto | blas | onednn"),  # the trainer keeps no packed copies
    ("actor.eps_clip=0", "actor.eps_clip", "> 0"),
    ("sft.batch_size=0", "sft.batch_size", ">= 1"),
    ("rollout.backend=sglang:d0", "rollout.backend", "sglang:dN"),
    ("gconfig.max_new_tokens=32000", "sglang.context_length", "max_prompt_len + gconfig.max_new_tokens"),  # cross-field
    ("cluster.n_gpus_per_node=2", "rollout.backend", "n_gpus_per_node"),
    ("actor.ppo_n_minibatches=100000", "actor.ppo_n_minibatches", "samples per step"),
    ("evaluator.greedy=true", "evaluator.n_samples", "greedy"),  # boba_grpo evaluates 32 samples
    ("cluster.max_restarts=-1", "cluster.max_restarts", ">= 0"),
    ("reward.memory_limit_mb=100", "reward.memory_limit_mb", ">= 256"),
    ("cluster.cpu_affinity.trainer=0-x", "cluster.cpu_affinity.trainer", "a cpu list"),
    ("cluster.cpu_affinity.reward=[0]", "cluster.cpu_affinity.reward", "a cpu list"),
]


@pytest.mark.parametrize("override,key,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_override_is_refused_naming_the_key(override, key, expected):
    with pytest.raises(ConfigError) as e:
        load_config(BOBA, [override])
    assert key in str(e.value) and expected in str(e.value)


def test_sglang_backend_on_cpu_runs_the_cpu_servers_one_per_worker_or_a_multiple():
    from areal_async.config import n_servers

    assert n_servers(load_config(TINY, ["rollout.backend=sglang"])) == 2  # one per rollout worker
    assert n_servers(load_config(TINY, ["rollout.backend=sglang:d4"])) == 4
    with pytest.raises(ConfigError, match=r"rollout\.backend='sglang:d3'.*multiple of cluster\.n_rollout_workers=2"):
        load_config(TINY, ["rollout.backend=sglang:d3"])
    with pytest.raises(ConfigError, match=r"sglang\.addresses='localhost:30000'.*http://host:port"):
        load_config(TINY, ["rollout.backend=sglang", "sglang.addresses=[localhost:30000, localhost:30001]"])
    with pytest.raises(ConfigError, match=r"sglang\.pause_mode='later'"):
        load_config(TINY, ["sglang.pause_mode=later"])


def test_vllm_backend_servers_addresses_and_context_length():
    from areal_async.config import n_servers, server_addresses

    c = load_config(TINY, ["rollout.backend=vllm"])
    assert n_servers(c) == 2 and server_addresses(c) == []  # one per rollout worker, started by the supervisor
    assert n_servers(load_config(TINY, ["rollout.backend=vllm:d4"])) == 4
    c = load_config(
        TINY,
        [
            "rollout.backend=vllm",
            "vllm.addresses=[http://h:1, http://h:2, http://h:3, http://h:4]",
            "sglang.addresses=[http://s:1, http://s:2]",
        ],
    )
    assert n_servers(c) == 4 and server_addresses(c)[0] == "http://h:1"  # vllm's, not sglang's
    with pytest.raises(ConfigError, match=r"rollout\.backend='vllm:d3'.*multiple of cluster\.n_rollout_workers=2"):
        load_config(TINY, ["rollout.backend=vllm:d3"])
    need = c.train_dataset.max_prompt_len + c.gconfig.max_new_tokens
    with pytest.raises(ConfigError, match=rf"vllm\.max_model_len=8: expected >= .* = {need}"):
        load_config(TINY, ["rollout.backend=vllm", "vllm.max_model_len=8"])


@pytest.mark.parametrize(
    "override,key",
    [
        ("rollout.max_head_offpolicy=1", "rollout.max_head_offpolicy"),
        ("sft.optimizer.lr=-1", "sft.optimizer.lr"),
        ("evaluator.greedy=true", "evaluator.n_samples"),
    ],
)
def test_cli_refuses_bad_overrides_with_exit_code_2(override, key, cli):
    proc = cli("run", str(BOBA), "--dry-run", override)
    assert proc.returncode == 2
    assert "config error" in proc.stderr and key in proc.stderr
    assert proc.stdout == ""  # nothing resolved, nothing started


def test_cli_refuses_a_missing_config_file(cli):
    proc = cli("sft", "configs/does_not_exist.yaml")
    assert proc.returncode == 2 and "does_not_exist.yaml" in proc.stderr


def test_good_overrides_apply_and_keep_the_rest():
    c = load_config(BOBA, ["actor.optimizer.lr=2e-5", "actor.optimizer.eps=1e-5", "rollout.backend=sglang:d8"])
    assert (c.actor.optimizer.lr, c.actor.optimizer.eps, rollout_dp_degree(c.rollout.backend)) == (2e-5, 1e-5, 8)
    assert c.actor.optimizer.weight_decay == 0.01  # untouched sibling keeps the preset's value


def test_rollout_dp_degree():
    assert [rollout_dp_degree(b) for b in ("torch", "sglang", "sglang:d4", "sglang:d16")] == [1, 1, 4, 16]


# ---- knobs ---------------------------------------------------------------------------------


def _leaf_keys(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        out |= _leaf_keys(v, prefix + k + ".") if isinstance(v, dict) else {prefix + k}
    return out


def test_knobs_lists_every_key_with_help(cli):
    proc = cli("knobs")
    assert proc.returncode == 0, proc.stderr
    listed = dict(
        line.split(None, 1) if len(line.split(None, 1)) == 2 else (line.strip(), "")
        for line in proc.stdout.splitlines()
        if line.strip()
    )
    keys = _leaf_keys(to_dict(load_config(BOBA)))
    assert set(listed) == keys == {k for k, _ in describe()}
    empty = sorted(k for k, text in listed.items() if not text.strip())
    assert not empty, f"keys without help: {empty}"
    for key in (
        "ref.path",
        "sglang.context_length",
        "sglang.mem_fraction_static",
        "vllm.max_model_len",
        "cluster.n_nodes",
        "cluster.n_gpus_per_node",
        "evaluator.n_samples",
        "sft.steps",
        "sft.optimizer.lr",
        "sft.holdout",
    ):
        assert key in listed
