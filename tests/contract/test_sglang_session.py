"""The CPU SGLang server refuses what sglang 0.5.23 refuses around a weight update, and the client never
trips over it (issue 23, items 3 and 8). Real HTTP against the server in its own process.

The refusal texts are checked against the pinned release's own source (the string constants of its
``scheduler_components/weight_updater.py``, ``entrypoints/http_server.py``), not against our copy:
- a distributed update outside ``/begin_weight_update`` ... ``/end_weight_update``: 400, before the
  broadcast (the sender would otherwise sit in ``dist.broadcast`` with no peer);
- a second begin, an end without begin: 400 (a failed update that never ends its session blocks
  every later one);
- ``/flush_cache`` while a request is in the running batch: 400 "Flush cache failed." (scheduler.py
  ``flush_cache`` / ``is_fully_idle``), so ``pause_mode: in_place`` must not send ``flush_cache: true``.
"""

from __future__ import annotations

import ast
import threading
import time

import pytest

from areal_async.config import load_config
from areal_async.models.tiny import build_model
from areal_async.models.tokenizer import load_tokenizer
from areal_async.rollout.clients import http_client as HC
from areal_async.rollout.engines.engine import GenRequest
from areal_async.rollout.clients.http_json import HTTPStatusError, call
from areal_async.rollout.clients.remote import ServerDown
from areal_async.rollout.clients.sglang_client import SGLangClient
from tests.support.sglang_fixtures import TINY, pinned_sglang_file, start_cpu_server, stop

pytestmark = pytest.mark.timeout(300)

CFG = load_config(TINY)
TOK = load_tokenizer(CFG.model.path)


@pytest.fixture(scope="module")
def server():
    proc, url = start_cpu_server()
    SGLangClient(url, name="ready").wait_ready(120)
    yield url
    stop(proc)


