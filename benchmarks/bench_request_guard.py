"""What the request guard in front of tritonserver costs per request: the same inference requests
(binary int64 tensors, Triton's HTTP wire format, one keep-alive connection) sent straight to a
stand-in backend and through the guard to it, alternating, for a small and a large request.

    python benchmarks/bench_request_guard.py [--rounds 9] [--requests 100]

Writes benchmarks/results/<device>/request_guard.json. The backend answers at once, so the guard's cost is
measured against a request that does no model work (a real server's forward dwarfs it)."""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(__file__)))
from common import alternate, machine, median, write_json  # noqa: E402

from nemo_aligner.servers.request_guard import ModelLimits, RequestGuard  # noqa: E402
from nemo_aligner.utils.ports import free_port  # noqa: E402


class Backend(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # as tritonserver's HTTP front answers

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        payload = b'{"outputs": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def request(rows: int, width: int):
    tokens = np.ones((rows, width), dtype=np.int64).tobytes()
    lengths = np.full((rows, 1), width, dtype=np.int64).tobytes()
    header = json.dumps({"inputs": [
        {"name": "tokens", "shape": [rows, width], "datatype": "INT64", "parameters": {"binary_data_size": len(tokens)}},
        {"name": "sequence_lengths", "shape": [rows, 1], "datatype": "INT64",
         "parameters": {"binary_data_size": len(lengths)}}]}).encode()
    return header + tokens + lengths, {"Inference-Header-Content-Length": str(len(header)),
                                       "Content-Type": "application/octet-stream"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    backend = ThreadingHTTPServer(("127.0.0.1", free_port()), Backend)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    guard_port = free_port()
    guard = RequestGuard("127.0.0.1", guard_port, backend.server_address[1],
                         {"reward_model": ModelLimits(256, 16384)}).start()
    rows = {}
    for name, (batch, width) in {"small (8 x 128 tokens, 8 KB)": (8, 128),
                                 "large (64 x 4096 tokens, 2 MB)": (64, 4096)}.items():
        body, headers = request(batch, width)
        connections = {"direct": http.client.HTTPConnection("127.0.0.1", backend.server_address[1]),
                       "guarded": http.client.HTTPConnection("127.0.0.1", guard_port)}

        def sender(conn):
            def send() -> float:
                start = time.perf_counter()
                for _ in range(args.requests):
                    conn.request("POST", "/v2/models/reward_model/infer", body=body, headers=headers)
                    conn.getresponse().read()
                return (time.perf_counter() - start) / args.requests
            return send

        contenders = {k: sender(c) for k, c in connections.items()}
        for send in contenders.values():
            send()  # warm-up
        times = alternate(contenders, args.rounds)
        direct, guarded = median(times["direct"]), median(times["guarded"])
        rows[name] = {"direct_ms": direct * 1e3, "guarded_ms": guarded * 1e3,
                      "added_ms": (guarded - direct) * 1e3, "bytes": len(body)}
        print(f"{name}: direct {direct * 1e3:.3f} ms, through the guard {guarded * 1e3:.3f} ms per request "
              f"(+{(guarded - direct) * 1e3:.3f} ms)", flush=True)
    guard.close()
    backend.shutdown()
    print("wrote", write_json("request_guard", {"machine": machine(), "requests_per_round": args.requests,
                                                "rounds": args.rounds, "results": rows}))


if __name__ == "__main__":
    main()
