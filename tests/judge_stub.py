"""A local stub of an LLM-judge HTTP service (loopback only): tests/test_judge_rollout.py, bench/."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StubJudge:
    """POST /judge answers {"score": 1.0 if the answer is in the completion else 0.0} after `delay_s`;
    POST /hang answers only after a minute. Records each /judge request's arrival and answer times
    (time.monotonic) in `windows`, and the most requests in flight at once in `peak`."""

    def __init__(self, delay_s: float) -> None:
        stub = self
        self.delay_s = delay_s
        self.windows: list[tuple[float, float]] = []
        self.lock = threading.Lock()
        self.now = self.peak = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                t0 = time.monotonic()
                with stub.lock:
                    stub.now += 1
                    stub.peak = max(stub.peak, stub.now)
                time.sleep(60 if self.path == "/hang" else stub.delay_s)
                with stub.lock:
                    stub.now -= 1
                    stub.windows.append((t0, time.monotonic()))
                out = json.dumps({"score": float(body["answer"] in body["completion"])}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                try:
                    self.wfile.write(out)
                except OSError:  # the client gave up (the hung judge's timeout)
                    pass

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
