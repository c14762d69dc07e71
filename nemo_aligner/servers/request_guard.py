"""An HTTP front for tritonserver that checks each request before Triton sees it.

tritonserver allocates memory for the shape an inference request declares before any model code
runs, so one small request declaring ``[64, 100000000000]`` aborts it (``std::bad_alloc``). The
guard listens on the configured host and port, reads each request's JSON header, refuses what
exceeds the server's configured limits (rows, elements per row, body size), what is empty, and any
route that changes the server (model load/unload, shared-memory registration, logging and trace
settings), and forwards the rest to tritonserver, which listens on 127.0.0.1 only.

Refusals use Triton's error format (``{"error": "..."}`` with a 4xx status), so Triton clients
raise them like any server error.
"""

from __future__ import annotations

import http.client
import json
import logging
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Mapping, Optional

logger = logging.getLogger(__name__)

# Bytes per element of Triton's fixed-size datatypes (BYTES elements are length-prefixed strings).
_ITEM_SIZE = {"BOOL": 1, "UINT8": 1, "UINT16": 2, "UINT32": 4, "UINT64": 8, "INT8": 1, "INT16": 2, "INT32": 4,
              "INT64": 8, "FP16": 2, "BF16": 2, "FP32": 4, "FP64": 8}
# A JSON-encoded number takes at most this many bytes; BYTES elements are bounded by the body size alone.
_JSON_BYTES_PER_ELEMENT = 24
# Room for the JSON header, names and parameters of a request, beyond its tensor data.
_HEADER_ALLOWANCE = 1 << 20

_INFER = re.compile(r"^/v2/models/([^/]+)(?:/versions/[^/]+)?/infer$")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length"}


@dataclass(frozen=True)
class ModelLimits:
    """The largest request a served model takes: ``max_rows`` along the first dimension (the batch,
    or a ``critic_train`` request's rows) and ``max_row_elements`` in each row of every input."""

    max_rows: int
    max_row_elements: int
    row_elements_why: str = ""  # where max_row_elements comes from, for the refusal's message

    def max_body_bytes(self, inputs: int) -> int:
        return inputs * self.max_rows * self.max_row_elements * _JSON_BYTES_PER_ELEMENT + _HEADER_ALLOWANCE


class BadRequest(ValueError):
    """Why a request is refused (the message the client gets)."""


