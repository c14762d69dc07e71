"""The PPO critic server on its own: critic_infer, critic_train and critic_save at PP=2, DP=2 and EP=2 equal one
process's (in its own file so the test suite's two workers can share PPO's tests)."""

import os
import re

import pytest

from conftest import SCRIPTS, free_port, upcycle_to_experts


@pytest.fixture(scope="module")
def rm_nemo(mcore_single, quick_rm, tmp_path_factory):
    """A reward model with its MLPs made 4 experts (2 per token): the critic's weights."""
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel

    return upcycle_to_experts(quick_rm, str(tmp_path_factory.mktemp("moe_rm") / "rm.nemo"),
                              MegatronGPTRewardModel)


@pytest.fixture(scope="module")
def critic_batch():
    """A fixed batch of finished sequences and made-up PPO targets for the critic."""
    import numpy as np

    from nemo_aligner.utils.tokenizers import ByteTokenizer

    tok = ByteTokenizer()
    texts = ["reverse abc = cba", "reverse abc = bca", "sort cab = abc", "sort hgfe = efgh", "reverse ab = ba",
             "sort ba = ab", "reverse h = h", "sort dcb = bcd"]
    ids = [tok.text_to_ids(t) + [tok.eos_id] for t in texts]
    width = 24
    tokens = np.full((len(ids), width), tok.eos_id, dtype=np.int64)
    for i, seq in enumerate(ids):
        tokens[i, : len(seq)] = seq
    lengths = np.array([[len(s)] for s in ids], dtype=np.int64)
    rng = np.random.default_rng(0)
    returns = rng.normal(size=(len(ids), width - 1)).astype(np.float32)
    mask = (np.arange(width - 1)[None, :] < lengths - 1).astype(np.float32)
    return tokens, lengths, returns, mask


def frames_in_our_code(text):
    """The traceback frames in a server's output that are in this repository's code (torchrun's agent
    prints a traceback of its own when SIGTERM stops it, which is how the test stops it)."""
    import nemo_aligner

    ours = (os.path.dirname(os.path.abspath(nemo_aligner.__file__)) + os.sep, SCRIPTS + os.sep)
    return [path for path in re.findall(r'^\s*File "([^"]+)"', text, re.MULTILINE) if path.startswith(ours)]


def query_critic(port, batch):
    import numpy as np
    from pytriton.client import ModelClient

    tokens, lengths, returns, mask = batch
    with ModelClient(f"127.0.0.1:{port}", "critic_infer", init_timeout_s=60) as c:
        out = c.infer_batch(tokens=tokens, sequence_lengths=lengths)
    with ModelClient(f"127.0.0.1:{port}", "critic_train", init_timeout_s=60) as c:
        losses = [float(c.infer_sample(tokens=tokens, returns=returns, prev_values=out["values"][:, :-1].copy(),
                                       mask=mask)["loss_mean"][0]) for _ in range(2)]
    with ModelClient(f"127.0.0.1:{port}", "critic_infer", init_timeout_s=60) as c:
        after = c.infer_batch(tokens=tokens, sequence_lengths=lengths)
    with ModelClient(f"127.0.0.1:{port}", "critic_save", init_timeout_s=60) as c:
        status = int(c.infer_sample(dummy_var=np.zeros(1, dtype=np.int64))["status"][0])
    return out, losses, after, status


def test_critic_server_two_processes_match_one(tmp_path, rm_nemo, critic_batch):
    """critic_infer, critic_train and critic_save from a PP=2, a DP=2 and an EP=2 critic (a mixture of
    experts, split over the two ranks) equal one process's (TP=2 serving is checked on the reward-model
    server, tests/test_reward_server.py, and TP=2 training of the same model code in tests/test_parallel.py)."""
    import numpy as np

    from conftest import ServerProcess

    # Two servers start together: most of a server's start and stop is waiting (PyTriton,
    # tritonserver), which overlaps; each is queried alone and asked to stop before the next. Four at
    # once (seven tritonserver model processes starting on 2 busy cores) once aborted a tritonserver
    # in its Python backend (boost::interprocess::lock_exception).
    servers = {}
    results = {}
    waves = ((("one", 1, []), ("pp2", 2, ["model.pipeline_model_parallel_size=2"])),
             (("dp2", 2, []), ("ep2", 2, ["++model.expert_model_parallel_size=2"])))
    try:
        for wave in waves:
            for tag, nproc, extra in wave:
                srv = servers[tag] = ServerProcess(tmp_path, "serve_ppo_critic.py", "critic server ready",
                                                   nproc=nproc, like_nproc=2)
                srv.start([f"pretrained_checkpoint.restore_from_path={rm_nemo}",
                           f"exp_manager.explicit_log_dir={tmp_path / tag}", f"trainer.ppo.port={srv.port}",
                           f"trainer.ppo.grpc_port={free_port()}", f"trainer.ppo.metrics_port={free_port()}",
                           f"trainer.ppo.workspace_dir={srv.workspace}", "model.micro_batch_size=2",
                           "model.global_batch_size=4", "model.optim.sched.warmup_steps=0", *extra])
            for tag, _, _ in wave:
                results[tag] = query_critic(servers[tag].wait_ready(timeout=400).port, critic_batch)
                servers[tag].terminate()
    finally:
        for srv in servers.values():
            srv.stop()
            srv.cleanup()
    for tag, srv in servers.items():
        assert "]: Traceback" not in srv.text() and not frames_in_our_code(srv.text()), tag
        assert any("step=" in c for c in os.listdir(tmp_path / tag / "checkpoints")), tag  # critic_save wrote one
    one = results["one"]
    assert one[1][1] < one[1][0]  # the second pass over the same data has a lower loss: it trained
    for tag in ("pp2", "dp2", "ep2"):
        out, losses, after, status = results[tag]
        np.testing.assert_allclose(out["rewards"], one[0]["rewards"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(out["values"], one[0]["values"], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(losses, one[1], rtol=1e-4)
        np.testing.assert_allclose(after["values"], one[2]["values"], rtol=1e-4, atol=1e-4)
        assert status == 0
