"""Generation with the KV cache equals step-by-step generation without a cache, for ragged prompts,
on Llama- and GPT-2-shaped models; sampling settings behave; TP=2 generates what TP=1 does."""

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TINY_ARCH, TINY_GPT2_ARCH, WORKERS, forward_logits, run_python
from nemo_aligner.utils import cpu_gemm
from nemo_aligner.models.nlp.gpt.generation import LengthParams, SamplingParams, generate, sample
from nemo_aligner.utils.tokenizers import ByteTokenizer

# Repeated prompts (as in GRPO groups) are prefilled once; each row must still match.
PROMPTS = ["reverse abc = ", "sort hgfedcba = ", "x", "reverse abcdefgh = ", "x", "reverse abc = "]
# Mixtral-shaped: each layer's MLP is 4 routed experts, 2 per token.
MOE_ARCH = dict(TINY_ARCH, num_moe_experts=4, moe_router_topk=2)
TINY_GPT2_MLP = dict(activation="gelu", bias=True)  # ungated experts with biases: the unfused decode step


def build(arch, seed=0):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel

    torch.manual_seed(seed)
    cfg = OmegaConf.create(dict(arch, micro_batch_size=1, encoder_seq_length=32))
    model = GPTSFTModel(cfg, ByteTokenizer(), trainable=False)
    model.eval()
    return model


def full_logits(model, ids):
    """Last-position logits of an unpadded sequence from megatron-core's own forward (no cache)."""
    return forward_logits(model, torch.tensor([ids]))[0, -1].float()


@pytest.mark.parametrize("arch,texts", [(TINY_ARCH, PROMPTS), (TINY_GPT2_ARCH, PROMPTS),
                                         (TINY_ARCH, ["sort cba = ", "sort abc = "]),  # equal lengths: no padding mask
                                         # NeMo's sliding window (Mistral), shorter than prompts and responses
                                         (dict(TINY_ARCH, window_size=[5, 0]), PROMPTS),
                                         (dict(TINY_ARCH, window_size=[5, 0]), ["sort cba = ", "sort abc = "]),
                                         (dict(TINY_GPT2_ARCH, window_size=[5, 0]), PROMPTS),  # unfused decode
                                         (dict(TINY_ARCH, activation="geglu", openai_gelu=True,  # Gemma-shaped
                                               apply_embedding_scaling=True), PROMPTS),
                                         (MOE_ARCH, PROMPTS), (dict(MOE_ARCH, **TINY_GPT2_MLP), PROMPTS)],
                         ids=["llama", "gpt2", "llama-unpadded", "llama-window", "llama-window-unpadded",
                              "gpt2-window", "gemma", "mixtral", "moe-gelu"])
def test_cached_greedy_equals_uncached(mcore_single, arch, texts):
    model = build(arch)
    tok = model.tokenizer
    prompts = [tok.text_to_ids(p) for p in texts]
    out = generate(model.module, tok, prompts, SamplingParams(use_greedy=True), LengthParams(max_length=8, min_length=8))
    for b, prompt in enumerate(prompts):
        ids = list(prompt)
        for _ in range(8):
            logits = full_logits(model, ids)
            logits[tok.vocab_size:] = float("-inf")
            logits[tok.eos_id] = float("-inf")  # min_length=8 forbids EOS
            ids.append(int(logits.argmax()))
        n = int(out.response_lengths[b])
        assert n == len(ids) and out.tokens[b, :n].tolist() == ids, b
        assert int(out.prompt_lengths[b]) == len(prompt)


@pytest.mark.parametrize("extra", [{}, {"qk_layernorm": True}, {"rotary_percentage": 0.5},
                                   {"qk_layernorm": True, "rotary_percentage": 0.5},
                                   {"num_moe_experts": 4, "moe_router_topk": 2},
                                   # shared experts, sigmoid scores, the all-to-all dispatcher (moe_layer_freq: not read, as in NeMo)
                                   {"num_moe_experts": 4, "moe_router_topk": 2, "moe_shared_expert_intermediate_size": 64,
                                    "moe_layer_freq": [1, 0], "moe_router_score_function": "sigmoid",
                                    "moe_token_dispatcher_type": "alltoall"}],
                         ids=["plain", "qk_layernorm", "partial_rotary", "qk_layernorm_partial_rotary", "moe",
                              "moe-variants"])
def test_cached_logits_equal_forward(mcore_single, extra):
    """Not only the argmax: the decoder's logits at every step equal the full forward's (also with
    query/key layer norms, which take the decoder's separate query and key path, and with RoPE on
    part of each head, where the rest passes through)."""
    check_cached_logits_equal_forward(extra)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU decode GEMMs: a visible GPU holds the model")
