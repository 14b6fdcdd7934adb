"""The control plane over TCP with CURVE (real sockets, a real SchedulerService in this process):
a peer without the run's keys never reaches the scheduler; a keyed peer that claims another
worker's id or role is refused and the real worker keeps its work; an oversize frame is dropped
at the socket and the scheduler keeps serving; keys are 0600."""

from __future__ import annotations

import asyncio
import logging
import os
import stat

import pytest
import zmq
import zmq.asyncio

import protocols.messages as M
from protocols.curve import current_keys, use_curve, zap_stats
from protocols.sockets import connect_address, free_tcp_port, make_socket, send_message, use_source_host

from areal_async.base.control import ControlClient
from areal_async.base.manifest import RunManifest
from areal_async.base.runkeys import Roster, add_external_worker, install_run_keys, load_curve_keys, write_run_keys
from areal_async.config import from_dict
from areal_async.scheduler.service import SchedulerService

ROSTER = {"rollout-0": "rollout", "reward-0": "reward", "trainer": "trainer"}


@pytest.fixture
def keyed_run(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    tokens = write_run_keys(run_dir, ROSTER)
    install_run_keys(run_dir)
    yield run_dir, tokens
    use_curve(None)


async def recv(sock, timeout=5.0):
    return M.decode(await asyncio.wait_for(sock.recv(), timeout))


async def pong(client: ControlClient, nonce: int) -> bool:
    """Ping through ``client`` and wait for the Pong (skipping the work that arrives meanwhile)."""
    await client.send(M.Ping(nonce=nonce))
    while True:
        msg = await asyncio.wait_for(client.recv(), 5)
        if isinstance(msg, M.Pong):
            return msg.nonce == nonce


async def silent(sock, timeout=1.0) -> bool:
    """True when nothing arrives on ``sock`` within ``timeout``."""
    return not await sock.poll(int(timeout * 1000))


def scheduler(run_dir, port):
    cfg = from_dict({}, ["train_dataset.batch_size=2", "gconfig.n_samples=2", "rollout.max_concurrent_rollouts=2"])
    ep = RunManifest(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_tcp_port()}", [], "")
    return SchedulerService(
        cfg, ep, run_dir, t0=0.0, tokenize=lambda s: [1] + [ord(c) for c in s], roster=Roster.of_run(run_dir)
    )


async def started_fleet(svc, ctx, tokens):
    """A registered trainer and rollout-0 holding generation work."""
    endpoint = svc.router.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    trainer = ControlClient(ctx, endpoint, "trainer", "trainer", 60.0, token=tokens["trainer"])
    worker = ControlClient(ctx, endpoint, "rollout", "rollout-0", 60.0, token=tokens["rollout-0"])
    await worker.register(timeout_s=5)
    await trainer.register(timeout_s=5)
    await trainer.send(M.TrainerReady(version=0, next_step=0))
    got = await asyncio.wait_for(worker.recv(), 5)
    assert all(isinstance(r, M.GenerateRequest) for r in M.unbatch(got))  # several groups admitted at once: one message
    return trainer, worker


def test_keys_are_private_and_tokens_hash_to_the_roster(tmp_path):
    tokens = write_run_keys(tmp_path, ROSTER)
    d = tmp_path / "keys"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("server.key", "client.key", "roster.json"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600, name
    assert all(tok not in (d / "roster.json").read_text() for tok in tokens.values())
    roster = Roster.of_run(tmp_path)
    assert roster.check("rollout", "rollout-0", tokens["rollout-0"]) is None
    assert "not rollout" in roster.check("rollout", "trainer", tokens["trainer"])
    assert "launch token does not match" in roster.check("rollout", "rollout-0", tokens["reward-0"])
    assert "launch token does not match" in roster.check("rollout", "rollout-0", "")
    assert "was not launched" in roster.check("rollout", "rollout-9", tokens["rollout-0"])
    # an external worker put on the roster later is found by a roster loaded before it
    tok = add_external_worker(tmp_path, "embed-0", "rollout")
    assert roster.check("rollout", "embed-0", tok) is None
    with pytest.raises(ValueError, match="the supervisor launched"):
        add_external_worker(tmp_path, "rollout-0", "rollout")  # a launched worker's id cannot be taken
    with pytest.raises(ValueError, match="not reward"):
        add_external_worker(tmp_path, "embed-0", "reward")
    again = add_external_worker(tmp_path, "embed-0", "rollout")  # an external worker may join again
    assert "launch token does not match" in roster.check("rollout", "embed-0", tok)
    assert roster.check("rollout", "embed-0", again) is None
    # fresh keys for a fresh fleet: the old tokens and client key no longer match
    old_client = load_curve_keys(tmp_path).client_public
    new = write_run_keys(tmp_path, ROSTER)
    assert load_curve_keys(tmp_path).client_public != old_client
    assert "launch token does not match" in Roster.of_run(tmp_path).check("rollout", "rollout-0", tokens["rollout-0"])
    assert Roster.of_run(tmp_path).check("rollout", "rollout-0", new["rollout-0"]) is None


async def test_unkeyed_peers_never_reach_the_scheduler(keyed_run, caplog):
    run_dir, tokens = keyed_run
    port = free_tcp_port()
    svc = scheduler(run_dir, port)
    task = asyncio.create_task(svc.run())
    ctx = zmq.asyncio.Context()
    refused_before = zap_stats()["refused"]
    try:
        trainer, worker = await started_fleet(svc, ctx, tokens)
        register = M.encode(M.Register(role="rollout", worker_id="rollout-0", pid=1, token=tokens["rollout-0"]))
        with caplog.at_level(logging.INFO):
            caplog.clear()
            plain = ctx.socket(zmq.DEALER)  # no CURVE at all (NULL mechanism)
            plain.setsockopt(zmq.LINGER, 0)
            plain.connect(f"tcp://127.0.0.1:{port}")
            stranger = ctx.socket(zmq.DEALER)  # CURVE with the server's key but a client key of its own
            stranger.setsockopt(zmq.LINGER, 0)
            public, secret = zmq.curve_keypair()
            stranger.setsockopt(zmq.CURVE_SERVERKEY, current_keys().server_public)
            stranger.setsockopt(zmq.CURVE_PUBLICKEY, public)
            stranger.setsockopt(zmq.CURVE_SECRETKEY, secret)
            stranger.connect(f"tcp://127.0.0.1:{port}")
            for s in (plain, stranger):  # even a stolen token does not help without the keys
                await s.send(register)
                await s.send(os.urandom(64))
            assert await asyncio.gather(silent(plain), silent(stranger)) == [True, True]  # both 1 s windows at once
            seen = [r.getMessage() for r in caplog.records if r.name == "areal_async.scheduler"]
        assert seen == [], seen  # no registration, refusal or bad-frame report: no frame arrived
        assert zap_stats()["refused"] >= refused_before + 1  # the stranger's key, at the handshake
        # the real worker is untouched and the scheduler still answers it
        assert svc.workers["rollout-0"].ident == worker.sock.getsockopt(zmq.IDENTITY)
        assert await pong(worker, 3)
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 5)
        ctx.destroy(linger=0)


async def test_keyed_impostor_is_refused_and_the_worker_keeps_its_work(keyed_run):
    run_dir, tokens = keyed_run
    svc = scheduler(run_dir, free_tcp_port())
    task = asyncio.create_task(svc.run())
    ctx = zmq.asyncio.Context()
    try:
        trainer, worker = await started_fleet(svc, ctx, tokens)
        held = set(svc.core.rollouts["rollout-0"].groups)
        ident = svc.workers["rollout-0"].ident
        assert held
        endpoint = svc.router.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        claims = [
            ("rollout", "rollout-0", ""),  # the live worker's id, no token
            ("rollout", "rollout-0", tokens["reward-0"]),  # another worker's token
            ("trainer", "rollout-0", tokens["rollout-0"]),  # the right token, another role
            ("rollout", "rollout-7", tokens["rollout-0"]),  # an id the supervisor never launched
            ("reward", "trainer", tokens["trainer"]),
        ]  # the trainer's id and token, another role
        for k, (role, wid, tok) in enumerate(claims):
            # the run's client keys (make_socket applies them), its own connection; even the
            # worker's bare id as routing identity
            imp = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=wid if k % 2 else f"{wid}/x{k}")
            await send_message(imp, M.Register(role=role, worker_id=wid, pid=99, token=tok))
            err = await recv(imp)
            assert isinstance(err, M.Error) and err.code == "refused", (role, wid, err)
            # and it cannot act as the worker either
            await send_message(imp, M.Heartbeat(worker_id=wid, ts=0.0))
            assert isinstance(await recv(imp), M.Error)
            imp.close(0)
        assert svc.workers["rollout-0"].ident == ident
        assert set(svc.core.rollouts["rollout-0"].groups) == held
        assert svc.core.ledger.n_aborted == 0
        assert sorted(svc.workers) == ["rollout-0", "trainer"]
        # the real worker still gets its traffic
        assert await pong(worker, 5)
        # a real restart (same id, role and token, a new process) is accepted; its old work is re-issued
        again = ControlClient(ctx, endpoint, "rollout", "rollout-0", 60.0, token=tokens["rollout-0"])
        await again.register(timeout_s=5)
        assert svc.workers["rollout-0"].ident != ident
        assert svc.core.ledger.n_aborted == 2 * len(held)  # n_samples = 2 per group
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 5)
        ctx.destroy(linger=0)


