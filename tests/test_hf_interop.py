"""Hugging Face import and export: tiny random Llama, Qwen2 and GPT-2 models made here give the
same logits as the megatron-core model converted from them, and back."""

import json
import os

import pytest
import torch

from conftest import forward_logits
from nemo_aligner.utils.errors import ConfigError

VOCAB = 300  # >= the byte tokenizer's, so the directories need no tokenizer files


def tiny_hf(arch: str, tie: bool = False):
    import transformers as tf

    torch.manual_seed(0)
    if arch == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                             rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie)
        model = tf.LlamaForCausalLM(cfg)
    elif arch == "mistral":  # a sliding window of 8 positions, shorter than the sequences used here
        cfg = tf.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               sliding_window=8, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=tie)
        model = tf.MistralForCausalLM(cfg)
    elif arch == "mixtral":  # 4 routed experts, 2 per token
        cfg = tf.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                               num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                               rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=tie)
        model = tf.MixtralForCausalLM(cfg)
    elif arch == "gemma":  # (1 + weight) norms, GeGLU with the tanh GELU, embeddings times sqrt(hidden)
        cfg = tf.GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=64,
                             rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=tie)
        model = tf.GemmaForCausalLM(cfg)
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=64,
                             rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=tie)
        model = tf.Qwen2ForCausalLM(cfg)
    else:
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # non-trivial norms and biases, so a swapped or missed tensor shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def our_logits(nemo_path, tokens):
    from omegaconf import OmegaConf

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model

    model = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 1}), "32", nemo_path, trainable=False)
    model.eval()
    return forward_logits(model, tokens)[..., :VOCAB]


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("gpt2", True), ("mistral", False),
                                      ("gemma", True), ("mixtral", False)])
def test_import_export_logits_match(tmp_path, mcore_single, arch, tie):
    import transformers as tf

    from nemo_aligner.models.nlp.gpt.hf_interop import export_to_hf, import_hf_model

    hf = tiny_hf(arch, tie)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (2, 32 if arch == "mistral" else 17))
    with torch.no_grad():
        expected = hf(tokens).logits
    if arch == "mistral":  # the window changes these logits (so matching them shows it is applied)
        unwindowed = tf.MistralForCausalLM(tf.MistralConfig(**dict(hf.config.to_dict(), sliding_window=None))).eval()
        unwindowed.load_state_dict(hf.state_dict())
        with torch.no_grad():
            assert not torch.allclose(unwindowed(tokens).logits[:, 8:], expected[:, 8:], atol=1e-3)
    nemo = import_hf_model(str(tmp_path / "hf"), str(tmp_path / "model.nemo"))
    from nemo_aligner.utils.nemo_file import read_model_config

    # built with the local spec (the names converted), which the .nemo does not pin for later runs
    assert "force_local_spec" not in read_model_config(nemo, "model.restore_from_path")
    got = our_logits(nemo, tokens)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)

    out = export_to_hf(nemo, str(tmp_path / "exported"))
    back = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, atol=2e-5, rtol=1e-4)
    # export -> import round trip: the same weights again
    again = import_hf_model(out, str(tmp_path / "again.nemo"))
    torch.testing.assert_close(our_logits(again, tokens), expected, atol=2e-5, rtol=1e-4)
    exported = json.load(open(os.path.join(out, "config.json")))
    assert exported["model_type"] == arch
    if arch == "mixtral":  # the routing: NeMo's keys, and its weights change the logits
        cfg = read_model_config(nemo, "model.restore_from_path")
        assert (cfg["num_moe_experts"], cfg["moe_router_topk"], cfg["moe_aux_loss_coeff"]) == (4, 2, 0.02)
        assert (exported["num_local_experts"], exported["num_experts_per_tok"]) == (4, 2)
        with torch.no_grad():
            layer = hf.model.layers[1]  # the router: mlp.gate (transformers 5), block_sparse_moe.gate (4)
            (layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe).gate.weight.mul_(-1.0)
            assert not torch.allclose(hf(tokens).logits, expected, atol=1e-3)
    if arch == "mistral":  # Hugging Face's window counts the query's own position, Transformer Engine's not
        assert list(read_model_config(nemo, "model.restore_from_path")["window_size"]) == [7, 0]
        assert exported["sliding_window"] == 8
    if arch == "llama":  # exporting again over it: replaced whole, and what a kill left beside it is tidied
        (tmp_path / "exported.old.99").mkdir()
        export_to_hf(nemo, out)
        assert sorted(p for p in os.listdir(tmp_path) if p.startswith("exported")) == ["exported"]
        with torch.no_grad():
            torch.testing.assert_close(tf.AutoModelForCausalLM.from_pretrained(out).eval()(tokens).logits, expected,
                                       atol=2e-5, rtol=1e-4)