@pytest.mark.parametrize("backend", [b for b in cpu_gemm.BACKENDS if cpu_gemm.available(b)])
def test_cached_logits_equal_forward_with_every_gemm_backend(mcore_single, monkeypatch, backend):
    """Each packed-GEMM backend the decode loop can pick on some CPU gives the same logits."""
    monkeypatch.setenv(cpu_gemm.ENV_VAR, backend)
    decoder = check_cached_logits_equal_forward({})
    assert decoder.gemm_backend == backend
    # the AMX GEMM packs bf16 weights only: this float32 model's matmuls stay with F.linear under it
    assert bool(decoder.packed) == (backend not in ("plain", "amx"))


def check_cached_logits_equal_forward(extra):
    from nemo_aligner.models.nlp.gpt.generation import KVCacheDecoder

    model = build(dict(TINY_ARCH, **extra), seed=3)
    tok = model.tokenizer
    a, b = tok.text_to_ids("reverse abc = cba"), tok.text_to_ids("sort ab = ab")
    longest = max(len(a), len(b))
    pad = torch.tensor([longest - len(a), longest - len(b)])
    tokens = torch.full((2, longest), tok.eos_id)
    tokens[0, pad[0]:], tokens[1, pad[1]:] = torch.tensor(a), torch.tensor(b)
    slots = torch.arange(longest).unsqueeze(0)
    tokens, slots, pad = (t.to(model.device) for t in (tokens, slots, pad))  # the decoder's inputs live with it
    decoder = KVCacheDecoder(model.module, 2, longest)
    # Prefill all but the last slot (its logits: the last slot's, with padding on row 1), then one decode step.
    first = decoder.forward(tokens[:, :-1], (slots - pad[:, None]).clamp(min=0)[:, :-1], 0, slots >= pad[:, None]).cpu()
    assert torch.allclose(first[0], full_logits(model, a[:-1]), atol=1e-4)
    assert torch.allclose(first[1], full_logits(model, b[:-1]), atol=1e-4)
    last = decoder.forward(tokens[:, -1:], (slots - pad[:, None])[:, -1:], longest - 1, slots >= pad[:, None]).cpu()
    assert torch.allclose(last[0], full_logits(model, a), atol=1e-4)
    assert torch.allclose(last[1], full_logits(model, b), atol=1e-4)
    return decoder


@pytest.mark.stack
@pytest.mark.parametrize("arch", [TINY_ARCH, TINY_GPT2_ARCH, dict(TINY_ARCH, qk_layernorm=True),
                                  dict(TINY_ARCH, window_size=[4, 0]), MOE_ARCH],
                         ids=["llama", "gpt2", "qk_layernorm", "window", "moe"])
