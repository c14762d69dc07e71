"""Hugging Face import and export: tiny random Llama, Qwen2 and GPT-2 models made here give the
same logits as the megatron-core model converted from them, and back."""

import json
import os

import pytest
import torch

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
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model.module(tokens, positions, None)[..., :VOCAB]


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen2", True), ("gpt2", True)])
def test_import_export_logits_match(tmp_path, mcore_single, arch, tie):
    import transformers as tf

    from nemo_aligner.utils.hf_interop import export_to_hf, import_hf_model

    hf = tiny_hf(arch, tie)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        expected = hf(tokens).logits
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
    assert json.load(open(os.path.join(out, "config.json")))["model_type"] == arch
    if arch == "llama":  # exporting again over it: replaced whole, and what a kill left beside it is tidied
        (tmp_path / "exported.old.99").mkdir()
        export_to_hf(nemo, out)
        assert sorted(p for p in os.listdir(tmp_path) if p.startswith("exported")) == ["exported"]
        with torch.no_grad():
            torch.testing.assert_close(tf.AutoModelForCausalLM.from_pretrained(out).eval()(tokens).logits, expected,
                                       atol=2e-5, rtol=1e-4)


def test_unsupported_models_are_named(tmp_path, mcore_single):
    from nemo_aligner.utils.hf_interop import import_hf_model

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 300}))
    with pytest.raises(ConfigError, match=r"config\.json: model_type='bert' is not supported; supported: llama, qwen2, gpt2"):
        import_hf_model(str(tmp_path / "m"), str(tmp_path / "x.nemo"))
    with pytest.raises(ConfigError, match="no config.json"):
        import_hf_model(str(tmp_path), str(tmp_path / "x.nemo"))
