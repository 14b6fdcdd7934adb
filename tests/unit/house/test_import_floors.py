"""One direction of imports: the floors of the house, checked over the source with ``ast``.

A module may import its own room (package) and any room on a lower floor; never a room on its
own floor or above. A project import inside a function (the old way to dodge a cycle) is refused
unless ``LAZY`` lists it with the reason it must stay lazy. Third-party imports are not checked by
the ``ast`` walk; what the light entry points actually LOAD is checked in a fresh interpreter
(``NEVER_LOADS``): a re-export in a package's ``__init__`` can pull torch in through a module that
itself imports nothing heavy, which no reading of the importing file shows.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("protocols", "areal_async", "workers", "benchmarks")

# floor -> rooms (module prefixes). Lowest first; a room is a package or a single module.
FLOORS: dict[int, tuple[str, ...]] = {
    0: ("protocols",),  # wire messages, tensor frames, socket patterns
    1: ("areal_async.base",),  # control client, endpoints, cpu lists, worker process settings, plug-ins
    2: ("areal_async.config",),  # the dataclass configs, loading, overrides
    3: (
        "areal_async.data",
        "areal_async.models",
        "areal_async.transport",
        "areal_async.workflows",  # shared by roles
        "areal_async.supervisor.placement",
    ),  # pure devices-from-config: the supervisor's and each worker's view
    4: ("areal_async.scheduler", "areal_async.rollout", "areal_async.reward", "areal_async.trainer"),  # roles
    5: ("areal_async.supervisor", "areal_async.app", "areal_async.client"),  # launchers; process wiring; BYO workers
    6: ("areal_async.cli", "areal_async.api", "workers"),  # the command line, the Python API; process entry points
    7: ("benchmarks",),
}

# room -> its subrooms' floors, lowest first: the same rule inside the room (a subroom imports its own subroom and
# lower ones). The room's own modules (its top level) stand above all its subrooms; a subroom never imports them.
# Between rooms only FLOORS counts: rollout.engines is still a role's, and never imports trainer or scheduler.
SUBFLOORS: dict[str, dict[int, tuple[str, ...]]] = {
    "areal_async.rollout": {
        0: ("areal_async.rollout.engines",),  # the RolloutEngine seam, the embedded TorchEngine
        1: ("areal_async.rollout.clients",),  # RemoteEngine, the server clients, the SGLang contract as data
        2: ("areal_async.rollout.servers",),  # the CPU SGLang twin (over TorchEngine), the vLLM launcher
    },
    "areal_async.trainer": {
        0: ("areal_async.trainer.algo",),  # advantages, losses, off-policy corrections, the mismatch block
        1: (
            "areal_async.trainer.compute",  # packing, the packed forward and logprobs, micro-batches, optimizer, ranks
            "areal_async.trainer.persist",  # checkpoints, the final model, the trainer's record and recording
        ),
    },
    "areal_async.app": {
        0: ("areal_async.app.workers",),  # worker processes built from the run directory, and what they share
        1: ("areal_async.app.commands",),  # the one-shot commands (doctor, verify, replay, sft, data ...)
    },
}

# Package roots that re-export from upstairs (their __init__ imports lazily, on attribute access).
FACADES: dict[str, int] = {"areal_async": 7}  # ``areal_async.Fleet`` / ``load_config``: the Python API

# (importer, imported) -> why the import must stay inside a function.
LAZY: dict[tuple[str, str], str] = {
    (
        "areal_async.cli",
        "areal_async.app.commands.sft",
    ): "torch: `areal-async run/knobs/--help/--dry-run` and the supervisor process never import it",
    ("areal_async.cli", "areal_async.supervisor.preflight"): "tokenizers/transformers: `knobs`, `--help` and the "
    "other commands never need them",
    ("areal_async.supervisor.preflight_inputs", "areal_async.models.policy_tokenizer"): "transformers (~2.5 s): a run "
    "refused by an earlier, cheaper check never loads it",
    ("areal_async.supervisor.preflight_inputs", "areal_async.models.tokenizer"): "transformers (~2.5 s): a run "
    "refused by an earlier, cheaper check never loads it",
    ("areal_async.cli", "areal_async.app.workers.evaluate"): "torch: `run`, `knobs` and `--help` never import it",
    ("areal_async.cli", "areal_async.models.lora"): "torch: `run`, `knobs` and `--help` never import it",
    ("areal_async.supervisor.preflight_inputs", "areal_async.models"): "torch (models.lora): only a LoRA run's "
    "preflight builds the policy's module tree",
    ("areal_async.supervisor.preflight_inputs", "areal_async.models.tiny"): "torch: only a LoRA run's preflight "
    "builds the policy's module tree",
    ("areal_async.cli", "areal_async.app.commands.status"): "the run's keys: `run`, `knobs`, `--help` never need them",
    ("areal_async.cli", "areal_async.app.commands.data_filter"): "torch: `run`, `knobs` and `--help` never import it",
    ("areal_async.cli", "areal_async.app.commands.replay"): "torch: `run`, `knobs` and `--help` never import it",
    (
        "areal_async.cli",
        "areal_async.app.commands.train_only",
    ): "torch: only mode=train_only trains in the CLI's process",
    ("areal_async.cli", "areal_async.app.commands.plot"): "matplotlib: `run`, `knobs` and `--help` never need it",
    (
        "areal_async.cli",
        "areal_async.app.commands.data_prepare",
    ): "math-verify: `run`, `knobs` and `--help` never need it",
    ("areal_async.cli", "areal_async.app.commands.check_plugin"): "its reward pool and workflow checks load only for "
    "check-plugin",
    **{
        ("areal_async.cli", m): "`run` starts its fork server once the config is read: what it imports before that "
        "delays the run's first token (test_the_cli_imports_only_what_comes_before_the_fork_server)"
        for m in (
            "areal_async.app.commands.doctor",
            "areal_async.app.commands.verify",
            "areal_async.supervisor.fleet",
            "areal_async.supervisor.plan",
            "areal_async.supervisor.ray_launcher",
            "areal_async.supervisor.slurm",
        )
    },
    ("areal_async", "areal_async.api"): "the package root re-exports Fleet on first use: a submodule import "
    "(a reward child) must not load the API",
    ("areal_async", "areal_async.config"): "the package root re-exports load_config on first use (as above)",
    **{
        pair: "pyzmq: the GPU code imports without it (scripts/gpu_check.sh's bare box); only a group built "
        "through the run's store, or a tensor channel's note pipe, needs it"
        for pair in (
            ("areal_async.trainer.compute.dp", "areal_async.transport.store"),
            ("areal_async.transport.collective", "areal_async.transport.store"),
            ("areal_async.transport.collective", "protocols.sockets"),
            ("areal_async.transport.nccl", "areal_async.transport.store"),
            ("areal_async.transport.notify", "protocols.sockets"),
        )
    },
    **{
        (
            f"workers.{r}",
            f"areal_async.app.workers.{r}_worker",
        ): "the process pins itself to --cpus before torch/zmq load"
        for r in ("scheduler", "reward", "rollout", "trainer")
    },
}


# light entry point -> heavy third-party packages it must never load. The supervisor process and the
# command line (``--help``, ``knobs``, ``--dry-run``) stay fast; the scheduler needs the tokenizer
# (transformers) for the prompts but never torch; the reward side never loads a model library.
_SUPERVISOR_NEVER = ("torch", "transformers", "numpy", "matplotlib", "ray")
NEVER_LOADS: dict[str, tuple[str, ...]] = {
    "areal_async.cli": _SUPERVISOR_NEVER,
    "areal_async.supervisor.fleet": _SUPERVISOR_NEVER,
    "areal_async.supervisor.slurm": _SUPERVISOR_NEVER,
    "areal_async.supervisor.ray_launcher": _SUPERVISOR_NEVER,
    "areal_async.config": _SUPERVISOR_NEVER,
    "workers.scheduler": ("torch",),
    "areal_async.app.workers.scheduler_worker": ("torch",),
    "areal_async.app.workers.reward_worker": ("torch", "transformers"),
    "areal_async.client.reward": ("torch", "transformers"),
}


def loaded_by(code: str, packages) -> list[str]:
    """Which of ``packages`` a fresh interpreter has in ``sys.modules`` after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(p for p in {list(packages)!r} if p in sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def room_of(module: str) -> tuple[int, str]:
    """(floor, room) of a project module; the longest matching room wins."""
    best = None
    for floor, rooms in FLOORS.items():
        for room in rooms:
            if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best[1])):
                best = (floor, room)
    if best is None and module in FACADES:
        return FACADES[module], module
    if best is None and module in PACKAGES:
        return 0, module  # a package root (its __init__ is empty)
    if best is None:
        raise LookupError(f"module {module!r} is on no floor: add its room to FLOORS in {__file__}")
    return best


