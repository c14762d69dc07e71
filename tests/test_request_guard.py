"""The HTTP request guard in front of tritonserver: header checks against the configured limits, and
forwarding to a stand-in backend (refusals never reach it; answers come back unchanged)."""

import http.client
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import free_port
from nemo_aligner.servers.request_guard import BadRequest, ModelLimits, RequestGuard, check_infer_header

LIMITS = ModelLimits(max_rows=8, max_row_elements=64)


def spec(name="tokens", shape=(2, 5), datatype="INT64", binary=True):
    entry = {"name": name, "shape": list(shape), "datatype": datatype}
    if binary:
        size = 1
        for d in shape:
            size *= d
        entry["parameters"] = {"binary_data_size": size * 8}
    return entry


def data_bytes(*specs):
    return sum(s.get("parameters", {}).get("binary_data_size", 0) for s in specs)


def test_a_request_within_the_limits_passes():
    inputs = [spec(shape=(8, 64)), spec("sequence_lengths", (8, 1))]
    check_infer_header("rm", {"inputs": inputs}, LIMITS, data_bytes(*inputs))
    check_infer_header("rm", {"inputs": [spec(shape=(2, 3), binary=False)]}, LIMITS, 0)  # JSON data


GUARD_CASES = {
    "huge-declared-shape": ({"inputs": [spec(shape=(64, 100_000_000_000), binary=False)]}, 0,
                            r"input 'tokens' has 64 rows, more than this server takes \(8\)"),
    "wide-rows": ({"inputs": [spec(shape=(2, 1 << 40), binary=False)]}, 0,
                  r"more than 64 elements per row"),
    "product-of-dims-per-row": ({"inputs": [spec(shape=(1, 9, 9), binary=False)]}, 0, r"more than 64 elements per row"),
    "empty-batch": ({"inputs": [spec(shape=(0, 4))]}, 0, r"input 'tokens' is empty \(shape \[0, 4\]\)"),
    "zero-width": ({"inputs": [spec(shape=(2, 0))]}, 0, r"is empty \(shape \[2, 0\]\)"),
    "negative-dim": ({"inputs": [spec(shape=(2, -1), binary=False)]}, 0, r"negative dimension"),
    "float-dim": ({"inputs": [{"name": "tokens", "shape": [2, 1.5], "datatype": "INT64"}]}, 0, r"shape of integers"),
    "bool-dim": ({"inputs": [{"name": "tokens", "shape": [True, 2], "datatype": "INT64"}]}, 0, r"shape of integers"),
    "no-inputs": ({"inputs": []}, 0, r"the request has no inputs"),
    "not-an-object": ([1, 2], 0, r"must be a JSON object"),
    "nameless-input": ({"inputs": [{"shape": [1, 1]}]}, 0, r"inputs\[0\] has no name"),
    "no-datatype": ({"inputs": [{"name": "tokens", "shape": [1, 1]}]}, 0, r"has no datatype"),
    "size-disagrees-with-shape": ({"inputs": [dict(spec(), parameters={"binary_data_size": 8})]}, 8,
                                  r"declares shape \[2, 5\] of INT64 \(80 bytes\) but binary_data_size=8"),
    "data-shorter-than-declared": ({"inputs": [spec()]}, 40, r"add up to 80 bytes, but 40 bytes follow"),
    "negative-binary-size": ({"inputs": [dict(spec(datatype="BYTES"), parameters={"binary_data_size": -3})]}, 0,
                             r"binary_data_size=-3"),
}


@pytest.mark.parametrize("case", list(GUARD_CASES))
def test_bad_headers_are_refused_with_the_reason(case):
    header, nbytes, message = GUARD_CASES[case]
    with pytest.raises(BadRequest, match=message):
        check_infer_header("rm", header, LIMITS, nbytes)


