"""Server guards without a running server: when the critic server stops after SIGTERM
(``ShutdownDrain``: at once between the actor's steps, after the actor's checkpoint request when it is
mid-step, or when the actor has gone quiet), the critic_train row limit, and server errors as the
client reports them."""

import threading
import time

import pytest

from nemo_aligner.servers.critic_server import CRITIC_INFER, CRITIC_SAVE, CRITIC_TRAIN, ShutdownDrain


@pytest.fixture
def drain(monkeypatch):
    d = ShutdownDrain(idle_s=1.0, answer_s=0.05)
    d.stopped = threading.Event()
    monkeypatch.setattr(d, "_interrupt", d.stopped.set)
    yield d
    d.stopping = True  # a watcher thread still running ends instead of interrupting later tests


def request(d, kind):
    d.begin()
    d.end(kind)


def test_stops_at_once_before_any_request_and_between_steps(drain):
    assert drain.on_sigterm()
    request(drain, CRITIC_INFER)
    request(drain, CRITIC_TRAIN)
    request(drain, CRITIC_SAVE)  # the actor's step ended with its checkpoint
    assert drain.on_sigterm()


def test_mid_step_serves_until_the_actors_save(drain):
    request(drain, CRITIC_INFER)
    assert not drain.on_sigterm()  # the actor still needs the critic for this step
    request(drain, CRITIC_TRAIN)
    time.sleep(0.3)
    assert not drain.stopped.is_set()
    request(drain, CRITIC_SAVE)
    assert drain.stopped.wait(2.0)


def test_a_request_in_flight_counts_as_mid_step(drain):
    drain.begin()  # a critic_train still running
    assert not drain.on_sigterm()
    drain.end(CRITIC_TRAIN)


def test_second_sigterm_stops_at_once(drain):
    request(drain, CRITIC_INFER)
    assert not drain.on_sigterm()
    assert drain.on_sigterm()


def test_stops_when_the_actor_goes_quiet(drain):
    request(drain, CRITIC_TRAIN)
    assert not drain.on_sigterm()
    start = time.monotonic()
    assert drain.stopped.wait(5.0)
    assert time.monotonic() - start >= 0.9  # idle_s after the last request


def test_a_long_request_is_not_idleness(drain):
    request(drain, CRITIC_INFER)
    drain.begin()  # critic_train runs longer than idle_s
    assert not drain.on_sigterm()
    assert not drain.stopped.wait(1.6)
    drain.end(CRITIC_TRAIN)
    assert drain.stopped.wait(3.0)


def test_critic_train_requests_over_the_row_limit_are_refused_before_any_work():
    """trainer.ppo.max_train_rows: each global batch of a critic_train request is an optimizer step;
    a request larger than the limit is answered with an error before it reaches the model."""
    import numpy as np

    from nemo_aligner.servers.critic_server import BadTrainRequest, CriticServer

    server = object.__new__(CriticServer)  # the checks only; no model
    server.vocab_size, server.max_seq_length, server.max_train_rows, server.key = 384, 128, 8, "trainer.ppo"
    rows = np.ones((9, 5), dtype=np.int64)
    with pytest.raises(BadTrainRequest, match=r"9 rows, more than the server's trainer\.ppo\.max_train_rows=8"):
        server.train(rows, np.zeros((9, 4)), np.zeros((9, 4)), np.ones((9, 4)))


def test_server_errors_reach_the_client_without_the_servers_traceback():
    from nemo_aligner.servers.clients import server_message

    forwarded = ("Failed to process the request(s) for model 'reward_model_0_0', message: TritonModelException: Model "
                 "execute error: Traceback (most recent call last):\n  File \"/tmp/folderX/1/model.py\", line 1, in f\n"
                 "    raise BadRequest(...)\nnemo_aligner.servers.batching.BadRequest: token ids must be within 0..383\n"
                 "\nAt:\n  /tmp/folderX/1/model.py(501): execute")
    assert server_message(Exception(forwarded)) == (
        "Failed to process the request(s) for model 'reward_model_0_0', message: TritonModelException: Model execute "
        "error: nemo_aligner.servers.batching.BadRequest: token ids must be within 0..383")
    plain = "[request id: <id_unknown>] unexpected datatype FP32 for input 'tokens', expecting INT64"
    assert server_message(Exception(plain)) == plain
