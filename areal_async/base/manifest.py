"""The run manifest: what every process of a fleet reads to find its peers and its place in the run.

The supervisor writes it once per fleet (``supervisor/rundir.py``: after ``config.yaml`` and the
keys, before any process starts; a recovery writes the next fleet's) as ``RUN_DIR/endpoints.json``,
one flat JSON object whose keys are the fields below; ``RunManifest.load`` is the one reader: the
workers (``app/wiring.load_run``), bring-your-own workers (``client.load_run``), ``areal-async
status``. It refuses a file that is not an object, lacks ``control`` / ``trajectories``, has a key
it does not know (a manifest of another version) or a value of the wrong type, naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

MANIFEST_FILE = "endpoints.json"
# the rendezvous stores of the trajectory group, the weight group and the trainer ranks, each served by the
# trainer (rank 0) over the run's sockets (transport/store.py): ipc:// in the private socket directory, or
# tcp:// on the trainer's node address with CURVE; never a torch TCPStore (no authentication, listens on *)
STORES = ("traj_store", "weight_store", "trainer_store")


class ManifestError(ValueError):
    """RUN_DIR/endpoints.json is not a manifest this version wrote; the message names the key."""


@dataclass(frozen=True)
class RunManifest:
    control: str  # the scheduler's ROUTER
    trajectories: str  # the trainer's PULL (trajectory tensors)
    rewards: list[str] = field(default_factory=list)  # reward worker PULLs (built-in first, then bring-your-own)
    sock_dir: str = ""  # the private directory of the ipc:// sockets ("" with tcp)
    run_id: Optional[str] = None  # names the run's shared-memory segments (areal_<run_id>_*)
    weights_endpoint: str = ""  # the zmq weight channel's publisher (trainer rank 0)
    traj_store: str = ""  # rendezvous of the trajectory group (gloo/nccl), served by trainer rank 0
    weight_store: str = ""  # rendezvous of the weight group (gloo/nccl)
    trainer_store: str = ""  # rendezvous of the trainer ranks (FSDP2)
    servers: list[str] = field(default_factory=list)  # base URLs of the inference servers (sglang/vllm backends)
    resume_from: Optional[str] = None  # the checkpoint this fleet resumes from, None for a fresh start
    recoveries: int = 0  # in-run recoveries before this fleet (the scheduler's books count them)

    def save(self, run_dir: str | Path) -> None:
        """Write ``RUN_DIR/endpoints.json`` atomically (a reader never sees half a manifest)."""
        tmp = Path(run_dir) / (MANIFEST_FILE + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2))
        os.replace(tmp, Path(run_dir) / MANIFEST_FILE)

    @classmethod
    def load(cls, run_dir: str | Path) -> "RunManifest":
        path = Path(run_dir) / MANIFEST_FILE
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path}: not JSON ({e})") from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data: object, where: str = MANIFEST_FILE) -> "RunManifest":
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls)}
        if unknown := sorted(set(data) - set(known)):
            raise ManifestError(f"{where}: unknown key(s) {', '.join(unknown)}; expected some of {', '.join(known)}")
        if missing := [k for k in ("control", "trajectories") if k not in data]:
            raise ManifestError(f"{where}: missing {', '.join(missing)}")
        for key, value in data.items():
            _check(key, value, known[key].type, where)
        return cls(**data)

    def store(self, name: str) -> str:
        """The address of rendezvous store ``name`` (one of STORES)."""
        if name not in STORES:
            raise ValueError(f"store {name!r}: expected one of {', '.join(STORES)}")
        return getattr(self, name)


_TYPES = {"str": (str,), "int": (int,), "Optional[str]": (str, type(None)), "list[str]": (list,)}


def _check(key: str, value: object, annotation: str, where: str) -> None:
    ok = isinstance(value, _TYPES[annotation]) and not isinstance(value, bool)
    if ok and annotation == "list[str]":
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        raise ManifestError(f"{where}: {key}={value!r}: expected {annotation}")