def test_static_decode_step_equals_forward(mcore_single, arch):
    """The static-shape decode step (what a CUDA graph captures: the slot is a tensor, the whole cache
    is read under a mask) gives the full forward's logits at every step, with ragged prompts and
    cache slots after the current one holding garbage."""
    from nemo_aligner.models.nlp.gpt.generation import KVCacheDecoder

    model = build(arch, seed=3)
    tok = model.tokenizer
    prompts = [tok.text_to_ids("reverse abc = "), tok.text_to_ids("sort ab = ")]
    longest, steps = max(map(len, prompts)), 4
    total = longest + steps + 3
    pad = torch.tensor([longest - len(p) for p in prompts])
    tokens = torch.full((2, longest), tok.eos_id)
    for b, p in enumerate(prompts):
        tokens[b, pad[b]:] = torch.tensor(p)
    slots = torch.arange(total).unsqueeze(0)
    device = model.device
    positions, key_mask = (slots - pad[:, None]).clamp(min=0).to(device), (slots >= pad[:, None]).to(device)
    decoder = KVCacheDecoder(model.module, 2, total)
    decoder.forward(tokens.to(device), positions[:, :longest], 0, key_mask)
    with torch.no_grad():
        decoder.cache[:, :, :, :, longest:].normal_(std=10.0)  # never read unless the mask is wrong
    ids = [list(p) for p in prompts]
    for step, new in enumerate(tok.text_to_ids("cba ")[:steps]):
        slot = longest + step
        fed = torch.full((2, 1), new, device=device)
        logits = decoder.static_step(fed, positions[:, slot:slot + 1], torch.tensor([slot], device=device),
                                     key_mask).cpu()
        for b in range(2):
            ids[b].append(new)
            assert torch.allclose(logits[b], full_logits(model, ids[b]), atol=1e-4), (step, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("arch", [TINY_ARCH, TINY_GPT2_ARCH], ids=["llama", "gpt2"])
def test_cuda_graph_decode_generates_what_the_eager_loop_does(mcore_single, monkeypatch, arch):
    """With NEMO_ALIGNER_CUDA_GRAPHS=1 every decode step replays the captured graph, and greedy and
    seeded sampling give the eager loop's tokens."""
    from nemo_aligner.models.nlp.gpt import generation

    model = build(arch, seed=5)
    tok = model.tokenizer
    prompts = [tok.text_to_ids(p) for p in PROMPTS]
    replays = []
    own_call = generation.CUDAGraphDecodeStep.__call__
    monkeypatch.setattr(generation.CUDAGraphDecodeStep, "__call__",
                        lambda self, *a: replays.append(1) or own_call(self, *a))
    for sampling in (SamplingParams(use_greedy=True), SamplingParams(temperature=1.0, top_k=20)):
        outputs = {}
        for graphs in ("0", "1"):
            monkeypatch.setenv("NEMO_ALIGNER_CUDA_GRAPHS", graphs)
            outputs[graphs] = generate(model.module, tok, prompts, sampling, LengthParams(max_length=10, min_length=10),
                                       seed=7)
        assert outputs["1"].tokens.tolist() == outputs["0"].tokens.tolist()
        assert outputs["1"].response_lengths.tolist() == outputs["0"].response_lengths.tolist()
    assert len(replays) == 2 * 9  # every decode step after the first sampled token, in both runs


@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_decode_rms_norm_is_as_accurate_as_torchs(scale):
    """The decode loop's float32 RMSNorm (fewer kernels than torch's CPU composite) agrees with
    torch's to float32 rounding and is no further from a float64 reference; other dtypes use torch's."""
    from nemo_aligner.models.nlp.gpt.generation import _direct_norm

    torch.manual_seed(0)
    x = torch.randn(8, 32, 64) * scale
    for eps in (1e-5, None):
        norm = torch.nn.RMSNorm(64, eps=eps)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(64))
        with torch.inference_mode():
            ours, theirs = _direct_norm(norm)(x), norm(x)
        exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True)
                                          + (eps or torch.finfo(torch.float32).eps)) * norm.weight.double())
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
        error = lambda y: ((y.double() - exact).abs() / exact.abs()).max().item()
        assert error(ours) < 1e-6 and error(ours) < 3 * error(theirs) + 1e-7
    half = torch.nn.RMSNorm(64, eps=1e-5).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(_direct_norm(half)(x.bfloat16()), half(x.bfloat16()))


def test_stops_at_eos_and_end_strings(mcore_single):
    model = build(TINY_ARCH)
    tok = model.tokenizer
    prompts = [tok.text_to_ids("reverse ab = ")]
    free = generate(model.module, tok, prompts, SamplingParams(use_greedy=True), LengthParams(max_length=12))
    text = tok.ids_to_text(free.tokens[0, len(prompts[0]): int(free.response_lengths[0])].tolist())
    assert len(text) >= 2
    stop = text[1]  # stop as soon as the second generated character appears
    cut = generate(model.module, tok, prompts, SamplingParams(use_greedy=True, end_strings=[stop]),
                   LengthParams(max_length=12))
    response = tok.ids_to_text(cut.tokens[0, len(prompts[0]): int(cut.response_lengths[0])].tolist())
    assert response.endswith(stop) and len(response) <= len(text) and bool(cut.is_end[0])
    # A row that runs out of length has not ended.
    short = generate(model.module, tok, prompts, SamplingParams(use_greedy=True), LengthParams(max_length=1, min_length=1))
    assert int(short.response_lengths[0]) == len(prompts[0]) + 1 and not bool(short.is_end[0])


