"""A stand-in for ``python -m sglang.launch_server`` in the server-management tests.

``--mode ok`` answers ``/health`` and ``/health_generate`` with 200 (after
``--ready-after`` seconds), ``never_ready`` answers ``/health_generate`` with
503, ``exit`` prints a message and exits 3. ``--children N`` forks N
sleeping processes into the same process group, as SGLang forks its
scheduler and detokenizer; ``GET /pids`` lists them. ``--ignore-term`` makes
every process ignore SIGTERM. ``POST /generate`` never answers (a hung generation);
``POST /abort_request`` appends its body to ``--abort-log``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=["ok", "never_ready", "exit"], default="ok")
    parser.add_argument("--ready-after", type=float, default=0.0)
    parser.add_argument("--children", type=int, default=0)
    parser.add_argument("--ignore-term", action="store_true")
    parser.add_argument("--model", default=None)
    parser.add_argument("--abort-log", default=None)
    args = parser.parse_args()
    print(f"fake server: port {args.port} model {args.model}", flush=True)
    if args.mode == "exit":
        print("fake server: failing on purpose", flush=True)
        sys.exit(3)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child_code = "import signal, time\n"
    if args.ignore_term:
        child_code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    child_code += "while True: time.sleep(1)\n"
    children = [subprocess.Popen([sys.executable, "-c", child_code]) for _ in range(args.children)]
    ready_at = time.monotonic() + args.ready_after

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/pids":
                self._send(200, {"pids": [os.getpid()] + [c.pid for c in children]})
            elif self.path == "/health":
                self._send(200, {})
            elif self.path == "/health_generate":
                ok = args.mode == "ok" and time.monotonic() >= ready_at
                self._send(200 if ok else 503, {})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/generate":
                time.sleep(3600)  # hung: the client's request timeout ends it
            elif self.path == "/abort_request":
                if args.abort_log:
                    with open(args.abort_log, "a") as f:
                        f.write(body.decode() + "\n")
                self._send(200, {})
            else:
                self._send(404, {"error": self.path})

        def _send(self, status: int, body: dict) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
