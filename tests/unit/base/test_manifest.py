"""The run manifest (RUN_DIR/endpoints.json): one typed record, written by the supervisor, read by one
loader that refuses what this version did not write, naming the key."""

import dataclasses
import json
import shutil

import pytest

from areal_async.base.endpoints import plan_endpoints
from areal_async.base.manifest import STORES, ManifestError, RunManifest

FIELDS = [
    "control",
    "trajectories",
    "rewards",
    "sock_dir",
    "run_id",
    "weights_endpoint",
    "traj_store",
    "weight_store",
    "trainer_store",
    "servers",
    "resume_from",
    "recoveries",
]


def test_a_planned_manifest_round_trips_as_one_flat_object(tmp_path):
    planned = plan_endpoints(2, "127.0.0.1", "ipc")
    try:
        m = dataclasses.replace(planned, servers=["http://127.0.0.1:1"], recoveries=2)
        m.save(tmp_path)
        raw = json.loads((tmp_path / "endpoints.json").read_text())
        assert list(raw) == FIELDS  # flat: no free-form "extra" dict
        assert RunManifest.load(tmp_path) == m
        assert m.control.startswith("ipc://" + m.sock_dir) and len(m.rewards) == 2 and len(m.run_id) == 10
        assert [m.store(s) for s in STORES] == [m.traj_store, m.weight_store, m.trainer_store]
        assert len({m.traj_store, m.weight_store, m.trainer_store}) == 3
        assert not (tmp_path / "endpoints.json.tmp").exists()
    finally:
        shutil.rmtree(planned.sock_dir, ignore_errors=True)


def test_tcp_endpoints_carry_each_binding_process_address():
    m = plan_endpoints(1, "10.0.0.1", "tcp", {"trainer": "127.0.0.1", "scheduler": "127.0.0.1"})
    assert m.sock_dir == "" and m.control.startswith("tcp://127.0.0.1:")
    assert m.rewards[0].startswith("tcp://10.0.0.1:")  # not named: binds on host
    assert all(s.startswith("tcp://127.0.0.1:") for s in (m.trajectories, m.weights_endpoint, *map(m.store, STORES)))


def test_a_partial_manifest_takes_the_defaults(tmp_path):
    (tmp_path / "endpoints.json").write_text(json.dumps({"control": "ipc:///c", "trajectories": "ipc:///t"}))
    m = RunManifest.load(tmp_path)
    assert (m.rewards, m.run_id, m.servers, m.resume_from, m.recoveries) == ([], None, [], None, 0)


@pytest.mark.parametrize(
    "data, message",
    [
        ([1, 2], "expected a JSON object, got list"),
        ({"control": "c", "trajectories": "t", "extra": {}}, "unknown key(s) extra; expected some of control,"),
        ({"trajectories": "t"}, "missing control"),
        ({"control": "c", "trajectories": "t", "recoveries": "3"}, "recoveries='3': expected int"),
        ({"control": "c", "trajectories": "t", "recoveries": True}, "recoveries=True: expected int"),
        ({"control": "c", "trajectories": "t", "rewards": ["r", 1]}, "rewards=['r', 1]: expected list[str]"),
        ({"control": "c", "trajectories": "t", "resume_from": 5}, "resume_from=5: expected Optional[str]"),
    ],
)
def test_the_loader_refuses_what_this_version_did_not_write(tmp_path, data, message):
    (tmp_path / "endpoints.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError) as e:
        RunManifest.load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'endpoints.json'}: ") and message in str(e.value)


def test_not_json_and_an_unknown_store_are_refused(tmp_path):
    (tmp_path / "endpoints.json").write_text("{half")
    with pytest.raises(ManifestError, match="not JSON"):
        RunManifest.load(tmp_path)
    with pytest.raises(ValueError, match="store 'gloo_store': expected one of traj_store, weight_store, trainer_store"):
        RunManifest("c", "t").store("gloo_store")