def test_unsupported_models_are_named(tmp_path, mcore_single):
    from nemo_aligner.models.nlp.gpt.hf_interop import import_hf_model

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 300}))
    with pytest.raises(ConfigError, match=r"config\.json: model_type='bert' is not supported; supported: llama, qwen2, gpt2, gemma, mistral"):
        import_hf_model(str(tmp_path / "m"), str(tmp_path / "x.nemo"))
    with pytest.raises(ConfigError, match="no config.json"):
        import_hf_model(str(tmp_path), str(tmp_path / "x.nemo"))
    (tmp_path / "m" / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ConfigError, match=r"m/config\.json: not valid JSON"):
        import_hf_model(str(tmp_path / "m"), str(tmp_path / "x.nemo"))
    (tmp_path / "m" / "config.json").write_text('["llama"]')
    with pytest.raises(ConfigError, match=r"m/config\.json: must hold a JSON object, got list"):
        import_hf_model(str(tmp_path / "m"), str(tmp_path / "x.nemo"))


def test_unreadable_weight_files_are_named(tmp_path):
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.models.nlp.gpt.hf_interop import read_hf_weights

    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{trunc")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        read_hf_weights(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot be read as a weights file"):
        read_hf_weights(str(tmp_path))


def test_export_refuses_what_it_would_destroy_or_drop(tmp_path, mcore_single):
    """The export replaces its output directory whole: a directory holding the user's other files,
    or the current directory, is refused (nothing in it touched); a reward model's head has no
    causal-LM place, so a reward model is refused rather than exported without it."""
    from omegaconf import OmegaConf

    from conftest import TINY_GPT2_ARCH
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.models.nlp.gpt.hf_interop import export_to_hf
    from nemo_aligner.utils.nemo_file import save_nemo
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    cfg = OmegaConf.create(dict(TINY_GPT2_ARCH, micro_batch_size=1, encoder_seq_length=32))
    policy = save_nemo(GPTSFTModel(cfg, ByteTokenizer()), str(tmp_path / "policy.nemo"))
    rm = save_nemo(MegatronGPTRewardModel(cfg, ByteTokenizer(), trainable=False), str(tmp_path / "rm.nemo"))
    mine = tmp_path / "my_folder"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(ConfigError, match=r"my_folder holds files an export does not write \(notes\.txt, sub\)"):
        export_to_hf(policy, str(mine))
    assert (mine / "notes.txt").read_text() == "precious" and (mine / "sub").is_dir()
    cwd = os.getcwd()
    try:
        os.chdir(mine)
        with pytest.raises(ConfigError, match=r"cannot be the current directory"):
            export_to_hf(policy, ".")
    finally:
        os.chdir(cwd)
    with pytest.raises(ConfigError, match=r"rm\.nemo is a reward model or critic \(it has model\.rm_head\."):
        export_to_hf(rm, str(tmp_path / "rm_hf"))
    assert not (tmp_path / "rm_hf").exists()
    out = export_to_hf(policy, str(tmp_path / "policy_hf"))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"]