async def test_oversize_frame_is_dropped_at_the_socket(keyed_run, caplog):
    run_dir, tokens = keyed_run
    svc = scheduler(run_dir, free_tcp_port())
    task = asyncio.create_task(svc.run())
    ctx = zmq.asyncio.Context()
    try:
        trainer, worker = await started_fleet(svc, ctx, tokens)
        endpoint = svc.router.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        big = make_socket(ctx, zmq.DEALER, connect=endpoint, identity="big/1")
        with caplog.at_level(logging.INFO):
            caplog.clear()
            await big.send(b"\x00" * (M.MAX_MESSAGE_BYTES + 4096))
            await send_message(big, M.Ping(nonce=1))  # behind the big frame on the dropped connection
            assert await silent(big, 2.0)
            seen = [r.getMessage() for r in caplog.records if r.name == "areal_async.scheduler"]
        assert seen == [], seen  # libzmq dropped it: the scheduler never decoded (or allocated) it
        assert await pong(worker, 9)
        # a frame exactly at the bound still arrives (and is refused as a bad message, not dropped)
        ok = make_socket(ctx, zmq.DEALER, connect=endpoint, identity="ok/1")
        await ok.send(b"\x00" * M.MAX_MESSAGE_BYTES)
        err = await recv(ok, 10)
        assert isinstance(err, M.Error) and err.code == "bad_frame"
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 5)
        ctx.destroy(linger=0)


