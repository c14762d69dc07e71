"""Rollouts packed by prompt (``model.<section>.share_prompt_prefix``): the layout, its attention
against per-row attention, and the actor's log-probs, loss and gradients against the unpacked rows."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from conftest import TINY_ARCH, TINY_GPT2_ARCH, WORKERS, run_python
from nemo_aligner.utils import prompt_sharing as S


def rollouts(prompts, responses, width):
    """Right-padded rows ``[prompt][response][pad 0]`` and their lengths (prompt, prompt + response)."""
    tokens = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        tokens[b, : len(p) + len(r)] = torch.tensor(p + r)
    prompt_lengths = torch.tensor([len(p) for p in prompts])
    return tokens, prompt_lengths, prompt_lengths + torch.tensor([len(r) for r in responses])


def test_groups_are_runs_of_one_prompt():
    a, b = [5, 6, 7], [5, 6]
    tokens, pl, rl = rollouts([a, a, b, b, b, a], [[1, 2], [3], [4, 4, 4], [], [9], [8]], width=8)
    # b is a prefix of a's tokens but a different prompt; a's last row is its own group (not consecutive).
    assert S.prompt_groups(tokens, pl) == [(0, 2), (2, 3), (5, 1)]
    shape = S.pack_shape(tokens, pl, rl)
    assert shape == S.PackShape(groups=3, responses=3, prompt_slots=3, response_slots=3)
    assert shape.length == 3 + 3 * 3
    assert S.saves_tokens([shape], rows=6, width=8)  # 36 positions instead of 48
    assert not S.saves_tokens([shape], rows=6, width=6)


def test_pack_places_prompts_once_and_maps_every_prediction():
    a, b = [11, 12, 13], [21]
    tokens, pl, rl = rollouts([a, a, b, b], [[1, 2], [3, 4, 5], [6], [7, 8]], width=7)
    packed = S.pack(tokens, pl, rl)
    G, n, P, R = packed.shape.as_tuple()
    assert (G, n, P, R) == (2, 2, 3, 3)
    assert packed.tokens.tolist() == [[11, 12, 13, 1, 2, 0, 3, 4, 5], [0, 0, 21, 6, 0, 0, 7, 8, 0]]
    # Each token keeps the position it has in its own row (the prompt left-padded to P slots).
    assert packed.positions.tolist() == [[0, 1, 2, 3, 4, 5, 3, 4, 5], [0, 0, 0, 1, 2, 3, 1, 2, 3]]
    assert packed.first_tokens.tolist() == [[1, 3], [6, 7]]
    # Where the row's prediction of token t + 1 comes from: the slot holding its token t, at
    # position t, whose next packed token is the label; or the response's own first-token entry.
    labels = S.next_tokens(packed.tokens)
    slots = G * packed.shape.length
    for row in range(4):
        for t in range(7):
            if not packed.valid[row, t]:
                continue
            index = int(packed.source[row, t])
            if index >= slots:
                assert t == int(pl[row]) - 1, (row, t)
                g, i = divmod(index - slots, n)
                assert int(packed.first_tokens[g, i]) == int(tokens[row, t + 1]), (row, t)
                continue
            g, slot = divmod(index, packed.shape.length)
            assert int(packed.tokens[g, slot]) == int(tokens[row, t]), (row, t)
            assert int(packed.positions[g, slot]) == t, (row, t)
            assert int(labels[g, slot]) == int(tokens[row, t + 1]), (row, t)
    assert packed.valid.sum(1).tolist() == [4, 5, 1, 2]  # prompt + response tokens - 1 predictions per row
    # Response 2 of group 0 sees the prompt and its own earlier tokens, never response 1 or padding.
    mask = packed.attention_mask  # [G * n, 1, R, P + R], True hides
    assert mask.shape == (4, 1, 3, 6)
    assert (~mask[1, 0]).tolist() == [[True, True, True, True, False, False], [True, True, True, True, True, False],
                                      [True, True, True, True, True, True]]
    assert (~mask[2, 0, 0]).tolist() == [False, False, True, True, False, False]  # group 1's prompt: 1 real slot


def test_pack_refuses_what_it_cannot_lay_out():
    tokens, pl, rl = rollouts([[1, 2], [3]], [[4], [5]], width=4)
    with pytest.raises(ValueError, match="at least 2 rows"):
        S.pack(tokens, pl, rl)  # two prompts, one row each: nothing to share
    tokens, pl, rl = rollouts([[1, 2]] * 3, [[4], [5], [6, 7]], width=5)
    with pytest.raises(ValueError, match="smaller than the batch"):
        S.pack(tokens, pl, rl, S.PackShape(groups=1, responses=2, prompt_slots=2, response_slots=2))


def per_row_attention(qkv, tokens, prompt_lengths, response_lengths, shape):
    """Each row's causal attention over its own ``[prompt][response]`` slots of packed ``qkv``; the
    prompt's outputs from the group's first row. Returns the outputs and which slots are real."""
    G, n, P, R = shape.as_tuple()
    out = torch.zeros(shape.length, G, qkv[0].shape[2] * qkv[0].shape[3], dtype=qkv[0].dtype)
    real = torch.zeros(shape.length, G, dtype=torch.bool)
    for g, (first, count) in enumerate(S.prompt_groups(tokens, prompt_lengths)):
        p = int(prompt_lengths[first])
        for i in range(count):
            own = list(range(P + i * R, P + i * R + int(response_lengths[first + i]) - p))
            slots = list(range(P - p, P)) + own
            q, k, v = (t[slots, g].transpose(0, 1) for t in qkv)  # [heads, p + r, d]
            row = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(len(slots), -1)
            keep = slice(0, None) if i == 0 else slice(p, None)  # the prompt is computed once per group
            out[slots[keep], g] = row[keep]
            real[slots[keep], g] = True
    return out, real


def test_attention_over_the_packed_layout_equals_each_rows_causal_attention():
    """Outputs and gradients (those reaching the shared prompt's keys and values included) of the
    two-call packed attention against per-row causal attention, in float64."""
    torch.manual_seed(0)
    prompts = [[1, 2, 3, 4]] * 3 + [[5, 6]] * 2
    tokens, pl, rl = rollouts(prompts, [[7, 7, 7], [7], [7, 7], [7, 7, 7], [7]], width=7)
    packed = S.pack(tokens, pl, rl)
    G = packed.shape.groups
    qkv = [torch.randn(packed.shape.length, G, 2, 8, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    weights = torch.randn(packed.shape.length, G, 16, dtype=torch.float64)

    out = S.shared_prompt_attention(*qkv, packed.attention_mask, scale=None)
    reference, real = per_row_attention(qkv, tokens, pl, rl, packed.shape)
    assert int(real.sum()) == 4 + 6 + 2 + 4  # prompt + response tokens of each group
    torch.testing.assert_close(out[real], reference[real])

    grads = []
    for result in (out, reference):
        for t in qkv:
            t.grad = None
        (result * weights * real[..., None]).sum().backward(retain_graph=True)
        grads.append([t.grad[real].clone() for t in qkv])
    for packed_grad, row_grad in zip(*grads):
        torch.testing.assert_close(packed_grad, row_grad)
    assert grads[0][1][:4].abs().sum() > 0  # the first group's prompt keys get gradients


WORKER = os.path.join(WORKERS, "shared_prompt_worker.py")


@pytest.mark.parametrize("arch,layout,nproc", [
    (TINY_ARCH, (), 1), (TINY_GPT2_ARCH, (), 1), (TINY_ARCH, ("--tp", "2"), 2), (TINY_ARCH, ("--pp", "2"), 2)],
    ids=["llama", "gpt2", "tp2", "pp2"])
def test_actor_packed_by_prompt_matches_unpacked(tmp_path, arch, layout, nproc):
    """GRPO rollouts (groups of 3, 3 and 2 with different prompt and response lengths, split over
    two micro-batches): log-probs, reference log-probs, loss, KL term, entropy and gradients agree
    packed and unpacked, with RoPE or learned positions, under tensor and pipeline parallelism."""
    out = tmp_path / "result.json"
    run_python(WORKER, ["--arch", json.dumps(arch), "--out", out, *layout], nproc=nproc)
    assert_packed_matches_unpacked(json.loads(out.read_text()))


def assert_packed_matches_unpacked(result, atol=2e-5, rel=1e-5):
    assert result["sharing"] is True
    unpacked, packed = result["unpacked"], result["packed"]
    for key in ("logprobs", "init_logprobs"):
        torch.testing.assert_close(torch.tensor(packed[key]), torch.tensor(unpacked[key]), rtol=0, atol=atol)
        assert torch.tensor(unpacked[key]).abs().sum() > 1.0  # real values under the mask
    for key in ("loss", "kl_loss", "entropy", "grad_norm"):
        assert packed[key] == pytest.approx(unpacked[key], rel=rel, abs=1e-7), key
    assert unpacked["kl_loss"] > 1e-4 and unpacked["entropy"] > 1.0 and unpacked["grad_norm"] > 1e-3


@pytest.mark.parametrize("extra,precision", [
    ({"activations_checkpoint_granularity": "full", "activations_checkpoint_method": "uniform",
      "activations_checkpoint_num_layers": 1}, "32"),
    ({"activations_checkpoint_granularity": "selective"}, "32"),
    ({}, "bf16")], ids=["full-recompute", "selective-recompute", "bf16"])
def test_packing_survives_recompute_and_bf16(mcore_single, extra, precision):
    """The layout travels as a plain tensor mask, so megatron-core's activation checkpointing
    (which saves its inputs for backward) recomputes packed layers; bf16 agrees to its rounding."""
    worker = load_worker()
    result = worker.packed_and_unpacked(worker.build_actor(dict(TINY_ARCH, **extra), precision))
    if precision == "bf16":
        assert_packed_matches_unpacked(result, atol=5e-3, rel=2e-3)
    else:
        assert_packed_matches_unpacked(result)


def load_worker():
    import importlib.util

    spec = importlib.util.spec_from_file_location("shared_prompt_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_actor_packs_only_when_it_saves_work(mcore_single, monkeypatch):
    from test_ppo_actor import build_actor

    import nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor as actor_module

    calls = []
    real_pack = actor_module.prompt_sharing.pack
    monkeypatch.setattr(actor_module.prompt_sharing, "pack", lambda *a, **k: calls.append(1) or real_pack(*a, **k))
    model = build_actor()  # micro-batches of 2 rows
    model.eval()
    a, b, c = [1, 2, 3], [6], [7, 8]
    cases = [  # (prompts, response length, width, packs)
        ([a] * 4, 2, 5, True),           # two micro-batches of one 2-row group: 7 positions each instead of 10
        ([a, a, b, b], 4, 7, True),      # one shape for both (3 + 2 x 4 = 11) instead of 2 x 7 each
        ([a, a, b, c], 4, 7, False),     # the second micro-batch has two groups of one: 2 x 11 > 2 x 7
        ([a, b, c, a], 4, 7, False),     # nothing repeats within a micro-batch
    ]
    for prompts, response, width, packs in cases:
        tokens, pl, rl = rollouts(prompts, [[4] * response] * 4, width=width)
        before = len(calls)
        model.get_logprobs(tokens, pl, rl)
        assert (len(calls) > before) == packs, prompts
    before = len(calls)
    tokens, pl, rl = rollouts([a] * 4, [[4, 5]] * 4, width=5)
    model.get_logprobs(tokens)  # no lengths: unpacked
    # A sliding window (model.window_size) shorter than the rows: packed positions would need it, so unpacked
    tokens, pl, rl = rollouts([a] * 4, [[4, 5]] * 4, width=5)
    for window, packs in ((3, False), (4, True)):
        for layer in model.module.decoder.layers:
            layer.self_attention.core_attention.window = window
        before = len(calls)
        model.get_logprobs(tokens, pl, rl)
        assert (len(calls) > before) == packs, window
    before = len(calls)
    model.share_prompt_prefix = False
    model.get_logprobs(tokens, pl, rl)
    assert len(calls) == before


def test_sharing_is_off_where_the_attention_cannot_do_it(mcore_single):
    from omegaconf import OmegaConf

    from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
    from nemo_aligner.models.nlp.gpt.shared_prompt_forward import prompt_sharing_unsupported
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    cfg = OmegaConf.create(dict(TINY_ARCH, attention_dropout=0.1, micro_batch_size=2, encoder_seq_length=32))
    model = MegatronGPTActorModel(cfg, ByteTokenizer(), trainable=False)
    assert not model.share_prompt_prefix
    assert prompt_sharing_unsupported(model.module, model.transformer_config) == "attention dropout is on"
    # A packed layout reaching attention that cannot compute it is an error, never a silent misread.
    attention = model.module.decoder.layers[0].self_attention.core_attention
    attention.train()
    tokens, pl, rl = rollouts([[1, 2]] * 2, [[3], [4]], width=3)
    packed = S.pack(tokens, pl, rl)
    q = torch.randn(packed.shape.length, 1, 2, 16)
    with pytest.raises(ValueError, match="shared-prompt packing needs attention without dropout"):
        attention(q, q[:, :, :1], q[:, :, :1], packed.attention_mask)
