"""The wandb sink (``stats_logger.wandb_project``) against the real ``wandb`` package, offline: the rows a run
logs are read back from the run file wandb itself wrote (``RUN_DIR/wandb/offline-run-*/run-*.wandb``), as
the protobuf records of wandb's own schema (``wandb.proto.wandb_internal_pb2.Record``), framed as wandb's
datastore frames them (LevelDB's log format: 32 KiB blocks, a 7-byte header per chunk, after a 7-byte file
header; the reader below is written from that format, not from the sink). The expected history is
written out by hand from the rows."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")  # the 'wandb' extra (scripts/setup.sh installs it; CI: a must-run file)
from wandb.proto import wandb_internal_pb2 as pb  # noqa: E402

from areal_async.config import from_dict  # noqa: E402
from areal_async.scheduler.runlog import RunLog  # noqa: E402
from areal_async.scheduler.sinks import sinks_from_config  # noqa: E402

FILE_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)  # ident, magic, version 0
BLOCK, CHUNK_HEADER = 32768, 7  # crc32 (4), length (2, little-endian), type (1): 1 full, 2 first, 3 middle, 4 last

ROWS = [
    {"kind": "eval", "step": 0, "version": 0, "eval_pass1": 0.25, "eval_pass1_ci_low": None},
    {"step": 0, "version": 1, "reward_mean": 0.5, "loss": -0.125, "note": "text is skipped", "ok": True},
    {"step": 1, "version": 2, "reward_mean": 0.75, "loss": 0.0625},
]


def key(item) -> str:
    """An item's key: ``key``, or its ``nested_key`` path (which wandb-core writes)."""
    return item.key or "/".join(item.nested_key)


def records(path: Path) -> list[pb.Record]:
    """Every record of a .wandb file, whole (a record split over chunks joined)."""
    data = path.read_bytes()
    assert data[: len(FILE_HEADER)] == FILE_HEADER, data[:8]
    pos, out, parts = len(FILE_HEADER), [], b""
    while pos + CHUNK_HEADER <= len(data):
        if BLOCK - pos % BLOCK < CHUNK_HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + CHUNK_HEADER])
        if pos + CHUNK_HEADER + n > len(data):  # a chunk still being written
            break
        parts += data[pos + CHUNK_HEADER : pos + CHUNK_HEADER + n]
        pos += CHUNK_HEADER + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            out.append(rec)
            parts = b""
    return out


def written(path: Path, timeout_s: float = 30.0) -> list[pb.Record]:
    """The file's records once wandb-core has written its exit record: ``finish()`` returns before the Go
    service flushes the offline file (seen here in ~1 of 3 runs on a busy machine: the 7-byte file header
    alone right after ``finish()``, every record a moment later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in recs) or time.monotonic() > deadline:
            return recs
        time.sleep(0.05)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb's own files (settings, caches) under tmp_path; nothing printed, nothing sent."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path / "run"


def test_every_numeric_key_reaches_the_offline_run_at_its_step(offline):
    cfg = from_dict({}, ["stats_logger.wandb_project=areal-test", "stats_logger.wandb_mode=offline", "seed=7"])
    offline.mkdir()
    log = RunLog(offline, dump_trajectories=False, sinks=sinks_from_config(cfg, offline))
    for row in ROWS:
        log.metrics(row)
    log.close()
    (path,) = (offline / "wandb").glob("offline-run-*/run-*.wandb")
    recs = written(path)
    history = [
        {key(i): json.loads(i.value_json) for i in r.history.item if not key(i).startswith("_")}
        for r in recs
        if r.WhichOneof("record_type") == "history"
    ]
    assert history == [
        {"step": 0, "version": 0.0, "eval_pass1": 0.25},
        {"step": 0, "version": 1.0, "reward_mean": 0.5, "loss": -0.125},
        {"step": 1, "version": 2.0, "reward_mean": 0.75, "loss": 0.0625},
    ]
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("areal-test", cfg.experiment_name)
    config = {key(i): json.loads(i.value_json) for i in run.config.update}  # the run's config, as init sent it
    assert config["seed"] == 7 and config["stats_logger"]["wandb_mode"] == "offline"
    assert any(r.WhichOneof("record_type") == "exit" for r in recs)  # finish() closed the run
