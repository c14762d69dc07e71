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


def test_export_refuses_what_it_would_destroy_or_drop(tmp_path, mcore_single):
    """The export replaces its output directory whole: a directory holding the user's other files,
    or the current directory, is refused (nothing in it touched); a reward model's head has no
    causal-LM place, so a reward model is refused rather than exported without it."""
    from omegaconf import OmegaConf

    from conftest import TINY_GPT2_ARCH
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.utils.hf_interop import export_to_hf
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
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
