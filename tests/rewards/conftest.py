"""The rewards' shared fixture: a loopback OpenAI-compatible server (the VLM rewards' fake)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


class FakeOpenAI(BaseHTTPRequestHandler):
    """Answers /v1/models and /v1/chat/completions; fails the first `fail_first` POSTs."""

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake-vl"}]})
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.posts.append(body)
            fail = len(srv.posts) <= srv.fail_first
        if fail:
            self._send(srv.fail_code, {"error": "try again"})
        else:
            self._send(200, {"choices": [{"message": {"role": "assistant",
                                                      "content": srv.reply}}]})


@pytest.fixture
def fake_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    srv.lock, srv.posts, srv.fail_first, srv.fail_code = threading.Lock(), [], 0, 503
    srv.reply = "HELLO\nWORLD"
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