class _Backend(BaseHTTPRequestHandler):
    """A stand-in tritonserver: answers every request with what it received."""

    protocol_version = "HTTP/1.1"
    seen = []

    def log_message(self, *args):
        pass

    def _answer(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append((self.command, self.path, body))
        payload = json.dumps({"method": self.command, "path": self.path, "bytes": len(body)}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _answer


@pytest.fixture()
def guard():
    backend = ThreadingHTTPServer(("127.0.0.1", free_port()), _Backend)
    thread = threading.Thread(target=backend.serve_forever, daemon=True)
    thread.start()
    _Backend.seen = []
    port = free_port()
    front = RequestGuard("127.0.0.1", port, backend.server_address[1], {"rm": LIMITS}, max_inputs=2).start()
    try:
        yield port, backend
    finally:
        front.close()
        backend.shutdown()
        backend.server_close()


def infer_body(header, data=b""):
    head = json.dumps(header).encode()
    return head + data, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


@pytest.mark.stack
def test_the_guard_forwards_good_requests_and_refuses_bad_ones_on_one_connection(guard):
    port, _ = guard
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    good, headers = infer_body({"inputs": [spec()]}, b"\0" * 80)
    bad, bad_headers = infer_body({"inputs": [spec(shape=(64, 100_000_000_000), binary=False)]})
    for body, hdrs, status in ((good, headers, 200), (bad, bad_headers, 400), (good, headers, 200)):
        conn.request("POST", "/v2/models/rm/infer", body=body, headers=hdrs)  # one keep-alive connection
        response = conn.getresponse()
        answer = json.loads(response.read())
        assert response.status == status, answer
    assert answer == {"method": "POST", "path": "/v2/models/rm/infer", "bytes": len(good)}
    assert [path for _, path, _ in _Backend.seen] == ["/v2/models/rm/infer"] * 2  # the bad one never got there
    conn.request("GET", "/v2/health/ready")
    assert conn.getresponse().read() and _Backend.seen[-1][:2] == ("GET", "/v2/health/ready")
    conn.close()


@pytest.mark.parametrize("method,path,status,message", [
    ("POST", "/v2/repository/models/rm/unload", 403, "is not served here"),
    ("POST", "/v2/systemsharedmemory/region/x/register", 403, "is not served here"),
    ("POST", "/v2/logging", 403, "is not served here"),
    ("POST", "/v2/models/other/infer", 404, r"unknown model 'other'; this server has \['rm'\]"),
])
def test_routes_that_change_the_server_or_name_no_served_model_are_refused(guard, method, path, status, message):
    port, _ = guard
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, body=b"{}")
    response = conn.getresponse()
    assert response.status == status
    assert re.search(message, json.loads(response.read())["error"])
    assert _Backend.seen == []
    conn.request("GET", "/v2/health/ready")  # the refused request's body was read past: the connection goes on
    assert conn.getresponse().status == 200


def test_an_oversized_body_is_refused_before_it_is_read(guard):
    port, _ = guard
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("POST", "/v2/models/rm/infer")
    conn.putheader("Content-Length", str(1 << 40))
    conn.endheaders()
    response = conn.getresponse()
    assert response.status == 413
    assert "larger than this server takes" in json.loads(response.read())["error"]


def test_compressed_and_chunked_requests_are_refused(guard):
    port, _ = guard
    for headers, status in (({"Content-Encoding": "gzip", "Content-Length": "2"}, 415),
                            ({"Transfer-Encoding": "chunked"}, 411)):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.putrequest("POST", "/v2/models/rm/infer")
        for key, value in headers.items():
            conn.putheader(key, value)
        conn.endheaders(b"{}" if "Content-Length" in headers else None)
        assert conn.getresponse().status == status
        conn.close()
    assert _Backend.seen == []


def test_a_stopped_backend_is_a_503_not_a_hang(guard):
    port, backend = guard
    backend.shutdown()
    backend.server_close()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/v2/health/ready")
    response = conn.getresponse()
    assert response.status == 503
    assert "not serving" in json.loads(response.read())["error"]