def test_make_socket_sets_the_size_bound():
    ctx = zmq.Context()
    try:
        s = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*")
        assert s.getsockopt(zmq.MAXMSGSIZE) == M.MAX_MESSAGE_BYTES
        t = make_socket(ctx, zmq.PULL, bind="tcp://127.0.0.1:*", max_bytes=1234)
        assert t.getsockopt(zmq.MAXMSGSIZE) == 1234
        with pytest.raises(ValueError, match="max_bytes=0"):
            make_socket(ctx, zmq.PULL, max_bytes=0)
    finally:
        ctx.destroy(linger=0)


def test_a_node_address_is_the_source_of_every_tcp_connection():
    """use_source_host (a worker of node k, cluster.node_hosts): the peer sees the connection come from
    that address, as the kernel reports it on the accepting side; ipc endpoints are left alone."""
    import socket

    ctx = zmq.Context()
    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        use_source_host("127.0.0.2")
        assert connect_address("ipc:///tmp/x.sock") == "ipc:///tmp/x.sock"
        s = make_socket(ctx, zmq.DEALER, connect=f"tcp://127.0.0.1:{listener.getsockname()[1]}")
        listener.settimeout(30)
        conn, peer = listener.accept()
        conn.close()
        assert peer[0] == "127.0.0.2"
        s.close(0)
        use_source_host(None)
        assert connect_address("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"
    finally:
        use_source_host(None)
        listener.close()
        ctx.destroy(linger=0)


async def test_a_flood_of_bad_frames_writes_a_bounded_log_with_counts_that_add_up(keyed_run, tmp_path):
    """2000 undecodable frames from one keyed peer, 2 from each of 100 peers with fresh identities and
    50 messages from an unregistered peer: every one answered with an Error, the scheduler's log holds
    at most one window's cap of lines (20 in full + 10 count lines + 1 for the rest; two windows if one
    closed meanwhile), and its count lines add up to every frame sent. (Before: one ERROR line each.)"""
    run_dir, tokens = keyed_run
    svc = scheduler(run_dir, free_tcp_port())
    handler = logging.FileHandler(tmp_path / "scheduler.log")
    logger = logging.getLogger("areal_async.scheduler")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    task = asyncio.create_task(svc.run())
    ctx = zmq.asyncio.Context()
    try:
        endpoint = svc.router.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        flood = make_socket(ctx, zmq.DEALER, connect=endpoint, identity="fuzz/0")
        for k in range(2000):
            await flood.send(os.urandom(1 + k % 64))
        for _ in range(2000):
            assert isinstance(await recv(flood), M.Error)
        for j in range(100):
            rotating = make_socket(ctx, zmq.DEALER, connect=endpoint, identity=f"fuzz/{j + 1}")
            for _ in range(2):
                await rotating.send(b"\xc1")  # never valid msgpack
                assert (await recv(rotating)).code == "bad_frame"
            rotating.close(0)
        stranger = make_socket(ctx, zmq.DEALER, connect=endpoint, identity="nobody/1")
        for _ in range(50):
            await send_message(stranger, M.Heartbeat(worker_id="nobody", ts=0.0))
            assert (await recv(stranger)).code == "refused"
    finally:
        svc.done.set()
        await asyncio.wait_for(task, 5)  # flushes the window's count lines
        ctx.destroy(linger=0)
        logger.removeHandler(handler)
        handler.close()
    lines = [ln for ln in (tmp_path / "scheduler.log").read_text().splitlines() if "rejected" in ln or "refused" in ln]
    counts = [ln for ln in lines if " logged above" in ln]
    assert len(lines) <= 2 * 31, len(lines)
    assert sum(int(ln.split(": ", 1)[1].split(" ")[0]) for ln in counts) == 2000 + 200 + 50, counts
    assert any("2000 rejected (bad frame) from b'fuzz/0'" in ln for ln in counts), counts
    assert any("50 rejected (refused heartbeat) from b'nobody/1'" in ln for ln in counts), counts


def test_rejection_log_caps_lines_per_peer_and_window_and_counts_every_one():
    """By hand: burst 2 per key, 3 lines a window, 1 key named in the counts, windows of 10 s."""
    from protocols.rejections import RejectionLog

    now, out = [0.0], []
    logger = logging.getLogger("test.rejections")
    logger.addHandler(handler := logging.Handler())
    handler.emit = lambda r: out.append(r.getMessage())
    try:
        rl = RejectionLog(logger, burst=2, max_lines=3, max_keys=1, period_s=10.0, clock=lambda: now[0])
        for k in range(5):
            rl.reject("s", b"a", "bad frame", "A%d", k)
        rl.reject("s", b"b", "bad frame", "B")
        rl.reject("s", b"c", "bad frame", "C")  # over the window's 3 lines: counted only
        assert out == ["A0", "A1", "B"]
        now[0] = 10.0
        rl.reject("s", b"a", "bad frame", "A%d", 5)  # closes the first window, opens the next
        assert out[3:] == [
            "s: 5 rejected (bad frame) from b'a' in 10.0 s; 2 of them logged above",
            "(others): 2 rejected (any) from 2 other (receiver, peer, reason) in 10.0 s; 1 of them logged above",
            "A5",
        ]
        now[0] = 12.5
        rl.flush()
        rl.flush()  # an empty window writes nothing
        assert out[6:] == ["s: 1 rejected (bad frame) from b'a' in 2.5 s; 1 of them logged above"]
    finally:
        logger.removeHandler(handler)