def test_each_row_has_its_own_length_limit(mcore_single):
    """A prompt near max_sequence_length stops its own row, not the batch: the other rows get their
    full max_length, exactly what they generate alone, and no row (nor the width) passes the limit."""
    model = build(TINY_ARCH)
    tok = model.tokenizer
    short = tok.text_to_ids("sort cba = ")
    near = tok.text_to_ids("reverse abcdefghijklmnopqrstuvw")[:29]  # 3 tokens left of 32
    full = tok.text_to_ids("reverse abcdefghijklmnopqrstuvwxyz")[:32]  # none left
    greedy, length = SamplingParams(use_greedy=True), LengthParams(max_length=8, min_length=8)
    alone = generate(model.module, tok, [short], greedy, length, max_sequence_length=32)
    out = generate(model.module, tok, [near, short, full], greedy, length, max_sequence_length=32)
    assert out.tokens.shape[1] <= 32
    assert out.response_lengths.tolist() == [32, len(short) + 8, 32]
    n = len(short) + 8
    assert out.tokens[1, :n].tolist() == alone.tokens[0, :n].tolist()
    assert out.tokens[2].tolist() == full and out.tokens[0, :29].tolist() == near
    assert not out.is_end.any()  # cut by the limit, not ended


class _WordPieces:
    """A tokenizer whose lone tokens decode differently than in context (SentencePiece-like leading
    spaces dropped), with special tokens that decode to nothing."""

    pieces = ["▁a", "b", "▁c", "!", "▁<end>", "", "d\n", "\n"]

    def ids_to_text(self, ids):
        text = "".join(self.pieces[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


@pytest.mark.parametrize("tokenizer", ["bytes", "pieces"])
def test_end_string_matcher_equals_decoding_every_tail(tokenizer):
    """The matcher skips decoding when the newest token cannot end an end string; on every prefix of
    random responses it must agree with decoding the tail each time (multi-token, multi-byte and
    newline end strings, special tokens that decode to nothing)."""
    from nemo_aligner.models.nlp.gpt.generation import EndStringMatcher

    if tokenizer == "bytes":
        tok = ByteTokenizer()
        alphabet = list(b"ab!\n") + list("é」".encode()) + [tok.eos_id, 256 + 1]
        ends = ["b!", "é", "」", "\n\n", "<extra_id_1>"]
    else:
        tok = _WordPieces()
        alphabet = list(range(len(tok.pieces)))
        ends = ["a b", "<end>", "c!", "\n\n"]
    matcher = EndStringMatcher(tok, ends)
    g = torch.Generator().manual_seed(0)
    hits = 0
    for _ in range(300):
        ids = [alphabet[i] for i in torch.randint(0, len(alphabet), (24,), generator=g).tolist()]
        for n in range(1, len(ids) + 1):
            tail = tok.ids_to_text(ids[:n][-16:])
            expected = any(tail.endswith(s) for s in ends)
            assert matcher.ended(ids[:n]) == expected, (ids[:n], tail)
            hits += expected
    assert hits > 100  # the end strings do occur: both answers are exercised


def test_sampling_settings():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    top1 = sample(logits, SamplingParams(top_k=1), g)
    assert (top1 == 0).all()
    top2 = sample(logits, SamplingParams(top_k=2), g)
    assert set(top2.tolist()) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # 0.61, 0.22, 0.14, 0.03
    nucleus = sample(logits, SamplingParams(top_p=0.7), g)
    assert set(nucleus.tolist()) == {0, 1}  # 0.61 < 0.7, so token 1 is kept; 0.83 >= 0.7 drops the rest
    plain = sample(logits, SamplingParams(), g)
    freq = torch.bincount(plain, minlength=4).float() / len(plain)
    assert torch.allclose(freq, probs, atol=0.04)
    cold = sample(logits, SamplingParams(temperature=0.05), g)
    assert (cold == 0).float().mean() > 0.99
    a = sample(logits, SamplingParams(), torch.Generator().manual_seed(5))
    b = sample(logits, SamplingParams(), torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
    # From a config, 0 is a value (only null means the default): temperature 0 samples the top token.
    zero = SamplingParams.from_cfg(OmegaConf.create({"temperature": 0.0, "top_p": 0.0, "top_k": None}))
    assert (zero.temperature, zero.top_p, zero.top_k) == (0.0, 0.0, 0)
    assert (sample(logits, zero, g) == 0).all()
    unset = SamplingParams.from_cfg(OmegaConf.create({"temperature": None, "top_p": None}))
    assert (unset.temperature, unset.top_p) == (1.0, 1.0)
    # One end string given without brackets is one end string, not one per character.
    assert SamplingParams.from_cfg(OmegaConf.create({"end_strings": "<eos>"})).end_strings == ["<eos>"]
    assert SamplingParams.from_cfg(OmegaConf.create({"end_strings": ["a", 7]})).end_strings == ["a", "7"]


@pytest.mark.stack
def test_tp2_and_pp2_generate_like_one_process(tmp_path, base_nemo):
    nemo, _ = base_nemo
    outs = {}
    for tag, args, nproc in (("one", [], 1), ("tp2", ["--tp", "2"], 2), ("pp2", ["--pp", "2"], 2)):
        out = tmp_path / f"{tag}.json"
        run_python(os.path.join(WORKERS, "generate_worker.py"), ["--nemo", nemo, "--out", out, *args], nproc=nproc,
                   like_nproc=2)  # all three on the same device kind: greedy tokens are compared exactly
        outs[tag] = json.loads(out.read_text())
    for tag in ("tp2", "pp2"):
        assert outs[tag]["greedy"] == outs["one"]["greedy"], tag
        assert outs[tag]["sampled"] == outs["one"]["sampled"], tag  # same seed, sampled on one rank, broadcast


def test_top_p_keeps_the_most_likely_token_however_small():
    """top_p <= 0 dropped every token (an all -inf row: a padding id was drawn at every step);
    the most likely token always stays, so top_p -> 0 is greedy."""
    from nemo_aligner.models.nlp.gpt.generation import SamplingParams, sample

    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(1)
    for top_p in (0.0, 1e-6):
        assert torch.equal(sample(logits, SamplingParams(top_p=top_p), generator), logits.argmax(dim=-1))


def test_sliding_window_values_are_checked(mcore_single):
    """``model.window_size`` as NeMo writes it ([left, 0]; -1: no window) is read; other values, and
    settings the window is not computed with here, are one ConfigError naming the key."""
    from nemo_aligner.models.nlp.gpt.gpt_builder import attention_window
    from nemo_aligner.utils.errors import ConfigError

    assert attention_window({"window_size": [4096, 0]}) == 4096
    assert attention_window({"window_size": [-1, -1]}) is None
    assert attention_window({}) is None
    for bad in ([4, 2], [4], 4, "4", [-2, 0], [True, 0], [1.5, 0]):
        with pytest.raises(ConfigError, match=r"model\.window_size="):
            attention_window({"window_size": bad})
    for extra, key in (({"attention_dropout": 0.1}, "attention_dropout"), ({"use_sdpa_attention": False}, "use_sdpa"),
                       ({"window_attn_skip_freq": 2}, "window_attn_skip_freq")):
        with pytest.raises(ConfigError, match=key):
            build(dict(TINY_ARCH, window_size=[4, 0], **extra))


def test_gemma2_and_falcon_layers_are_refused(mcore_single):
    """Gemma 2's and Falcon's .nemo files (NeMo's converters write these) would be computed without their
    softcapping, query scale or parallel attention: one ConfigError naming the key."""
    from nemo_aligner.utils.errors import ConfigError

    for key, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0),
                       ("query_pre_attn_scalar", 224), ("parallel_attention", True), ("new_decoder_architecture", True)):
        with pytest.raises(ConfigError, match=rf"^model\.mcore_customization_config\.{key}={value} is not supported"):
            build(dict(TINY_ARCH, mcore_customization_config={key: value}))
    for name in ("megatron_gemma2", "megatron_falcon_gpt"):
        with pytest.raises(ConfigError, match=rf"^model\.name='{name}' is not supported: NeMo builds"):
            build(dict(TINY_ARCH, name=name))
    with pytest.raises(ConfigError, match=r"^model\.mcore_customization_config=\[1\] must be a mapping"):
        build(dict(TINY_ARCH, mcore_customization_config=[1]))
    build(dict(TINY_ARCH, name="te_gpt"))  # the GPT layer (NeMo's Hugging Face exports set it)
    with pytest.raises(ConfigError, match=r"^model\.name='te_gtp' is not a layer spec NeMo knows"):
        build(dict(TINY_ARCH, name="te_gtp"))  # NeMo's megatron-core GPT raises on it too
    build(dict(TINY_ARCH, name="modelopt"))
    build(dict(TINY_ARCH, name=None))  # null: absent
    build(dict(TINY_ARCH, mcore_customization_config={"final_logit_softcapping": 0}))  # off: builds


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_query_key_layer_scaling_changes_nothing(mcore_single, precision):
    """``apply_query_key_layer_scaling: True`` (the default of NeMo's older GPT configs) is an fp16
    overflow guard, not different maths: NeMo turns it off outside fp16, and the logits equal the
    flag's absence."""
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel

    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = []
    for flag in (False, True):
        torch.manual_seed(0)
        cfg = OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, encoder_seq_length=32, num_layers=3,
                                    apply_query_key_layer_scaling=flag))
        model = GPTSFTModel(cfg, ByteTokenizer(), precision=precision, trainable=False)
        model.eval()
        logits.append(forward_logits(model, tokens).float())
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)