def test_nemo_rope_scaling_keys():
    """NeMo's RoPE scaling keys: ``scale_factor`` (default 8; ``rope_scaling_factor``, this project's
    earlier name, still read); the other factors only at the values megatron-core computes with."""
    from nemo_aligner.models.nlp.gpt.gpt_builder import rope_scaling_factor

    assert rope_scaling_factor({}) == 8.0
    assert rope_scaling_factor({"scale_factor": 32}) == 32.0
    assert rope_scaling_factor({"rope_scaling_factor": 16.0}) == 16.0
    assert rope_scaling_factor({"low_freq_factor": 1, "high_freq_factor": 4.0, "old_context_len": 8192}) == 8.0
    for key, value in (("low_freq_factor", 2), ("high_freq_factor", 8), ("old_context_len", 4096)):
        with pytest.raises(ConfigError, match=rf"^model\.{key}={value} is not supported"):
            rope_scaling_factor({key: value})


def test_llama3_rope_scaling_imports_and_exports(tmp_path, mcore_single):
    """Llama 3.1/3.2's RoPE scaling (rope_type llama3) maps to NeMo's scale_positional_embedding and
    back; the logits match transformers' (the scaling changes most rotary frequencies at every
    position, so a model without it differs). Other scalings stay refused."""
    import transformers as tf

    from nemo_aligner.models.nlp.gpt.hf_interop import export_to_hf, import_hf_model
    from nemo_aligner.utils.nemo_file import read_model_config

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rope_theta=500000.0, rope_scaling=scaling, rms_norm_eps=1e-5)
    hf = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper attention, so positions (and so the scaling) move the logits visibly
        for name, p in hf.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(30.0)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (2, 64))
    with torch.no_grad():
        expected = hf(tokens).logits
    nemo = import_hf_model(str(tmp_path / "hf"), str(tmp_path / "m.nemo"))
    model_cfg = read_model_config(nemo)
    # NeMo's key (MegatronGPTModel reads scale_factor, default 8), so NeMo computes the same
    assert model_cfg.scale_positional_embedding is True and model_cfg.scale_factor == 32.0
    torch.testing.assert_close(our_logits(nemo, tokens), expected, atol=2e-5, rtol=1e-4)
    out = export_to_hf(nemo, str(tmp_path / "out"))
    back = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, atol=2e-5, rtol=1e-4)
    plain = json.load(open(tmp_path / "hf" / "config.json"))
    plain.pop("rope_scaling", None)
    plain["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(plain))
    for name in os.listdir(tmp_path / "hf"):
        if name.endswith(".safetensors"):
            os.link(tmp_path / "hf" / name, tmp_path / "plain" / name)
    unscaled = our_logits(import_hf_model(str(tmp_path / "plain"), str(tmp_path / "p.nemo")), tokens)
    assert (unscaled - expected).abs().max() > 1e-3  # the scaling mattered
    for other in ({"rope_type": "linear", "factor": 2.0}, dict(scaling, high_freq_factor=8.0)):
        bad = dict(plain, rope_parameters=dict(other, rope_theta=500000.0))
        (tmp_path / "plain" / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=r"RoPE scaling .* is not supported \(only Llama 3's 'llama3' type"):
            import_hf_model(str(tmp_path / "plain"), str(tmp_path / "x.nemo"))


def test_import_refuses_what_it_would_convert_wrongly(tmp_path, mcore_single):
    """Heads other than a causal LM's, sliding-window attention, GPT-2's per-layer attention scaling,
    tensors that would be dropped and a tokenizer larger than the model are errors naming the cause."""
    import transformers as tf

    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.models.nlp.gpt.hf_interop import import_hf_model

    def saved(model, name, edit=None):
        model.save_pretrained(tmp_path / name)
        if edit:
            path = tmp_path / name / "config.json"
            path.write_text(json.dumps(dict(json.load(open(path)), **edit)))
        return str(tmp_path / name)

    qwen = tiny_hf("qwen2", tie=True)
    classifier = tf.Qwen2ForSequenceClassification(qwen.config)
    with pytest.raises(ConfigError, match=r"architectures=\['Qwen2ForSequenceClassification'\] is not a causal"):
        import_hf_model(saved(classifier, "cls"), str(tmp_path / "x.nemo"))
    with pytest.raises(ConfigError, match=r"sliding-window attention"):
        import_hf_model(saved(qwen, "sw", {"use_sliding_window": True, "sliding_window": 4}), str(tmp_path / "x.nemo"))
    with pytest.raises(ConfigError, match=r"scale_attn_by_inverse_layer_idx=True"):
        import_hf_model(saved(tiny_hf("gpt2"), "g", {"scale_attn_by_inverse_layer_idx": True}), str(tmp_path / "x.nemo"))
    # a checkpoint with a tensor the architecture has no place for (the classifier's head, renamed)
    from safetensors.torch import load_file, save_file

    directory = saved(qwen, "extra")
    weights = os.path.join(directory, "model.safetensors")
    state = load_file(weights)
    state["score.weight"] = torch.zeros(2, 64)
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) have no place in the converted model \(score\.weight\)"):
        import_hf_model(directory, str(tmp_path / "x.nemo"))
    del state["score.weight"], state["model.norm.weight"]
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no tensor 'model\.norm\.weight' that this architecture needs"):
        import_hf_model(directory, str(tmp_path / "x.nemo"))
    # a tokenizer of 8 tokens on a model of 6 rows: ids 6 and 7 would have no embedding
    from test_checkpoints import make_hf_tokenizer

    small = saved(tiny_hf("llama"), "small_vocab", {"vocab_size": 6})
    state = {k: (v[:6] if v.shape[0] == VOCAB else v) for k, v in load_file(os.path.join(small, "model.safetensors")).items()}
    save_file(state, os.path.join(small, "model.safetensors"), metadata={"format": "pt"})
    make_hf_tokenizer(small)
    with pytest.raises(ConfigError, match=r"the tokenizer has 8 tokens, more than the model's vocab_size=6"):
        import_hf_model(small, str(tmp_path / "x.nemo"))