def strings_of(inner: str) -> set[str]:
    """Every string constant of one file of the pinned sglang wheel (implicit concatenation joined)."""
    return {
        n.value
        for n in ast.walk(ast.parse(pinned_sglang_file(inner)))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def refused(url: str, method: str, path: str, body=None) -> tuple[int, object]:
    with pytest.raises(HTTPStatusError) as e:
        call(url, method, path, body)
    return e.value.status, e.value.body


def test_session_refusals_are_sglang_0_5_23s_own(server):
    real = strings_of("sglang/srt/managers/scheduler_components/weight_updater.py")
    bucket = {
        "names": ["x"],
        "dtypes": ["float32"],
        "shapes": [[2]],
        "group_name": "nobody",
        "load_format": "flattened_bucket",
    }
    t0 = time.monotonic()
    status, body = refused(server, "POST", "/update_weights_from_distributed", bucket)
    assert time.monotonic() - t0 < 5.0  # answered at once, no broadcast joined
    assert status == 400 and body["success"] is False and body["message"] in real
    assert body["message"].startswith("update_weights_from_distributed must run between begin_weight_update()")
    status, body = refused(server, "POST", "/end_weight_update", {})
    assert status == 400 and body["message"] in real and "no weight-update session is open" in body["message"]
    assert call(server, "POST", "/begin_weight_update", {}) == {"success": True, "message": "Success"}
    status, body = refused(server, "POST", "/begin_weight_update", {})
    assert status == 400 and body["message"] in real and "already open" in body["message"]
    status, body = refused(server, "POST", "/update_weights_from_distributed", bucket)  # inside: now the group
    assert status == 400 and "Group nobody not in" in body["message"]
    assert call(server, "POST", "/end_weight_update", {})["success"] is True


def test_a_flush_with_a_running_request_is_refused_as_sglang_does(server):
    real = strings_of("sglang/srt/entrypoints/http_server.py")
    client = SGLangClient(server, name="flush")
    client.update_weights(0, build_model(CFG.model, len(TOK), 5).state_dict())
    prompt = TOK.encode("9+9=")
    seen = set()
    for attempt in range(40):  # timing: the pause must land while requests are in the running batch
        gens = [
            threading.Thread(
                target=client.generate, args=(f"r{attempt}-{k}", prompt, 56, GenRequest("l", prompt, 1, 56))
            )
            for k in range(8)
        ]
        for g in gens:
            g.start()
        time.sleep(0.002 * 2 ** (attempt % 9))  # windows of 2 ms .. 0.5 s, cycled: the batch may end early
        try:
            if "running" not in seen:  # once seen, the pause follows the start at once (a wider window)
                call(server, "GET", "/flush_cache")
        except HTTPStatusError as e:  # running, not paused
            assert e.status == 400 and e.body == "Flush cache failed.\n" and e.body in real
            seen.add("running")
        call(server, "POST", "/pause_generation", {"mode": "in_place"})
        try:
            call(server, "POST", "/flush_cache")
        except HTTPStatusError as e:  # kept in the running batch by in_place
            assert e.status == 400 and e.body == "Flush cache failed.\n"
            call(server, "POST", "/pause_generation", {"mode": "retract"})
            assert call(server, "POST", "/flush_cache").startswith("Cache flushed.")  # retracted: flushable
            seen.add("in_place")
        call(server, "POST", "/continue_generation", {})
        for g in gens:
            g.join(timeout=120)
        if seen == {"running", "in_place"}:
            break
    assert seen == {"running", "in_place"}, f"no flush landed on a running batch in 40 tries ({seen})"
    assert call(server, "GET", "/flush_cache").startswith("Cache flushed.") and "Cache flushed." in "".join(real)


def test_a_failed_update_ends_its_session_so_the_next_one_is_not_refused(server):
    """The last bucket has a wrong shape: the update fails (ServerDown), the client still ends the
    session (an end now is refused: none is open), and the next update goes through."""
    a, b = (build_model(CFG.model, len(TOK), s).state_dict() for s in (61, 62))
    client = SGLangClient(server, name="t-session", bucket_mb=0.05)  # the session is the default
    client.update_weights(0, a)
    bad = dict(b)
    bad[list(bad)[-1]] = b[list(bad)[-1]].new_zeros(3, 3)
    with pytest.raises(ServerDown, match="shape"):
        client.update_weights(1, bad)
    assert refused(server, "POST", "/end_weight_update", {})[0] == 400  # the client closed it already
    client.update_weights(2, b)
    assert call(server, "GET", "/model_info")["weight_version"] == "2"


def test_in_place_updates_never_ask_for_a_flush_and_the_group_size_follows_tp(server, monkeypatch):
    """in_place keeps requests in the running batch, so its buckets say flush_cache false (abort and
    retract empty the batch first and flush); the group has 1 + tp_size ranks, tp_size from /server_info."""
    seen = []
    real = HC.call

    def recording(base, method, path, body=None, timeout_s=30.0):
        seen.append((path, body))
        return real(base, method, path, body, timeout_s)

    monkeypatch.setattr(HC, "call", recording)
    sd = build_model(CFG.model, len(TOK), 7).state_dict()
    for mode, flush in (("in_place", False), ("abort", True), ("retract", True)):
        seen.clear()
        SGLangClient(server, name=f"t-{mode}", pause_mode=mode, bucket_mb=0.05).update_weights(3, sd)
        updates = [b for p, b in seen if p == "/update_weights_from_distributed"]
        assert len(updates) > 1 and {b["flush_cache"] for b in updates} == {flush}
        paths = [p for p, _ in seen]
        assert (
            paths[0] == "/server_info"
            and paths.index("/begin_weight_update") < paths.index("/update_weights_from_distributed")
            and paths[-2:] == ["/end_weight_update", "/model_info"]
        )
        init = [b for p, b in seen if p == "/init_weights_update_group"][0]
        assert init["world_size"] == 1 + real(server, "GET", "/server_info")["tp_size"] == 2
    status, body = refused(
        server,
        "POST",
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 1,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": "tp",
            "backend": "gloo",
        },
    )
    assert status == 400 and "tp_size=1" in body["message"]


def test_a_bucket_the_server_refuses_ends_the_broadcast_at_once(server):
    """A client without the session (an SGLang release before them, pointed at 0.5.23): the server refuses
    the bucket before joining the broadcast; the client stops waiting at its answer, not at the group's
    timeout (main sat in dist.broadcast for update_timeout_s), and the next update, with the session, works."""
    sd = build_model(CFG.model, len(TOK), 8).state_dict()
    client = SGLangClient(server, name="t-nosession", weight_update_session=False, update_timeout_s=120)
    t0 = time.monotonic()
    with pytest.raises(ServerDown, match="must run between begin_weight_update"):
        client.update_weights(4, sd)
    assert time.monotonic() - t0 < 30 and client.group is None
    client.session = True
    client.update_weights(5, sd)
    assert call(server, "GET", "/model_info")["weight_version"] == "5"


def test_a_session_left_open_by_a_dead_owner_is_ended_and_the_update_goes_through(server):
    """Item 8 of issue 36: the server's previous owner died between /begin_weight_update and /end_weight_update
    (its session is still open: 0.5.23 refuses every later begin, BEGIN_TWICE). The new owner ends it, opens its
    own and loads (main: the begin's 400 became ServerDown at every revival, the server stayed down)."""
    assert call(server, "POST", "/begin_weight_update", {})["success"]  # the dead owner's session
    sd = build_model(CFG.model, len(TOK), 9).state_dict()
    SGLangClient(server, name="t-left-open", bucket_mb=0.05).update_weights(6, sd)
    assert call(server, "GET", "/model_info")["weight_version"] == "6"
    assert refused(server, "POST", "/end_weight_update", {})[0] == 400  # and the client closed its own