def subroom_of(module: str, room: str) -> tuple[int, str]:
    """(floor, subroom) of a module inside ``room``: its subroom's floor, or above them all for the room's own."""
    floors = SUBFLOORS.get(room, {})
    for floor, subs in floors.items():
        for sub in subs:
            if module == sub or module.startswith(sub + "."):
                return floor, sub
    return len(floors), room


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not node.level:
        return [node.module or ""]
    base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
    return [".".join(base + ([node.module] if node.module else []))]


def project_imports(path: Path, root: Path = ROOT):
    """(importer, imported, line, inside a function) for every import of a project module in ``path``."""
    module, tree = module_name(path, root), ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for name in imported_names(child, module, path.name == "__init__.py"):
                    if name.split(".")[0] in PACKAGES:
                        found.append((module, name, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def all_imports(root: Path = ROOT):
    paths = [path for pkg in PACKAGES for path in sorted((root / pkg).rglob("*.py"))]
    return [imp for path in paths for imp in project_imports(path, root)]


def floor_violations(imports) -> list[str]:
    bad = []
    for importer, imported, line, _ in imports:
        (f_from, r_from), (f_to, r_to) = room_of(importer), room_of(imported)
        what = "floor"
        if r_from == r_to:  # inside one room: its subrooms' floors
            what, (f_from, r_from), (f_to, r_to) = (
                f"{r_from} floor",
                subroom_of(importer, r_from),
                subroom_of(imported, r_to),
            )
        if r_from != r_to and f_to >= f_from:
            side = "above it" if f_to > f_from else "beside it"
            bad.append(
                f"{importer}:{line} imports {imported} ({what} {f_to}, {side}: {importer} is on {what} {f_from})"
            )
    return bad


def lazy_violations(imports) -> list[str]:
    """Unlisted project imports inside functions, and LAZY entries no longer needed."""
    lazy = {(i, m): line for i, m, line, inside in imports if inside}
    bad = [f"{i}:{line} imports {m} inside a function" for (i, m), line in lazy.items() if (i, m) not in LAZY]
    return bad + [
        f"LAZY lists {i} -> {m}, which is no longer imported inside a function" for i, m in LAZY if (i, m) not in lazy
    ]


def test_every_module_is_on_a_floor():
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            room_of(module_name(path))


def test_every_subroom_is_on_a_floor_of_its_room():
    """Each package directly under a room with SUBFLOORS is listed there, and each listed subroom exists."""
    for room, floors in SUBFLOORS.items():
        here = ROOT.joinpath(*room.split("."))
        found = {f"{room}.{p.name}" for p in here.iterdir() if (p / "__init__.py").is_file()}
        assert found == {s for subs in floors.values() for s in subs}, room


def test_no_module_imports_its_own_floor_or_above():
    bad = floor_violations(all_imports())
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def test_project_imports_inside_functions_are_only_the_listed_lazy_ones():
    bad = lazy_violations(all_imports())
    assert not bad, (
        "move these imports to the top of the module, or list them in LAZY with the reason "
        "they must stay lazy:\n" + "\n".join(bad)
    )


def test_import_areal_async_cli_leaves_torch_out():
    """The issue's own probe, verbatim: the command line's import never loads torch."""
    code = "import sys, areal_async.cli; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "False\n"), done.stderr


@pytest.mark.parametrize("module", sorted(NEVER_LOADS))
def test_light_entry_points_never_load_heavy_packages(module):
    assert loaded_by(f"import {module}", NEVER_LOADS[module]) == []


# what runs on a GPU (the trainer, the NCCL/CUDA IPC channels, the embedded engine): scripts/gpu_check.sh runs it on
# a bare box without pyzmq and msgpack, which only the control plane, the stores and the note pipes need
GPU_CODE = (
    "areal_async.trainer.actor",
    "areal_async.trainer.persist.sharded_ckpt",
    "areal_async.transport.nccl",
    "areal_async.transport.cuda_ipc",
    "areal_async.rollout.engines.torch_engine",
    "areal_async.rollout.clients.weight_group",
)


def test_the_gpu_code_loads_neither_pyzmq_nor_msgpack():
    assert loaded_by("\n".join(f"import {m}" for m in GPU_CODE), ("zmq", "msgpack")) == []


@pytest.mark.parametrize(
    "argv", [["--help"], ["knobs"], ["run", "configs/tiny_arith.yaml", "--dry-run", "--run-dir", "RUN"]]
)
def test_cli_commands_that_start_nothing_never_load_torch(argv, tmp_path):
    argv = [str(tmp_path / "run") if a == "RUN" else a for a in argv]
    code = f"from areal_async.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    assert loaded_by(code, ("torch",)) == []


def test_the_cli_imports_only_what_comes_before_the_fork_server():
    """``areal-async run`` starts its fork server (the long pole of a run's start) once the config is read: the
    supervisor's fleet, the Slurm and Ray launchers, verify and doctor are imported by the commands using them."""
    later = ("areal_async.supervisor.fleet", "areal_async.supervisor.slurm", "areal_async.supervisor.ray_launcher")
    later += ("areal_async.app.commands.verify", "areal_async.app.commands.doctor")
    assert loaded_by("import areal_async.cli", later) == []
    assert loaded_by("import areal_async.cli\nimport areal_async.supervisor.fleet", later) == [later[0]]


def test_the_load_probe_sees_what_is_loaded():
    """The probe itself can fail: a loaded package is reported (else the tests above prove nothing)."""
    assert loaded_by("import areal_async.config", ("yaml", "torch")) == ["yaml"]


def test_the_checker_catches_what_it_should(tmp_path):
    """A small tree with known faults: each is reported, the allowed imports are not."""
    files = {
        "areal_async/trainer/actor.py": "from areal_async.app.commands.sft import x\nfrom ..config import C\n"
        "from . import loss\nimport torch, protocols.messages\n",
        "areal_async/trainer/algo/loss.py": "def f():\n    from areal_async.reward import pool\n",
        "areal_async/app/commands/sft.py": "from areal_async.trainer import actor\n",
    }
    for rel, src in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    imports = all_imports(tmp_path)
    assert [(i, m, inside) for i, m, _, inside in imports] == [
        ("areal_async.app.commands.sft", "areal_async.trainer", False),
        ("areal_async.trainer.actor", "areal_async.app.commands.sft", False),
        ("areal_async.trainer.actor", "areal_async.config", False),
        ("areal_async.trainer.actor", "areal_async.trainer", False),
        ("areal_async.trainer.actor", "protocols.messages", False),
        ("areal_async.trainer.algo.loss", "areal_async.reward", True),
    ]
    assert floor_violations(imports) == [
        (
            "areal_async.trainer.actor:1 imports areal_async.app.commands.sft "
            "(floor 5, above it: areal_async.trainer.actor is on floor 4)"
        ),
        (
            "areal_async.trainer.algo.loss:2 imports areal_async.reward "
            "(floor 4, beside it: areal_async.trainer.algo.loss is on floor 4)"
        ),
    ]
    assert lazy_violations(imports)[0] == "areal_async.trainer.algo.loss:2 imports areal_async.reward inside a function"


def test_the_checker_keeps_the_floors_of_subrooms(tmp_path):
    """Inside a room, its subrooms' floors; between rooms, the rooms' floors (a subroom gains nothing outside)."""
    files = {
        "areal_async/rollout/engines/torch_engine.py": "from areal_async.rollout.clients import remote\n"
        "from areal_async.rollout.engines.engine import E\nfrom areal_async.trainer import loss\n",
        "areal_async/rollout/clients/remote.py": "from areal_async.rollout.service import S\n"
        "from areal_async.rollout.engines import engine\n",
        "areal_async/rollout/servers/twin.py": "from areal_async.rollout.clients import remote\n",
        "areal_async/rollout/service.py": "from areal_async.rollout.servers import twin\n",
    }
    for rel, src in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(src)
    r = "areal_async.rollout"
    assert floor_violations(all_imports(tmp_path)) == [
        f"{r}.clients.remote:1 imports {r}.service ({r} floor 3, above it: {r}.clients.remote is on {r} floor 1)",
        (
            f"{r}.engines.torch_engine:1 imports {r}.clients ({r} floor 1, above it: "
            f"{r}.engines.torch_engine is on {r} floor 0)"
        ),
        (
            f"{r}.engines.torch_engine:3 imports areal_async.trainer (floor 4, beside it: "
            f"{r}.engines.torch_engine is on floor 4)"
        ),
    ]
