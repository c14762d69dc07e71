"""Text generation over HTTP with NeMo's REST protocol (``megatron_gpt_eval.py server=True``): ``PUT
/generate`` with a JSON body ``{"sentences": [...], "tokens_to_generate": 64, ...}`` answers
``{"sentences": [prompt + response, ...]}`` (with ``compute_logprob``, also ``"logprob"``: each sentence's
per-token log-probabilities). NeMo-Aligner's Constitutional AI scripts talk to such a server.

Rank 0 listens; each request is passed to every rank (generation is collective over model
parallelism), computed, and answered by rank 0. Requests are checked before any work: a bad one gets
``400`` with one line naming the field.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Dict, List, Optional

from nemo_aligner.utils.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_SENTENCES = 128  # NeMo's limit per request
MAX_BODY_BYTES = 16 * 2 ** 20
# NeMo's request keys; task_ids/neighbors (prompt tuning, retrieval) have no use here and are refused.
DEFAULTS = {"tokens_to_generate": 64, "temperature": 1.0, "add_BOS": False, "top_k": 0, "top_p": 0.0,
            "greedy": False, "all_probs": False, "repetition_penalty": 1.0, "min_tokens_to_generate": 0,
            "end_strings": ["<|endoftext|>"], "compute_logprob": False, "random_seed": None}
_STOP = "stop"


class RequestError(ValueError):
    """A request this server refuses (HTTP 400)."""


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, DEFAULTS[key])
    if not isinstance(value, bool):
        raise RequestError(f"{key} must be true or false, got {value!r}")
    return value


def _number(body: dict, key: str, low: float, integer: bool = False, high: float = math.inf) -> float:
    value = body.get(key, DEFAULTS[key])
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"{key} must be {kind} in [{low}, {high}], got {value!r}")
    return value


def _check_unicode(key: str, texts: List[str]) -> None:
    """JSON's ``\\ud800`` escapes decode to lone surrogates, which no tokenizer can encode."""
    for i, text in enumerate(texts):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(f"{key}[{i}] is not valid Unicode text (a lone surrogate at character {err.start})") \
                from None


def parse_request(raw: bytes, max_tokens: int) -> Dict:
    """The generation settings of a ``PUT /generate`` body, checked (``RequestError`` names the field)."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RequestError(f"the body is not JSON ({err})") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object with a 'sentences' list")
    unknown = sorted(set(body) - set(DEFAULTS) - {"sentences"})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r} (fields: sentences, {', '.join(DEFAULTS)})")
    sentences = body.get("sentences")
    if isinstance(sentences, str):
        sentences = [sentences]
    if not isinstance(sentences, list) or not sentences or not all(isinstance(s, str) and s for s in sentences):
        raise RequestError("sentences must be a non-empty list of non-empty strings (format chat turns into text "
                           "with your prompt template first)")
    if len(sentences) > MAX_SENTENCES:
        raise RequestError(f"at most {MAX_SENTENCES} sentences per request, got {len(sentences)}")
    _check_unicode("sentences", sentences)
    request = {"sentences": sentences,
               "tokens_to_generate": int(_number(body, "tokens_to_generate", 0, True, max_tokens)),
               "min_tokens_to_generate": int(_number(body, "min_tokens_to_generate", 0, True, max_tokens)),
               "temperature": float(_number(body, "temperature", 1e-9)),
               "top_k": int(_number(body, "top_k", 0, True)), "top_p": float(_number(body, "top_p", 0.0, high=1.0)),
               "greedy": _bool(body, "greedy"), "compute_logprob": _bool(body, "compute_logprob")}
    if _bool(body, "add_BOS"):
        raise RequestError("add_BOS=true is not supported: prompts are used as given")
    if _bool(body, "all_probs"):
        raise RequestError("all_probs=true is not supported (compute_logprob gives the chosen tokens' log-probs)")
    if float(_number(body, "repetition_penalty", 0.0)) != 1.0:
        raise RequestError("repetition_penalty other than 1.0 is not supported: use temperature/top_k/top_p")
    ends = body.get("end_strings", DEFAULTS["end_strings"])
    ends = [ends] if isinstance(ends, str) else ends
    if not isinstance(ends, list) or not all(isinstance(e, str) for e in ends):
        raise RequestError("end_strings must be a list of strings")
    _check_unicode("end_strings", ends)
    request["end_strings"] = [e for e in ends if e]
    seed = body.get("random_seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"random_seed must be an integer, got {seed!r}")
    request["random_seed"] = seed
    if request["min_tokens_to_generate"] > request["tokens_to_generate"]:
        raise RequestError("min_tokens_to_generate is larger than tokens_to_generate")
    return request


def _broadcast(obj):
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def serve_text_generation(compute: Callable[[Dict], Dict], host: str, port: int, max_tokens: int,
                          stop: Optional[threading.Event] = None, ready: Optional[Callable[[], None]] = None) -> None:
    """Serve ``compute(request) -> response`` (collective: every rank runs it) until ``stop`` is set
    (rank 0's SIGTERM/SIGINT set it in the scripts); returns on every rank."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    stop = stop or threading.Event()
    if rank != 0:
        while True:
            request = _broadcast(None)
            if request == _STOP:
                return
            try:
                compute(request)
            except Exception:  # rank 0 answers the request (and logs a failure); this rank serves on as it does
                logger.debug("request failed on this rank", exc_info=True)
    lock = threading.Lock()
    work: List = []
    wake = threading.Condition()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload) -> None:
            data = json.dumps(payload).encode("utf-8") if not isinstance(payload, str) else payload.encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json" if not isinstance(payload, str) else "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_PUT(self):  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") != "/generate":
                return self._reply(404, f"no such endpoint {self.path}; use PUT /generate")
            try:
                length = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                return self._reply(400, "Content-Length is not a number")
            if not 0 < length <= MAX_BODY_BYTES:
                return self._reply(400 if length <= 0 else 413, f"the body must hold 1 to {MAX_BODY_BYTES} bytes")
            try:
                request = parse_request(self.rfile.read(length), max_tokens)
            except RequestError as err:
                return self._reply(400, str(err))
            done = threading.Event()
            item = {"request": request, "done": done}
            with wake:
                work.append(item)
                wake.notify()
            done.wait()
            if "error" in item:
                return self._reply(item.get("status", 500), item["error"])
            return self._reply(200, item["response"])

        do_POST = do_PUT

        def log_message(self, fmt, *args):  # requests go to the log, not stderr
            logger.debug("%s %s", self.address_string(), fmt % args)

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as err:  # taken since it was checked, or not this machine's address
        raise ConfigError(f"cannot serve on {host}:{port} ({getattr(err, 'strerror', None) or err}); choose another "
                          "host or port") from None
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    logger.info("text generation server on http://%s:%d/generate", host, port)
    if ready is not None:
        ready()
    try:
        while not stop.is_set():
            with wake:
                if not work:
                    wake.wait(timeout=0.2)
                    continue
                item = work.pop(0)
            with lock:
                try:
                    item["response"] = compute(_broadcast(item["request"]))
                except RequestError as err:
                    item["error"], item["status"] = str(err), 400
                except Exception as err:  # a failure of one request is that request's answer
                    logger.exception("generation failed")
                    item["error"] = f"generation failed: {type(err).__name__}: {err}"
            item["done"].set()
    finally:
        server.shutdown()
        server.server_close()
        _broadcast(_STOP)
