"""The CPU SGLang server's HTTP side (``sglang_server.py`` holds the state): routes, status codes and
bodies as sglang 0.5.23's ``srt/entrypoints/http_server.py`` answers them (``clients/sglang_rules.py``)."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlparse

from areal_async.rollout.clients import sglang_rules as R
from areal_async.rollout.clients.server_auth import UNAUTHORIZED, refusal
from areal_async.rollout.clients.sglang_rules import TP_SIZE, BadRequest, Unavailable

log = logging.getLogger("areal_async.sglang_server")

_POST = {
    "/generate": "generate",
    "/pause_generation": "pause",
    "/continue_generation": "resume",
    "/init_weights_update_group": "init_group",
    "/destroy_weights_update_group": "destroy_group",
    "/update_weights_from_distributed": "update_from_distributed",
    "/update_weights_from_disk": "update_from_disk",
    "/begin_weight_update": "begin_update",
    "/end_weight_update": "end_update",
    "/load_lora_adapter": "load_lora",
    "/unload_lora_adapter": "unload_lora",
    "/update_weight_version": "update_weight_version",
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client reuses its connection
    # TCP_NODELAY: an answer goes out as two writes (headers, then body); with Nagle on a kept-alive connection
    # the body waited for the client's delayed ACK of the headers, 40 ms per answer with a body (measured:
    # GET /model_info and POST /continue_generation 44 ms each, pause with no body 1 ms)
    disable_nagle_algorithm = True
    server_version = "areal-cpu-sglang/1"
    state: Any  # the CpuSGLangServer, set on the subclass made by make_http_server

    def log_message(self, fmt: str, *args) -> None:  # one line per request is too much at 1000s of requests/s
        log.debug("%s " + fmt, self.address_string(), *args)

    def _refused(self, path: str) -> bool:
        """Without the run's key (``server_auth``, as SGLang's --api-key): 401 and nothing else done."""
        code = refusal(self.command, path, self.headers.get("Authorization"), self.state.api_key)
        if code is not None:
            self._send(code, UNAUTHORIZED, close=True)  # its body is never read (nor allocated): the connection ends
        return code is not None

    def do_GET(self) -> None:
        path = urlparse(self.path).path
        if self._refused(path):
            return
        if path in ("/health", "/health_generate"):  # the process serves; /generate says if the weights do
            self._send(200, None)
        elif path in ("/model_info", "/get_model_info"):
            self._send(200, self.state.model_info())
        elif path == "/flush_cache":
            self._flush()
        elif path in ("/server_info", "/get_server_info"):
            self._send(200, {"tp_size": TP_SIZE, "dp_size": 1, "pp_size": 1, "version": "0.5.23 (areal CPU twin)"})
        else:
            self._send(404, {"error": {"message": f"no route GET {path}", "code": 404}})

    def do_POST(self) -> None:
        path = urlparse(self.path).path
        if self._refused(path):
            return
        try:
            body = self._body()
            if path == "/flush_cache":
                return self._flush()
            if path == "/abort_request":
                self.state.abort_request(body)
                return self._send(200, None)
            if path not in _POST:
                return self._send(404, {"error": {"message": f"no route POST {path}", "code": 404}})
            out = getattr(self.state, _POST[path])(body)
            self._send(400 if out.get("success") is False else 200, out)
        except BadRequest as e:
            self._send(400, {"error": {"message": str(e), "code": 400}})
        except (KeyError, TypeError, ValueError) as e:
            self._send(400, {"error": {"message": f"bad request body for {path}: {e!r}", "code": 400}})
        except TimeoutError as e:
            self._send(504, {"error": {"message": str(e), "code": 504}})
        except Unavailable as e:
            self._send(503, {"error": {"message": str(e), "code": 503}})

    def _flush(self) -> None:
        ok = self.state.flush()
        self._send(200 if ok else R.BAD_REQUEST, R.FLUSHED if ok else R.FLUSH_FAILED)

    def _body(self) -> dict:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as e:
            raise BadRequest(f"body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise BadRequest(f"body {body!r}: expected a JSON object")
        return body

    def _send(self, code: int, payload, close: bool = False) -> None:
        if payload is None:
            data, ctype = b"", "text/plain"
        elif isinstance(payload, str):
            data, ctype = payload.encode(), "text/plain"
        else:
            data, ctype = json.dumps(payload).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        if close:
            self.send_header("Connection", "close")  # and BaseHTTPRequestHandler closes it after this answer
        self.end_headers()
        self.wfile.write(data)


def make_http_server(state, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"state": state})
    server_cls = type("Server", (ThreadingHTTPServer,), {"request_queue_size": 4096, "daemon_threads": True})
    return server_cls((host, port), handler)  # a deep backlog: a worker opens hundreds of connections at once