def check_infer_header(model: str, header: Mapping, limits: ModelLimits, data_bytes: int) -> None:
    """Refuse an inference request header whose tensors exceed ``limits`` or are empty, or whose
    binary data sizes do not add up to the ``data_bytes`` that follow the header."""
    if not isinstance(header, Mapping):
        raise BadRequest("the request body must be a JSON object")
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise BadRequest(f"{model}: the request has no inputs")
    binary_total = 0
    for i, spec in enumerate(inputs):
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise BadRequest(f"{model}: inputs[{i}] has no name")
        name, shape, datatype = spec["name"], spec.get("shape"), spec.get("datatype")
        if (not isinstance(shape, list) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
            raise BadRequest(f"{model}: input {name!r} needs a shape of integers, got {shape!r}")
        if any(d < 0 for d in shape):
            raise BadRequest(f"{model}: input {name!r} has a negative dimension in shape {shape}")
        if shape[0] == 0 or any(d == 0 for d in shape[1:]):
            raise BadRequest(f"{model}: input {name!r} is empty (shape {shape})")
        if shape[0] > limits.max_rows:
            raise BadRequest(f"{model}: input {name!r} has {shape[0]} rows, more than this server takes "
                             f"({limits.max_rows})")
        row = 1
        for d in shape[1:]:
            row *= d
            if row > limits.max_row_elements:
                why = f" ({limits.row_elements_why})" if limits.row_elements_why else ""
                raise BadRequest(f"{model}: input {name!r} of shape {shape} has more than "
                                 f"{limits.max_row_elements} elements per row, more than this server takes{why}")
        if not isinstance(datatype, str):
            raise BadRequest(f"{model}: input {name!r} has no datatype")
        size = (spec.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise BadRequest(f"{model}: input {name!r} has binary_data_size={size!r}")
            itemsize = _ITEM_SIZE.get(datatype)
            if itemsize is not None and size != shape[0] * row * itemsize:
                raise BadRequest(f"{model}: input {name!r} declares shape {shape} of {datatype} "
                                 f"({shape[0] * row * itemsize} bytes) but binary_data_size={size}")
            binary_total += size
    if binary_total != data_bytes:
        raise BadRequest(f"{model}: the inputs' binary_data_size add up to {binary_total} bytes, but "
                         f"{data_bytes} bytes follow the JSON header")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # headers and body go out in separate writes: with Nagle's algorithm the body would wait for
    # the client's delayed ACK of the headers (40 ms on Linux) on every answer
    disable_nagle_algorithm = True
    server: "_GuardServer"

    def log_message(self, fmt, *args):  # the default writes every request to stderr
        logger.debug("request guard: " + fmt, *args)

    # ------------------------------------------------------------------ routes
    def do_GET(self):
        # Health, metadata, config, statistics and repository index: read-only.
        self._forward(None)

    def do_POST(self):
        if self.headers.get("Transfer-Encoding"):
            return self._refuse(411, "send the request with a Content-Length, not chunked", close=True)
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return self._refuse(400, "Content-Length is not a number", close=True)
        if length < 0:
            return self._refuse(400, f"Content-Length={length}", close=True)
        infer = _INFER.match(self.path.split("?", 1)[0])
        if infer is None and self.path.split("?", 1)[0] != "/v2/repository/index":
            return self._refuse_unread(length, 403, f"POST {self.path} is not served here (only inference requests)")
        encoding = (self.headers.get("Content-Encoding") or "identity").lower()
        if encoding != "identity":
            return self._refuse_unread(length, 415,
                                       f"compressed requests (Content-Encoding: {encoding}) are not accepted")
        model = infer.group(1) if infer else None
        limits = self.server.limits.get(model) if model else None
        if model is not None and limits is None:
            return self._refuse_unread(length, 404,
                                       f"unknown model {model!r}; this server has {sorted(self.server.limits)}")
        max_body = limits.max_body_bytes(self.server.max_inputs) if limits else _HEADER_ALLOWANCE
        if length > max_body:
            return self._refuse(413, f"a request of {length} bytes is larger than this server takes ({max_body})",
                                close=True)
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            return
        if model is not None:
            try:
                self._check_infer(model, limits, body)
            except BadRequest as err:
                return self._refuse(400, str(err))
        self._forward(body)

    def _check_infer(self, model: str, limits: ModelLimits, body: bytes) -> None:
        header_length = self.headers.get("Inference-Header-Content-Length")
        try:
            split = int(header_length) if header_length is not None else len(body)
        except ValueError:
            raise BadRequest("Inference-Header-Content-Length is not a number") from None
        if not 0 < split <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length={header_length} does not fit the {len(body)}-byte body")
        try:
            header = json.loads(body[:split])
        except (ValueError, UnicodeDecodeError) as err:
            raise BadRequest(f"the request header is not JSON ({err})") from None
        check_infer_header(model, header, limits, len(body) - split)

    # ------------------------------------------------------------------ plumbing
    def _refuse(self, status: int, message: str, close: bool = False) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if close:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(payload)

    def _refuse_unread(self, length: int, status: int, message: str) -> None:
        """Refuse a request whose body is still unread: a small body is read past so that the
        connection can carry the next request; a large one ends the connection."""
        if length <= _HEADER_ALLOWANCE:
            self.rfile.read(length)
            return self._refuse(status, message)
        return self._refuse(status, message, close=True)

    def _forward(self, body: Optional[bytes]) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        try:
            backend = getattr(self, "_backend", None)
            if backend is None:
                backend = self._backend = http.client.HTTPConnection("127.0.0.1", self.server.backend_port)
            backend.request(self.command, self.path, body=body, headers=headers)
            response = backend.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException):
            self._backend = None
            return self._refuse(503, "the server is not serving (tritonserver is not reachable)", close=True)
        self.send_response(response.status, response.reason)
        for key, value in response.getheaders():
            if key.lower() not in _HOP_BY_HOP:
                self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def finish(self):
        backend = getattr(self, "_backend", None)
        if backend is not None:
            backend.close()
        super().finish()


class _GuardServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, backend_port: int, limits: Dict[str, ModelLimits], max_inputs: int):
        self.backend_port = backend_port
        self.limits = dict(limits)
        self.max_inputs = max_inputs
        super().__init__(address, _Handler)

    def handle_error(self, request, client_address):  # a client that hangs up mid-request
        logger.debug("request guard: connection from %s ended with an error", client_address, exc_info=True)


class RequestGuard:
    """Listens on ``host:port`` and forwards checked requests to tritonserver on ``127.0.0.1:backend_port``.

    ``limits``: per served model name; requests for other models are refused. ``max_inputs``: the
    most inputs any served model has (bounds a request's body size).
    """

    def __init__(self, host: str, port: int, backend_port: int, limits: Dict[str, ModelLimits], max_inputs: int = 4):
        self._server = _GuardServer((host, port), backend_port, limits, max_inputs)
        self._thread = threading.Thread(target=self._server.serve_forever, name="request-guard", daemon=True)

    def start(self) -> "RequestGuard":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