HOSTILE_CONFIG_VALUES = [
    ("llama", "hidden_size", "abc", "hidden_size='abc' must be a positive integer"),
    ("llama", "num_hidden_layers", None, "no num_hidden_layers (a positive integer)"),
    ("llama", "num_attention_heads", 1.5, "num_attention_heads=1.5 must be a positive integer"),
    ("llama", "num_key_value_heads", 3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ("llama", "vocab_size", 1e18, "tensor 'model.embed_tokens.weight' has shape [300, 64], but config.json's sizes "
                                  "give [1000000000000000000, 64]"),
    ("llama", "intermediate_size", 95, "tensor 'model.layers.0.mlp.gate_proj.weight' has shape [96, 64], but "
                                       "config.json's sizes give [95, 64]"),
    ("llama", "num_hidden_layers", 10**18, "no tensor 'model.layers.2.self_attn.q_proj.weight'"),
    ("llama", "rms_norm_eps", float("nan"), "rms_norm_eps=nan must be a positive number"),
    ("llama", "rope_parameters", [1], "rope_parameters=[1] must be an object"),
    ("llama", "tie_word_embeddings", "false", "tie_word_embeddings='false' must be true or false"),
    ("llama", "architectures", 7, "architectures=7 must be a list of class names"),
    ("gpt2", "n_embd", 48, "tensor 'wte.weight' has shape [300, 64], but config.json's sizes give [300, 48]"),
    ("gpt2", "n_head", 5, "n_embd=64 is not a multiple of n_head=5"),
    ("gpt2", "n_positions", {"a": 1}, "n_positions={'a': 1} must be a positive integer"),
    ("gpt2", "layer_norm_epsilon", -1, "layer_norm_epsilon=-1 must be a positive number"),
    ("gpt2", "scale_attn_weights", 0, "scale_attn_weights=0 must be true or false"),
]


@pytest.mark.parametrize("arch,key,value,message", HOSTILE_CONFIG_VALUES,
                         ids=[f"{a}-{k}-{v!r}" for a, k, v, _ in HOSTILE_CONFIG_VALUES])
def test_config_json_values_are_checked_before_the_model_is_built(tmp_path, arch, key, value, message):
    """A config.json value of the wrong type or range, or one that disagrees with the weights' shapes, is a
    one-line error naming it, before any model is built (a size of 1e18 would otherwise be allocated)."""
    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.models.nlp.gpt.hf_interop import import_hf_model

    tiny_hf(arch).save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    config = json.load(open(path))
    config.pop(key) if value is None else config.update({key: value})
    path.write_text(json.dumps(config))
    with pytest.raises((ConfigError, CheckpointError)) as refusal:
        import_hf_model(str(tmp_path / "m"), str(tmp_path / "x.nemo"))
    assert message in str(refusal.value) and "\n" not in str(refusal.value)
    assert not (tmp_path / "x.nemo").exists()


def test_tied_embeddings_never_drop_a_distinct_output_layer(tmp_path, mcore_single):
    """tie_word_embeddings=true over a checkpoint whose lm_head differs from its embedding would drop the
    trained output layer: refused; an lm_head equal to the embedding (a tied model saved with both) imports."""
    from safetensors.torch import load_file, save_file

    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.models.nlp.gpt.hf_interop import import_hf_model

    untied = tiny_hf("llama", tie=False)
    untied.save_pretrained(tmp_path / "m")
    path = tmp_path / "m" / "config.json"
    path.write_text(json.dumps(dict(json.load(open(path)), tie_word_embeddings=True)))
    with pytest.raises(CheckpointError, match=r"tie_word_embeddings is true but lm_head\.weight differs from "
                                              r"model\.embed_tokens\.weight"):
        import_hf_model(str(tmp_path / "m"), str(tmp_path / "x.nemo"))
    weights = tmp_path / "m" / "model.safetensors"
    state = load_file(weights)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, weights, metadata={"format": "pt"})
    assert os.path.exists(import_hf_model(str(tmp_path / "m"), str(tmp_path / "x.nemo")))


