"""A scripted chat-completions server on loopback: what the real `openai` client talks to in tests.

Each POST /v1/chat/completions takes the next scripted step from a queue (a reply, an HTTP error, a slow reply);
when the queue is empty, `default` answers (or a 503 if there is none). Every request is recorded, headers and
body, so tests can check what the prompt held and what was sent back.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Reply:
    """A 200 answer whose assistant message is `content`, after `delay_s` seconds."""

    content: str
    prompt_tokens: int = 100
    completion_tokens: int = 50
    delay_s: float = 0.0
    usage: bool = True


@dataclass(frozen=True)
class Error:
    """An HTTP error answer (429, 500, ...) in the OpenAI error shape."""

    status: int
    message: str = "scripted error"


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body.get("messages", [])

    @property
    def text(self) -> str:
        """All message contents, joined: what the model saw."""
        return "\n".join(str(m.get("content", "")) for m in self.messages)


def proposals(*items: dict[str, Any]) -> str:
    """A good reply's content: the JSON object the proposer asks for."""
    return json.dumps({"proposals": list(items)})


class ChatServer:
    def __init__(self):
        self.script: deque[Reply | Error] = deque()
        self.default: Reply | Error | None = None
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def push(self, *steps: Reply | Error) -> None:
        with self._lock:
            self.script.extend(steps)

    def start(self) -> ChatServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> ChatServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _next(self, request: Request) -> Reply | Error:
        with self._lock:
            self.requests.append(request)
            if self.script:
                return self.script.popleft()
            return self.default or Error(503, "no scripted reply left")

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except json.JSONDecodeError:
                    body = {}
                request = Request(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}", "type": "not_found"}})
                step = server._next(request)
                if isinstance(step, Error):
                    return self._send(step.status, {"error": {"message": step.message, "type": "scripted",
                                                              "code": step.status}})
                time.sleep(step.delay_s)
                answer: dict[str, Any] = {
                    "id": f"chatcmpl-{len(server.requests)}", "object": "chat.completion",
                    "created": int(time.time()), "model": body.get("model", "scripted"),
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": step.content}}],
                }
                if step.usage:
                    answer["usage"] = {"prompt_tokens": step.prompt_tokens,
                                       "completion_tokens": step.completion_tokens,
                                       "total_tokens": step.prompt_tokens + step.completion_tokens}
                self._send(200, answer)

            def _send(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client timed out and left
                    pass

        return Handler
