"""The reward-model PyTriton server, started as a subprocess on free ports: same rewards as the
model in this process, concurrent clients, bad requests, unreachable servers, clean shutdown,
and TP=2 / DP=2 / EP=2 serving."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from omegaconf import OmegaConf

from conftest import SCRIPTS, TINY_ARCH, ServerProcess, free_port, subprocess_env
from nemo_aligner.utils.tokenizers import ByteTokenizer

TEXTS = ["reverse abc = cba", "reverse abc = bca", "sort cab = abc", "sort cab = acb", "reverse ab = ba",
         "sort hgfedcba = abcdefgh", "reverse h = h", "sort ba = ab", "reverse abcdefgh = hgfedcba"]


@pytest.fixture(scope="module")
def rm_nemo_and_rewards(tmp_path_factory, mcore_single):
    """A small reward model saved as a .nemo, and the rewards this process computes for TEXTS."""
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.utils.nemo_file import save_nemo

    torch.manual_seed(11)
    cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=2, encoder_seq_length=32))
    model = MegatronGPTRewardModel(cfg, ByteTokenizer(), trainable=False)
    path = save_nemo(model, str(tmp_path_factory.mktemp("rm") / "rm.nemo"))
    model.prepare_for_inference()
    return path, {text: score(model, [text])[0] for text in TEXTS}


def score(model, texts):
    tok = model.tokenizer
    ids = [tok.text_to_ids(t) + [tok.eos_id] for t in texts]
    width = max(map(len, ids))
    tokens = torch.full((len(ids), width), tok.eos_id)
    for i, seq in enumerate(ids):
        tokens[i, : len(seq)] = torch.tensor(seq)
    return model.infer(tokens, torch.tensor([len(s) for s in ids])).tolist()


class Server(ServerProcess):
    """serve_reward_model.py on free ports, its workspace in a short temporary directory."""

    def __init__(self, tmp_path, nemo, nproc=1, extra=()):
        super().__init__(tmp_path, "serve_reward_model.py", "reward model server ready", nproc=nproc)
        self.start([f"rm_model_file={nemo}", f"inference.port={self.port}", f"inference.grpc_port={free_port()}",
                    f"inference.metrics_port={free_port()}", f"inference.workspace_dir={self.workspace}",
                    "inference.micro_batch_size=2", *extra])


@pytest.fixture(scope="module")
def server(tmp_path_factory, rm_nemo_and_rewards):
    nemo, _ = rm_nemo_and_rewards
    with Server(tmp_path_factory.mktemp("srv"), nemo) as srv:
        yield srv


def client(port, **kwargs):
    from nemo_aligner.servers.clients import RemoteGPTRMClient

    return RemoteGPTRMClient("127.0.0.1", port, tokenizer=ByteTokenizer(), timeout_s=30, **kwargs)


def test_rewards_equal_in_process_model(server, rm_nemo_and_rewards):
    _, expected = rm_nemo_and_rewards
    with client(server.port) as c:
        got = c.infer_texts(TEXTS).result()  # 9 rows: padded to a multiple of the micro-batch, then trimmed
    assert got.shape == (len(TEXTS),)
    np.testing.assert_allclose(got, [expected[t] for t in TEXTS], rtol=1e-5, atol=1e-5)


def test_eight_concurrent_clients(server, rm_nemo_and_rewards):
    _, expected = rm_nemo_and_rewards
    results, errors = {}, []

    def work(i):
        try:
            texts = [TEXTS[(i + k) % len(TEXTS)] for k in range(1 + i % 3)]
            with client(server.port) as c:
                futures = [c.infer_texts(texts) for _ in range(3)]
                results[i] = (texts, [f.result() for f in futures])
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(results) == 8
    for texts, answers in results.values():
        for answer in answers:
            np.testing.assert_allclose(answer, [expected[t] for t in texts], rtol=1e-5, atol=1e-5)


def test_sentences_only_requests_are_tokenized_by_the_server(server, rm_nemo_and_rewards):
    """NeMo-Aligner's text clients (``attribute_annotate.py``) send only ``sentences``: the server
    tokenizes them as the model was trained (EOS appended) and scores them like token requests."""
    _, expected = rm_nemo_and_rewards
    texts = TEXTS[:5]
    with client(server.port) as c:
        got = c.send("rewards", sentences=np.array([[t.encode()] for t in texts], dtype=object)).result()
    np.testing.assert_allclose(np.asarray(got).reshape(-1), [expected[t] for t in texts], rtol=1e-5, atol=1e-5)


BAD_REQUESTS = {
    "nothing-to-score": (dict(sequence_lengths=np.array([[3]])), r"needs tokens and sequence_lengths, or sentences"),
    "sentences-not-utf8": (dict(sentences=np.array([[b"\xff\xfe"]], dtype=object)),
                           r"sentences\[0\] is not UTF-8"),
    "wrong-dtype": (dict(tokens=np.ones((1, 4), dtype=np.float32), sequence_lengths=np.array([[4]])),
                    r"FP32.*INT64"),
    "wrong-rank": (dict(tokens=np.ones((2, 3, 4), dtype=np.int64), sequence_lengths=np.array([[4], [4]])),
                   r"shape|dims|rank"),
    "batch-too-large": (dict(tokens=np.ones((65, 4), dtype=np.int64), sequence_lengths=np.full((65, 1), 4)),
                        r"batch|65|64"),
    "missing-input": (dict(tokens=np.ones((2, 4), dtype=np.int64)), r"sequence_lengths"),
    "empty-batch": (dict(tokens=np.ones((0, 4), dtype=np.int64), sequence_lengths=np.ones((0, 1), dtype=np.int64)),
                    r"input 'tokens' is empty \(shape \[0, 4\]\)"),
    "lengths-beyond-width": (dict(tokens=np.ones((1, 3), dtype=np.int64), sequence_lengths=np.array([[9]])),
                             r"sequence_lengths must be within 1\.\.3"),
    "lengths-rows-mismatch": (dict(tokens=np.ones((2, 3), dtype=np.int64), sequence_lengths=np.array([[3]])),
                              r"sequence_lengths|shape|batch"),
    # an id outside the embedding failed inside the forward (a 2-process server went down with it)
    "token-id-beyond-the-vocabulary": (dict(tokens=np.array([[5, 100000, 7]]), sequence_lengths=np.array([[3]])),
                                       r"token ids must be within 0\.\.383 \(the model's vocabulary\), got 5\.\.100000"),
    # RoPE, trained on 32 tokens: 4x that by default (inference.max_sequence_length), before any forward
    "wider-than-the-limit": (dict(tokens=np.ones((1, 129), dtype=np.int64), sequence_lengths=np.array([[129]])),
                             r"a sequence of 129 tokens is longer than the model's 128"),
    "negative-token-id": (dict(tokens=np.array([[5, -5, 7]]), sequence_lengths=np.array([[3]])),
                          r"token ids must be within 0\.\.383"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_answered_and_the_server_keeps_serving(server, rm_nemo_and_rewards, case):
    from nemo_aligner.servers.clients import RemoteServerError

    _, expected = rm_nemo_and_rewards
    inputs, message = BAD_REQUESTS[case]
    with client(server.port) as c:
        with pytest.raises(RemoteServerError, match=r"127\.0\.0\.1:\d+") as err:
            c.send("rewards", **inputs).result()
        assert re.search(message, str(err.value), re.IGNORECASE), str(err.value)
        np.testing.assert_allclose(c.infer_texts(TEXTS[:2]).result(), [expected[t] for t in TEXTS[:2]], rtol=1e-5,
                                   atol=1e-5)
    assert server.proc.poll() is None


_HUGE = {"inputs": [{"name": "tokens", "shape": [64, 100_000_000_000], "datatype": "INT64", "data": [1]},
                   {"name": "sequence_lengths", "shape": [64, 1], "datatype": "INT64", "data": [1] * 64}]}
CRAFTED_REQUESTS = {  # method, path, body, status, message (the server's inputs.max_sequence_length: 128)
    "huge-declared-shape": ("POST", "/v2/models/reward_model/infer", json.dumps(_HUGE), 400,
                            "more than 512 elements per row, more than this server takes (4 x the 128 tokens it "
                            "scores; a client's pad_to_length (remote_critic_rm, remote_rm) must not exceed that)"),
    "model-unload": ("POST", "/v2/repository/models/reward_model/unload", "{}", 403, "not served here"),
    "header-not-json": ("POST", "/v2/models/reward_model/infer", "{not json", 400, "not JSON"),
}


def test_crafted_http_requests_are_refused_before_triton_sees_them(server, rm_nemo_and_rewards):
    """tritonserver allocates for the shape a request declares, so a small request declaring a [64, 1e11]
    tensor would abort it: the request guard refuses it, and routes that change the server, with a 4xx."""
    import http.client

    _, expected = rm_nemo_and_rewards
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for method, path, body, status, message in CRAFTED_REQUESTS.values():
        conn.request(method, path, body=body.encode())
        response = conn.getresponse()
        assert response.status == status
        assert message in json.loads(response.read())["error"]
    conn.close()
    with client(server.port) as c:
        np.testing.assert_allclose(c.infer_texts(TEXTS[:2]).result(), [expected[t] for t in TEXTS[:2]], rtol=1e-5,
                                   atol=1e-5)
    assert server.proc.poll() is None


def loopback(ip: str) -> bool:
    import ipaddress

    address = ipaddress.ip_address(ip)
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)


def test_only_the_guarded_http_port_listens_beyond_loopback(tmp_path, rm_nemo_and_rewards):
    """``inference.host=0.0.0.0``: the request guard listens there; tritonserver's HTTP, gRPC and metrics
    ports (and every other socket of the job) listen on 127.0.0.1 only."""
    nemo, expected = rm_nemo_and_rewards
    srv = Server(tmp_path, nemo, extra=["inference.host=0.0.0.0"])
    try:
        srv.wait_ready()
        listening = [(p.pid, c.laddr.ip, c.laddr.port) for p in [psutil.Process(srv.proc.pid), *srv.children]
                     if p.is_running() for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert ("0.0.0.0", srv.port) in {(ip, port) for _, ip, port in listening}, listening
        beyond_loopback = [entry for entry in listening if not loopback(entry[1])]
        assert [entry[2] for entry in beyond_loopback] == [srv.port], (beyond_loopback, listening)
        with client(srv.port) as c:
            np.testing.assert_allclose(c.infer_texts(TEXTS[:1]).result(), [expected[TEXTS[0]]], rtol=1e-5, atol=1e-5)
    finally:
        srv.stop()
        srv.cleanup()
    assert srv.proc.returncode == 0, srv.text()[-3000:]


def test_closed_port_fails_fast():
    from nemo_aligner.servers.clients import RemoteServerError

    port = free_port()
    start = time.time()
    with pytest.raises(RemoteServerError, match=rf"127\.0\.0\.1:{port}.*remote_rm\.ip and remote_rm\.port"):
        client(port)
    assert time.time() - start < 5


def test_port_in_use_is_named(tmp_path, rm_nemo_and_rewards, server):
    nemo, _ = rm_nemo_and_rewards
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, "serve_reward_model.py"), f"rm_model_file={nemo}",
                           f"inference.port={server.port}"], env=subprocess_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert f"error: inference.port={server.port} on 127.0.0.1 is already in use" in proc.stderr


def test_shutdown_leaves_nothing_behind(tmp_path, rm_nemo_and_rewards):
    """SIGTERM, then more stop signals while the server shuts down (Ctrl-C pressed again, a launcher
    signalling twice): the shutdown finishes, exits 0, prints no traceback and leaves nothing behind."""
    import signal

    nemo, expected = rm_nemo_and_rewards
    srv = Server(tmp_path, nemo)
    try:
        srv.wait_ready()
        assert any("tritonserver" in " ".join(p.cmdline()) for p in srv.children if p.is_running())
        assert os.listdir(srv.workspace)  # the workspace lives where it was told to
        os.kill(srv.proc.pid, signal.SIGTERM)
        # tritonserver takes seconds to stop: these arrive during the shutdown's clean-up
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            time.sleep(0.3)
            if "server stopped" in srv.text() or srv.proc.poll() is not None:
                break
            os.kill(srv.proc.pid, sig)
        srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, srv.text()[-3000:]
    assert "Traceback" not in srv.text() and "KeyboardInterrupt" not in srv.text(), srv.text()[-3000:]
    # tritonserver's own output stays out of the server's (its log records go to its log file)
    assert "Failed to initialize NVML" not in srv.text() and "Signal (" not in srv.text(), srv.text()[-3000:]
    time.sleep(1)
    assert not [p for p in srv.children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert os.listdir(srv.workspace) == []
    srv.cleanup()


def test_stop_signals_raise_only_before_serving():
    """Before serving, a stop signal stops the start-up (KeyboardInterrupt); while serving, signals are
    only noted: one the caller defers (the critic's drain) keeps serving, the next ends it, later ones
    change nothing and raise nothing (they would land in the shutdown's clean-up)."""
    import signal

    from nemo_aligner.servers.triton_host import serve_until_stopped, stop_on_signals

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with stop_on_signals():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    decisions = [False, True]

    class Triton:
        polls = 0

        def is_alive(self):
            self.polls += 1
            if self.polls in (2, 4):  # the deferred SIGTERM, then the one that stops
                os.kill(os.getpid(), signal.SIGTERM)
            return True

    triton = Triton()
    with stop_on_signals(stop_on_sigterm=lambda: decisions.pop(0)) as stop:
        serve_until_stopped(triton, stop, poll_s=0.01)
        assert stop.received and triton.polls == 4 and decisions == []
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(os.getpid(), sig)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_dead_triton_process_makes_the_server_exit_non_zero(tmp_path, rm_nemo_and_rewards):
    """tritonserver killed under the server (an abort, the OOM killer): the server says so in one line
    and exits 1, instead of exiting 0 as if stopped."""
    import signal

    nemo, _ = rm_nemo_and_rewards
    srv = Server(tmp_path, nemo)
    try:
        srv.wait_ready()
        triton = [p for p in srv.children if "tritonserver" in " ".join(p.cmdline())]
        assert triton
        os.kill(triton[0].pid, signal.SIGKILL)
        srv.proc.wait(timeout=60)
    finally:
        srv.stop()
        srv.cleanup()
    assert srv.proc.returncode == 1, srv.text()[-3000:]
    assert "Triton stopped serving without a stop signal (its process died)" in srv.text()


def own_tritonservers():
    """This process's live tritonserver children (in-process servers' Triton)."""
    return [p for p in psutil.Process().children()
            if "tritonserver" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]


def test_tritonserver_exiting_at_start_is_reported_at_once(monkeypatch, recwarn):
    """tritonserver exits while PyTriton waits for it to be ready (here: its gRPC port taken after the
    server checked it): one error quoting Triton's reason within seconds, not PyTriton's 120 s
    timeout, no process left behind, and no warning trailing the error (PyTriton's exit callback
    cleans its workspace from another thread)."""
    import socket

    from nemo_aligner.servers import triton_host
    from nemo_aligner.utils.errors import ServerError

    monkeypatch.setattr(triton_host, "check_ports_free", lambda address, key: None)  # taken after the check
    grpc = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", grpc))
        taken.listen()
        start = time.monotonic()
        with pytest.raises(ServerError) as err:
            triton_host.serve_forever(triton_host.ServerAddress("127.0.0.1", free_port(), grpc, free_port()),
                                      lambda triton: pytest.fail("bound models to a dead server"), "test server",
                                      "inference", {})
        elapsed = time.monotonic() - start
    assert elapsed < 30, elapsed
    message = str(err.value)
    assert message.startswith("test server: tritonserver exited while starting (exit status 1): "), message
    assert f"127.0.0.1:{grpc}' already in use" in message, message
    time.sleep(0.5)
    # this process's own tritonserver (the other tests' servers run theirs under their own processes)
    assert not own_tritonservers()
    assert not [str(w.message) for w in recwarn if "Could not clean workspace" in str(w.message)]


@pytest.mark.parametrize("when", ["before_bind", "during_load"])
def test_tritonserver_dying_while_models_are_bound_is_one_error(monkeypatch, when):
    """tritonserver killed before a model is bound (PyTriton would wait 120 s for it to be ready) or while
    the model loads (the load request fails under the HTTP client): one ServerError naming the signal
    within seconds, not a traceback; SIGKILL (the OOM killer, a user) is not a crash to start again after."""
    import signal

    import numpy as np
    import tritonclient.http
    from pytriton.model_config import ModelConfig, Tensor

    from nemo_aligner.servers import triton_host
    from nemo_aligner.utils.errors import ServerError

    def kill_tritonserver():
        mine = own_tritonservers()
        assert len(mine) == 1
        os.kill(mine[0].pid, signal.SIGKILL)  # reaped by PyTriton's process handle, which reads its status

    if when == "during_load":
        load = tritonclient.http.InferenceServerClient.load_model

        def killing_load(self, *args, **kwargs):
            kill_tritonserver()
            return load(self, *args, **kwargs)

        monkeypatch.setattr(tritonclient.http.InferenceServerClient, "load_model", killing_load)

    binds = []

    def bind(triton):
        binds.append(triton)
        if when == "before_bind":
            kill_tritonserver()
        triton.bind(model_name="reward_model", infer_func=lambda requests: [],
                    inputs=[Tensor(name="tokens", dtype=np.int64, shape=(-1,))],
                    outputs=[Tensor(name="rewards", dtype=np.float32, shape=(1,))], config=ModelConfig(max_batch_size=8))

    start = time.monotonic()
    with pytest.raises(ServerError) as err:
        triton_host.serve_forever(triton_host.ServerAddress("127.0.0.1", free_port(), free_port(), free_port()), bind,
                                  "test server", "inference", {})
    assert time.monotonic() - start < 30  # not after PyTriton's 120 s wait for a ready server
    message = str(err.value)
    assert message.startswith("test server: tritonserver exited while starting (killed by signal 9)"), message
    assert "\n" not in message and "CudaDriverHelper" not in message
    assert len(binds) == 1 and not isinstance(err.value, triton_host.CrashedWhileStarting)
    time.sleep(0.5)
    assert not own_tritonservers()


@pytest.mark.parametrize("code,kind", [(-6, "crash"), (-11, "crash"), (-7, "crash"), (-9, "error"), (-15, "error"),
                                       (1, "error")])
def test_start_failures_quote_the_crash_and_only_crashes_are_retried(tmp_path, code, kind):
    """A crash's error quotes what Triton printed (the uncaught exception and the signal), not its
    backtrace's frames; only SIGABRT, SIGSEGV and SIGBUS count as crashes worth a second start."""
    from types import SimpleNamespace

    from nemo_aligner.servers import triton_host
    from nemo_aligner.utils.errors import ServerError

    output = ("Error: Failed to initialize NVML\n"
              "I1207 21:24:10.497463 12380 pb_stub.cc:2145]  Non-graceful termination detected.\n"
              "terminate called after throwing an instance of 'boost::interprocess::lock_exception'\n"
              "  what():  boost::interprocess::lock_exception\n"
              "Signal (6) received.\n"
              " 0# 0x000055FFFD0F252D in /tmp/pytriton_1_x/workspace/tritonserver/bin/tritonserver\n"
              "14# TRITONBACKEND_ModelInstanceFinalize in /tmp/x/backends/python/libtriton_python.so\n")
    server = SimpleNamespace(logs=lambda: output,
                             _tritonserver_running_cmd=SimpleNamespace(process=SimpleNamespace(exit_code=code)))
    error = triton_host._start_failure(server, "critic server", str(tmp_path / "absent.log"), "")
    assert isinstance(error, ServerError)
    assert isinstance(error, triton_host.CrashedWhileStarting) == (kind == "crash")
    status = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
    assert str(error) == (f"critic server: tritonserver exited while starting ({status}): terminate called after "
                          "throwing an instance of 'boost::interprocess::lock_exception' | what():  "
                          "boost::interprocess::lock_exception | Signal (6) received.")


@pytest.mark.parametrize("crashes", [1, 2])
def test_tritonserver_crashing_while_starting_is_started_once_more(monkeypatch, caplog, crashes):
    """tritonserver aborting while the models are bound (as its Python backend does now and then when
    several servers start on a few busy cores): started once more in a fresh workspace, with a warning
    naming the signal; a second crash is the one-line error."""
    import signal

    import numpy as np
    from pytriton.model_config import ModelConfig, Tensor

    from nemo_aligner.servers import triton_host
    from nemo_aligner.utils.errors import ServerError

    from nemo_aligner.servers.leftovers import stub_processes

    starts, workspaces, served = [], [], []

    def bind(triton):
        starts.append(own_tritonservers()[0].pid)
        workspaces.append(os.environ["PYTRITON_HOME"])
        if len(starts) <= crashes:
            os.kill(starts[-1], signal.SIGABRT)
        triton.bind(model_name="reward_model", infer_func=lambda requests: [],
                    inputs=[Tensor(name="tokens", dtype=np.int64, shape=(-1,))],
                    outputs=[Tensor(name="rewards", dtype=np.float32, shape=(1,))], config=ModelConfig(max_batch_size=8))

    def serve_until_stopped(triton, stop):
        served.append(triton.is_alive())
        stop.received = True  # as a SIGTERM once serving

    monkeypatch.setattr(triton_host, "serve_until_stopped", serve_until_stopped)
    address = triton_host.ServerAddress("127.0.0.1", free_port(), free_port(), free_port())
    with caplog.at_level("WARNING", logger=triton_host.__name__):
        if crashes == 1:
            triton_host.serve_forever(address, bind, "test server", "inference", {})
        else:
            with pytest.raises(ServerError, match=r"^test server: tritonserver exited while starting "
                                                  r"\(killed by signal 6\)[^\n]*$"):
                triton_host.serve_forever(address, bind, "test server", "inference", {})
    assert len(starts) == 2 and starts[0] != starts[1] and workspaces[0] != workspaces[1]
    assert served == ([True] if crashes == 1 else [])
    retried = [r.getMessage() for r in caplog.records if "starting it once more" in r.getMessage()]
    assert retried == ["test server: tritonserver exited while starting (killed by signal 6): Signal (6) received.; "
                       "starting it once more"], retried
    time.sleep(0.5)
    assert not own_tritonservers()
    # the crashed tritonserver's Python-backend stubs (left running, holding its sockets) were stopped
    assert not [pid for pid, _, argv in stub_processes(os.getuid()) if f"pytrtion{os.getpid()}-" in " ".join(argv)]


def test_workspace_cleanup_warning_from_another_thread_is_not_shown(tmp_path, monkeypatch, recwarn):
    """PyTriton's exit callback (tritonserver gone by itself) cleans the workspace from its own thread:
    the filter that silences its CleanupWarning holds in every thread, not only inside a block."""
    from pytriton.utils.workspace import Workspace

    from nemo_aligner.servers import triton_host

    triton_host._ignore_workspace_cleanup_warnings()
    workspace = Workspace(tmp_path / "ws")
    monkeypatch.setattr(Workspace, "is_empty", lambda self: False)  # as when a file appears while it cleans
    worker = threading.Thread(target=workspace.clean)
    worker.start()
    worker.join()
    assert not [str(w.message) for w in recwarn if "Could not clean workspace" in str(w.message)]


@pytest.mark.parametrize("layout", [["model.tensor_model_parallel_size=2"], []], ids=["tp2", "dp2"])
def test_two_process_serving(tmp_path, rm_nemo_and_rewards, layout):
    nemo, expected = rm_nemo_and_rewards
    with Server(tmp_path, nemo, nproc=2, extra=layout) as srv, client(srv.port) as c:
        got = c.infer_texts(TEXTS).result()
        got_small = c.infer_texts(TEXTS[:1]).result()
    np.testing.assert_allclose(got, [expected[t] for t in TEXTS], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_small, [expected[TEXTS[0]]], rtol=1e-5, atol=1e-5)
    # torchrun itself exits non-zero (with its own traceback) on SIGTERM; the workers must stop cleanly.
    text = srv.text()
    assert "reward model server stopped" in text and "]: Traceback" not in text, text[-3000:]


def test_request_padding_and_trimming():
    from nemo_aligner.servers.batching import BadRequest, check_request, pad_request

    tokens = np.arange(3 * 10, dtype=np.int64).reshape(3, 10)
    tokens, lengths = check_request(tokens, np.array([[4], [6], [5]]))
    out, lens, real = pad_request(tokens, lengths, pad_id=-1, row_multiple=4, strip_to_multiple=4)
    assert real == 3 and out.shape == (4, 8)  # longest 6 -> width 8; 3 rows -> 4
    assert (out[:3] == tokens[:, :8]).all() and (out[3] == -1).all() and lens.tolist() == [4, 6, 5, 1]
    wide, _, _ = pad_request(tokens[:, :5], np.array([5, 5, 5]), pad_id=-1, row_multiple=1, strip_to_multiple=8)
    assert wide.shape == (3, 8) and (wide[:, 5:] == -1).all()  # rounding up past the width pads
    trimmed, _, real = pad_request(tokens, lengths, pad_id=-1, row_multiple=1)  # no multiple: the longest
    assert real == 3 and trimmed.shape == (3, 6) and (trimmed == tokens[:, :6]).all()
    with pytest.raises(BadRequest, match="3 token rows but 2 sequence_lengths"):
        check_request(tokens, np.array([1, 2]))
    with pytest.raises(BadRequest, match=r"longer than the model's 8"):
        check_request(tokens, np.array([9, 2, 2]), max_seq_length=8)


def test_rope_models_warn_once_past_their_trained_length(caplog):
    """RoPE scores past model.encoder_seq_length without failing: the server says so, once;
    learned positions are refused instead (request_limits), so they need no warning."""
    from omegaconf import OmegaConf

    from nemo_aligner.servers.batching import TrainedLengthWarning

    warn = TrainedLengthWarning(OmegaConf.create({"encoder_seq_length": 64}), "reward model server")
    with caplog.at_level("WARNING", logger="nemo_aligner.servers.batching"):
        warn(64)
        assert not caplog.records
        warn(80)
        warn(90)
    assert len(caplog.records) == 1
    assert "80 tokens, longer than the 64 (model.encoder_seq_length)" in caplog.records[0].getMessage()
    learned = TrainedLengthWarning(OmegaConf.create({"encoder_seq_length": 64,
                                                     "position_embedding_type": "learned_absolute"}), "critic")
    with caplog.at_level("WARNING", logger="nemo_aligner.servers.batching"):
        learned(80)
    assert len(caplog.records) == 1


def test_pytriton_timeout_rounding_warning_is_silenced_only_for_pytriton():
    """PyTriton warns at random when its readiness check eats into the init timeout (its network
    timeout is then 'too big' by a few ms); a client silences exactly that warning."""
    import warnings

    import tritonclient.http
    from pytriton.client.utils import _warn_on_too_big_network_timeout
    from pytriton.client.warnings import NotSupportedTimeoutWarning

    from nemo_aligner.servers.clients import TritonModelClient

    http = tritonclient.http.InferenceServerClient(f"127.0.0.1:{free_port()}", network_timeout=3.0,
                                                   connection_timeout=3.0)  # connects lazily
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_on_too_big_network_timeout(http, 2.99)  # what PyTriton does 10 ms into a 3 s init
        assert [w.category for w in caught] == [NotSupportedTimeoutWarning]
        caught.clear()
        TritonModelClient("127.0.0.1", free_port(), "reward_model", "remote_rm", timeout_s=3.0, check=False).close()
        _warn_on_too_big_network_timeout(http, 2.99)
        assert caught == []
        warnings.warn("the same class raised elsewhere is still shown", NotSupportedTimeoutWarning)
        assert [str(w.message) for w in caught] == ["the same class raised elsewhere is still shown"]
    http.close()


@pytest.fixture
def slow_server(tmp_path):
    """A server whose first two requests take 5 s each (one at a time), then answers at once."""
    from conftest import WORKERS

    srv = ServerProcess(tmp_path, os.path.join(WORKERS, "slow_server.py"), "slow server ready")
    srv.start(["--port", str(srv.port), "--grpc-port", str(free_port()), "--metrics-port", str(free_port()),
               "--workspace", str(srv.workspace), "--delay", "5", "--slow-calls", "2"])
    with srv:
        yield srv


def test_slow_server_is_retried_then_given_up_on(slow_server, caplog):
    """A request unanswered within timeout_s is sent again up to max_retries times, then given up on."""
    from nemo_aligner.servers.clients import RemoteGPTRMClient, RemoteServerError

    tokens, lengths = np.array([[1, 2, 3]], dtype=np.int64), [3]
    start = time.time()
    with RemoteGPTRMClient("127.0.0.1", slow_server.port, timeout_s=3, retries=0, settings_key="remote_rm") as c:
        with pytest.raises(RemoteServerError, match=r"127\.0\.0\.1:\d+ did not answer within 3s; check it is alive, "
                                                    r"or raise remote_rm\.timeout_s or remote_rm\.max_retries"):
            c.infer_tokens(tokens, lengths).result()
    assert time.time() - start < 10
    time.sleep(max(0.0, start + 5.5 - time.time()))  # the server finishes the abandoned slow request
    # Request 2 is slow too (5 s > 3 s): it is sent again, and the second send is answered.
    with RemoteGPTRMClient("127.0.0.1", slow_server.port, timeout_s=3, retries=2, settings_key="remote_rm") as c:
        with caplog.at_level("WARNING"):
            np.testing.assert_allclose(c.infer_tokens(tokens, lengths).result(), [6.0])
        workers = list(c._client._threads)
    # Closing waits for the workers to close their connections and gevent hubs: one still doing so
    # while the interpreter shuts down can crash the process at exit (SIGSEGV).
    assert workers and not any(t.is_alive() for t in workers)
    retries = [r.getMessage() for r in caplog.records if "sending the request again" in r.getMessage()]
    assert len(retries) == 1 and "retry 1 of 2, remote_rm.max_retries" in retries[0], retries
    assert slow_server.proc.poll() is None


def test_serves_with_pytriton_installed_outside_site_packages(tmp_path, monkeypatch, rm_nemo_and_rewards):
    """PyTriton imported from a directory on PYTHONPATH (``pip install --target``) takes itself for a
    source checkout and does not put its bundled libraries on tritonserver's library path: the server
    still starts and answers."""
    import pytriton

    package = os.path.dirname(pytriton.__file__)
    site = tmp_path / "site"
    site.mkdir()
    os.symlink(package, site / "pytriton")
    os.symlink(os.path.join(os.path.dirname(package), "nvidia_pytriton.libs"), site / "nvidia_pytriton.libs")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    nemo, expected = rm_nemo_and_rewards
    with Server(tmp_path, nemo) as srv:
        with client(srv.port) as c:
            got = c.infer_texts(TEXTS[:3]).result()
    np.testing.assert_allclose(got, [expected[t] for t in TEXTS[:3]], rtol=1e-5, atol=1e-5)


def test_library_path_puts_python_and_pytriton_libraries_first_once(monkeypatch):
    import sysconfig

    from nemo_aligner.servers.triton_host import prepare_library_path, pytriton_libs_dir

    monkeypatch.setenv("LD_LIBRARY_PATH", f"/opt/x{os.pathsep}{pytriton_libs_dir()}")
    prepare_library_path()
    prepare_library_path()
    assert os.environ["LD_LIBRARY_PATH"].split(os.pathsep) == [sysconfig.get_config_var("LIBDIR"), pytriton_libs_dir(),
                                                               "/opt/x"]


def test_experts_split_over_two_ranks_score_as_one_process(tmp_path, mcore_single):
    """A mixture-of-experts reward model served by two ranks, each holding 2 of its 4 experts
    (model.expert_model_parallel_size=2): a request's rows are split over the ranks, whose texts differ in
    length, and the rewards are this process's."""
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.utils.nemo_file import save_nemo

    torch.manual_seed(12)
    cfg = OmegaConf.create(dict(TINY_ARCH, num_moe_experts=4, moe_router_topk=2, micro_batch_size=2,
                                encoder_seq_length=32))
    model = MegatronGPTRewardModel(cfg, ByteTokenizer(), trainable=False)
    nemo = save_nemo(model, str(tmp_path / "moe_rm.nemo"))
    model.prepare_for_inference()
    expected = [score(model, [text])[0] for text in TEXTS]
    with Server(tmp_path, nemo, nproc=2, extra=["++model.expert_model_parallel_size=2"]) as srv:
        with client(srv.port) as c:
            got = c.infer_texts(TEXTS).result()
        assert "(experts split over 2 of them)" in srv.text()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