def test_export_carries_special_token_ids_chat_template_and_the_original_tokenizer(tmp_path, mcore_single):
    """generate() on an export stops at the model's EOS: config.json and generation_config.json name
    the tokenizer's ids; the chat template travels; the exported tokenizer is the imported one (no
    pad token added)."""
    import transformers as tf

    from test_checkpoints import make_hf_tokenizer
    from nemo_aligner.models.nlp.gpt.hf_interop import export_to_hf, import_hf_model

    hf = tiny_hf("llama")
    hf.save_pretrained(tmp_path / "hf")
    make_hf_tokenizer(str(tmp_path / "hf"))
    tok = tf.AutoTokenizer.from_pretrained(tmp_path / "hf")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path / "hf")
    assert tok.pad_token is None and tok.eos_token_id == 2 and tok.bos_token_id == 1
    nemo = import_hf_model(str(tmp_path / "hf"), str(tmp_path / "m.nemo"))
    out = export_to_hf(nemo, str(tmp_path / "out"))
    config = json.load(open(os.path.join(out, "config.json")))
    assert (config["eos_token_id"], config["bos_token_id"]) == (2, 1) and "pad_token_id" not in config
    generation = tf.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == 2
    back = tf.AutoTokenizer.from_pretrained(out)
    assert back.pad_token is None and back.chat_template == tok.chat_template
    assert back.apply_chat_template([{"role": "user", "content": "abc"}], tokenize=False) == "abc"


def test_export_refuses_configs_hugging_face_cannot_express(tmp_path, mcore_single):
    from nemo_aligner.models.nlp.gpt.hf_interop import hf_config_from_nemo

    base = {"normalization": "rmsnorm", "activation": "swiglu", "position_embedding_type": "rope", "bias": False,
            "num_attention_heads": 4, "hidden_size": 64, "ffn_hidden_size": 96, "num_layers": 2,
            "max_position_embeddings": 64, "padded_vocab_size": 384}
    assert hf_config_from_nemo(dict(base, seq_len_interpolation_factor=None, rotary_percentage=1.0))[0] == "llama"
    for key, value in (("qk_layernorm", True), ("rotary_percentage", 0.5), ("seq_len_interpolation_factor", 4)):
        with pytest.raises(ConfigError, match=rf"model\.{key}={value}: Llama, Qwen2 and GPT-2 configs cannot express"):
            hf_config_from_nemo(dict(base, **{key: value}))


