"""TP=2, PP=2 and DP=2 (two gloo processes) compute the same loss, gradient norm and updated
loss as one process on the same batch and the same weights."""

import json
import os

import pytest

from conftest import TINY_GPT2_ARCH, WORKERS, run_python

WORKER = os.path.join(WORKERS, "parallel_loss_worker.py")
KEYS = ("loss0", "token_loss0", "loss_train", "grad_norm", "loss1")


def run_worker(tmp_path, nemo, tag, nproc=2, extra=()):
    out = tmp_path / f"{tag}.json"
    run_python(WORKER, ["--nemo", nemo, "--out", out, *extra], nproc=nproc)
    return json.loads(out.read_text())


def assert_same(result, reference, what):
    for key in KEYS:
        assert result[key] == pytest.approx(reference[key], rel=2e-5, abs=1e-6), f"{what}: {key}"
    assert result["params"] == reference["params"], f"{what}: parameter count"


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--pp", "2"), ()], ids=["tp2", "pp2", "dp2"])
def test_parallel_matches_single_process(tmp_path, base_nemo, layout):
    nemo, reference = base_nemo
    # The step really trains: otherwise equal numbers would prove little.
    assert reference["loss1"] < reference["loss0"] - 0.1
    result = run_worker(tmp_path, nemo, "run", extra=layout)
    assert result["dp"] == (2 if not layout else 1)
    assert_same(result, reference, " ".join(layout) or "dp2")


def test_distributed_optimizer_dp2_matches_adam(tmp_path, base_nemo):
    nemo, reference = base_nemo
    result = run_worker(tmp_path, nemo, "distopt", extra=("--optim", "distributed_fused_adam"))
    assert_same(result, reference, "distributed optimizer, DP=2")


def test_tied_embeddings_pipeline_parallel(tmp_path):
    """GPT-2 shape (tied input/output embeddings, learned positions): PP=2 shares the embedding
    between the first and last stage and must match one process."""
    nemo = str(tmp_path / "gpt2.nemo")
    single = tmp_path / "single.json"
    run_python(WORKER, ["--random-arch", json.dumps(TINY_GPT2_ARCH), "--save", nemo, "--out", single])
    reference = json.loads(single.read_text())
    result = run_worker(tmp_path, nemo, "pp2", extra=("--pp", "2"))
    assert_same(result, reference, "tied embeddings, PP=2")
