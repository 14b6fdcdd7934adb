"""A run's credentials: CURVE keys for its TCP sockets and one launch token per worker it launches.

The supervisor calls ``write_run_keys(run_dir, roster)`` before starting anyone. It writes
``RUN_DIR/keys/`` (mode 0700; every file 0600):

- ``server.key``: the server key pair (every socket that binds a ``tcp://`` endpoint);
- ``client.key``: the client key pair of the run's workers (the only key the ZAP handlers admit,
  besides those listed in ``clients.json``, e.g. an external worker's);
- ``roster.json``: ``worker id -> {role, token_sha256}``: what the supervisor launched;
- ``server_api.key``: the inference servers' key, when the supervisor starts servers
  (``rollout/clients/server_auth.py``).

Each launched process gets its token in its environment (``AREAL_LAUNCH_TOKEN``, the same for a
restart of the same worker), never in a file; it sends the token in its ``Register``, and the
scheduler refuses a registration whose id is not on the roster, whose role differs from the
roster's, or whose token does not hash to the roster's (``Roster.check``). A fresh fleet (a new
run, an in-run recovery) gets fresh keys and tokens, so a stale worker of an earlier one is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path
from typing import Optional

from protocols.curve import CurveKeys, new_key_pair, use_curve

KEYS_DIR = "keys"
TOKEN_ENV = "AREAL_LAUNCH_TOKEN"
SERVER_KEY_FILE = "server_api.key"


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` with mode 0600 (created so; an existing file is re-moded first)."""
    if path.exists():
        os.chmod(path, 0o600)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def write_run_keys(run_dir: str | Path, roster: dict[str, str]) -> dict[str, str]:
    """Fresh keys and tokens for the workers in ``roster`` (worker id -> role); returns id -> token."""
    d = Path(run_dir) / KEYS_DIR
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in ("server", "client"):
        public, secret = new_key_pair()
        _write_private(d / f"{name}.key", json.dumps({"public": public.decode(), "secret": secret.decode()}))
    tokens = {wid: secrets.token_hex(16) for wid in roster}
    entries = {wid: {"role": role, "token_sha256": _sha256(tokens[wid])} for wid, role in roster.items()}
    _write_private(d / "roster.json", json.dumps(entries, indent=2))
    return tokens


def add_external_worker(run_dir: str | Path, worker_id: str, role: str) -> str:
    """Put a worker the supervisor does not launch (a bring-your-own worker) on the roster; returns its
    token (it registers with it). An id the supervisor launched, or an external one of another role,
    is refused; an external id may join again (a new token replaces the old)."""
    path = Path(run_dir) / KEYS_DIR / "roster.json"
    entries = json.loads(path.read_text())
    old = entries.get(worker_id)
    if old is not None and not old.get("external"):
        raise ValueError(
            f"worker id {worker_id!r} belongs to a {old['role']} worker the supervisor launched in "
            f"{run_dir}; choose another id"
        )
    if old is not None and old["role"] != role:
        raise ValueError(f"worker id {worker_id!r} joined {run_dir} as a {old['role']} worker, not {role}")
    token = secrets.token_hex(16)
    entries[worker_id] = {"role": role, "token_sha256": _sha256(token), "external": True}
    _write_private(path, json.dumps(entries, indent=2))
    return token


def load_curve_keys(run_dir: str | Path) -> CurveKeys:
    """This run's keys as one of its processes uses them (server pair and the run's client pair)."""
    d = Path(run_dir) / KEYS_DIR
    try:
        server = json.loads((d / "server.key").read_text())
        client = json.loads((d / "client.key").read_text())
    except (OSError, ValueError, KeyError) as e:
        raise RuntimeError(f"{d}: the run's keys are missing or unreadable ({e}); the supervisor writes them") from e
    return CurveKeys(
        server_public=server["public"].encode(),
        server_secret=server["secret"].encode(),
        client_public=client["public"].encode(),
        client_secret=client["secret"].encode(),
        allow={client["public"].encode(): "run"},
    )


def install_run_keys(run_dir: str | Path) -> None:
    """Make every ``tcp://`` socket of this process use the run's CURVE keys."""
    use_curve(load_curve_keys(run_dir))


def write_server_key(run_dir: str | Path, key: str) -> None:
    """``RUN_DIR/keys/server_api.key`` (0600): the inference servers' key, for what runs beside the fleet
    (a bring-your-own rollout worker, a test watching the servers); the fleet gets it in its environment."""
    _write_private(Path(run_dir) / KEYS_DIR / SERVER_KEY_FILE, key)


def load_server_key(run_dir: str | Path) -> str:
    path = Path(run_dir) / KEYS_DIR / SERVER_KEY_FILE
    return path.read_text() if path.exists() else ""


def launch_token() -> str:
    """This process's launch token (from the supervisor's environment; '' when launched without one)."""
    return os.environ.get(TOKEN_ENV, "")


class Roster:
    """What the supervisor launched: worker id -> (role, token hash); re-read whenever the file changed
    (``add_external_worker`` may have added or renewed an id since)."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict = {}
        self.reload()

    @classmethod
    def of_run(cls, run_dir: str | Path) -> "Roster":
        return cls(Path(run_dir) / KEYS_DIR / "roster.json")

    def _stamp(self) -> tuple:
        try:
            st = self.path.stat()
        except OSError:
            return ()
        return st.st_mtime_ns, st.st_size

    def reload(self) -> None:
        try:
            self.stamp = self._stamp()
            self.entries = json.loads(self.path.read_text())
        except (OSError, ValueError) as e:
            raise RuntimeError(f"{self.path}: the run's roster is missing or unreadable ({e})") from e

    def check(self, role: str, worker_id: str, token: str) -> Optional[str]:
        """Why this registration does not match what the supervisor launched, or None."""
        if self._stamp() != self.stamp:  # changed since (a bring-your-own worker joined or joined again)
            self.reload()
        entry = self.entries.get(worker_id)
        if entry is None:
            return f"worker id {worker_id!r} was not launched in this run (roster: {sorted(self.entries)})"
        if entry["role"] != role:
            return f"worker {worker_id!r} was launched as a {entry['role']} worker, not {role}"
        if not token or not hmac.compare_digest(_sha256(token), entry["token_sha256"]):
            return f"worker {worker_id!r}: launch token does not match the one the supervisor gave it"
        return None