def test_nemo_converter_command_line_and_bf16_weights(tmp_path, mcore_single, capsys):
    """NeMo's convert_*_hf_to_nemo.py spellings (--input_name_or_path, --output_path, --precision) on
    convert_hf_to_nemo.py: bf16 weights in the .nemo, logits within bf16 rounding of Hugging Face's."""
    import importlib.util

    from conftest import SCRIPTS
    from nemo_aligner.utils.nemo_file import extracted

    spec = importlib.util.spec_from_file_location("convert_hf_to_nemo", os.path.join(SCRIPTS, "convert_hf_to_nemo.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    hf = tiny_hf("llama")
    hf.save_pretrained(tmp_path / "hf")
    nemo = str(tmp_path / "bf16.nemo")
    script.main(["--input_name_or_path", str(tmp_path / "hf"), "--output_path", nemo, "--precision", "bf16-mixed"])
    assert ".nemo written to" in capsys.readouterr().out
    with extracted(nemo, "nemo") as directory:
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(os.path.join(directory, "model_weights")).read_metadata()
        dtypes = {name: m.properties.dtype for name, m in metadata.state_dict_metadata.items()
                  if hasattr(m, "properties") and "_extra_state" not in name}
    assert dtypes and set(dtypes.values()) == {torch.bfloat16}, dtypes
    tokens = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        expected = hf(tokens).logits
    torch.testing.assert_close(our_logits(nemo, tokens), expected, atol=3e-2, rtol=3e-2)  # loaded at fp32
    with pytest.raises(ConfigError, match=r"precision='fp8' is not one of 32, bf16, 16"):
        script.main(["--in-file", str(tmp_path / "hf"), "--out-file", str(tmp_path / "x.nemo"), "--precision", "fp8"])
    with pytest.raises(ConfigError, match=r"mistralai/Mistral-7B-v0\.1: no such directory \(nothing is downloaded"):
        script.main(["--input_name_or_path", "mistralai/Mistral-7B-v0.1", "--output_path", str(tmp_path / "x.nemo")])


def test_nemo_to_hf_takes_nemos_command_line(tmp_path, mcore_single, capsys, caplog):
    """NeMo's convert_*_nemo_to_hf.py spellings: --output_path alone writes the weights as one torch
    state dict in Hugging Face's names; with --hf_output_path the directory too; --precision defaults to
    the .nemo's (bf16 here); --hf_input_path and --input_tokenizer are named as not read."""
    import importlib.util

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from conftest import SCRIPTS

    def script(name):
        spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    hf = tiny_hf("llama")
    hf.save_pretrained(tmp_path / "hf")
    nemo = str(tmp_path / "bf16.nemo")
    script("convert_hf_to_nemo").main(["--input_name_or_path", str(tmp_path / "hf"), "--output_path", nemo,
                                       "--precision", "bf16"])
    to_hf = script("convert_nemo_to_hf")
    weights = tmp_path / "pytorch_model.bin"
    to_hf.main(["--input_name_or_path", nemo, "--output_path", str(weights)])
    assert f"weights written to {weights}" in capsys.readouterr().out
    state = torch.load(weights)
    assert set(state) == set(hf.state_dict()) and {v.dtype for v in state.values()} == {torch.bfloat16}
    torch.testing.assert_close(state["model.layers.1.mlp.down_proj.weight"],
                               hf.state_dict()["model.layers.1.mlp.down_proj.weight"].bfloat16())
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        to_hf.main(["--input_name_or_path", nemo, "--output_path", str(tmp_path / "again.bin"),
                    "--hf_input_path", str(tmp_path / "hf"), "--hf_output_path", str(out), "--precision", "fp32",
                    "--input_tokenizer", "tok.model", "--cpu-only"])
    assert "--hf_input_path=" in caplog.text and "--input_tokenizer=tok.model is not read" in caplog.text
    assert (tmp_path / "again.bin").is_file()
    assert {v.dtype for v in load_file(out / "model.safetensors").values()} == {torch.float32}
    assert json.load(open(out / "config.json"))["torch_dtype"] == "float32"
    tokens = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(out)(tokens).logits, hf(tokens).logits,
                                   atol=3e-2, rtol=3e-2)  # bf16 in the .nemo
    mistral_style = tmp_path / "mistral_style"  # the Mistral/Mixtral scripts: --output_path is the directory
    to_hf.main(["--input_name_or_path", nemo, "--output_path", str(mistral_style), "--hf_model_name", "x/y"])
    assert {"config.json", "model.safetensors"} <= set(os.listdir(mistral_style))
    assert {v.dtype for v in load_file(mistral_style / "model.safetensors").values()} == {torch.bfloat16}
    with pytest.raises(SystemExit):
        to_hf.main(["--input_name_or_path", nemo])
    with pytest.raises(SystemExit):
        to_hf.main(["--input_name_or_path", nemo, "--output_path", str(mistral_style), "--hf_output_path", str(out)])
    with pytest.raises(ConfigError, match=r"precision='fp8' is not one of 32, bf16, 16"):
        to_hf.main(["--input_name_or_path", nemo, "--output_path", str(weights), "--precision", "fp8"])


def test_export_and_resave_name_what_is_damaged_in_a_nemo(tmp_path, mcore_single):
    """An emptied weights index (.metadata) and model_config.yaml values of the wrong type are one-line
    errors from the HF export and the mcore re-save, as from training (they were tracebacks)."""
    import io
    import tarfile

    import yaml

    from nemo_aligner.utils.errors import CheckpointError
    from nemo_aligner.models.nlp.gpt.hf_interop import export_to_hf, import_hf_model, resave_as_mcore

    tiny_hf("llama").save_pretrained(tmp_path / "hf")
    good = import_hf_model(str(tmp_path / "hf"), str(tmp_path / "good.nemo"))

    def damaged(name, edit):
        out = str(tmp_path / name)
        with tarfile.open(good, "r:") as src, tarfile.open(out, "w:") as dst:
            for member in src.getmembers():
                data = src.extractfile(member).read() if member.isfile() else None
                if data is not None:
                    data = edit(member.name, data)
                    member.size = len(data)
                dst.addfile(member, io.BytesIO(data) if data is not None else None)
        return out

    def config_edit(**values):
        def edit(name, data):
            return yaml.safe_dump(dict(yaml.safe_load(data), **values)).encode() if name.endswith("model_config.yaml") \
                else data
        return edit

    cases = [(damaged("index.nemo", lambda name, data: b"" if name.endswith(".metadata") else data), CheckpointError,
              r"its index \(\.metadata\) cannot be read \(EOFError"),
             (damaged("vocab.nemo", config_edit(padded_vocab_size={"x": 1})), ConfigError,
              r"model\.padded_vocab_size=\{'x': 1\} must be an integer, got a dict"),
             (damaged("layers.nemo", config_edit(num_layers=None)), ConfigError, r"model\.num_layers=null: this key needs"),
             (damaged("eps.nemo", config_edit(layernorm_epsilon=[1])), ConfigError, r"model\.layernorm_epsilon=\[1\] must"),
             (damaged("recompute.nemo", config_edit(activations_checkpoint_granularity=-1)), ConfigError,
              r"model\.activations_checkpoint_granularity=-1 must be one of full, selective, null")]
    for path, error, pattern in cases:
        for convert in (lambda: export_to_hf(path, str(tmp_path / "out")),
                        lambda: resave_as_mcore(path, str(tmp_path / "mcore.nemo"))):
            with pytest.raises(error, match=pattern) as refusal:
                convert()
            assert "\n" not in str(refusal.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "mcore.nemo").exists()
