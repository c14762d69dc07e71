"""LoRA adapters to and from Hugging Face PEFT (convert_nemo_to_canonical.py --hf_format,
convert_hf_to_canonical.py): adapters made with the real ``peft`` library give, converted, our model's
logits equal to PEFT's; ours, exported, load into PEFT with our logits."""

import json
import os

import pytest
import torch
from omegaconf import OmegaConf

from conftest import forward_logits, run_script
from nemo_aligner.utils.errors import AlignerError
from test_hf_interop import VOCAB, tiny_hf

peft = pytest.importorskip("peft", reason="peft is in the test extra ([test]); install it to run these")

PEFT_TARGETS = {  # projections left out (k_proj, up_proj) become zero adapters on our side
    "llama": dict(target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]),
    "gemma": dict(target_modules=["k_proj", "up_proj"], use_rslora=True, layers_to_transform=[1]),
    "gpt2": dict(target_modules=["c_attn", "attn.c_proj", "c_fc"], fan_in_fan_out=True),
}


def _peft_model(hf, arch):
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=12, init_lora_weights=False, **PEFT_TARGETS[arch])
    return peft.get_peft_model(hf, config).eval()


def _ours(base, adapters, tokens):
    """Our logits of ``base`` with the adapters-only .nemo ``adapters`` (its own peft keys)."""
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import read_model_config

    peft_cfg = OmegaConf.to_container(read_model_config(adapters, "adapters").peft)
    peft_cfg["restore_from_path"] = str(adapters)
    model = load_model(GPTSFTModel, OmegaConf.create({"micro_batch_size": 1, "peft": peft_cfg}), "32", str(base),
                       trainable=False)
    model.eval()
    return forward_logits(model, tokens)[..., :VOCAB]


def _base(tmp_path, arch):
    from nemo_aligner.models.nlp.gpt.hf_interop import import_hf_model

    hf = tiny_hf(arch)
    hf.save_pretrained(tmp_path / "hf")
    return hf, import_hf_model(str(tmp_path / "hf"), str(tmp_path / "base.nemo"))


@pytest.mark.stack
@pytest.mark.parametrize("arch", ["llama", "gemma", "gpt2"])
def test_peft_adapters_convert_both_ways_with_peft_logits(tmp_path, mcore_single, arch):
    """PEFT adapters (random A and B; GQA/MQA; some projections and layers left out; rsLoRA's scale) ->
    convert_hf_to_canonical.py -> our model's logits equal PEFT's; exported back (--hf_format), PEFT
    loads them with the same logits."""
    import transformers as tf

    from nemo_aligner.models.nlp.gpt.peft_interop import nemo_to_hf_peft
    from nemo_aligner.utils.nemo_file import read_model_config

    hf, base = _base(tmp_path, arch)
    tokens = torch.randint(0, VOCAB, (2, 13))
    with torch.no_grad():
        plain = hf(tokens).logits
    model = _peft_model(hf, arch)
    with torch.no_grad():
        expected = model(tokens).logits
    assert (expected - plain).abs().max() > 1e-2  # the adapters matter
    model.save_pretrained(tmp_path / "hf_lora")
    run_script("convert_hf_to_canonical.py", ["--hf_lora_path", tmp_path / "hf_lora", "--output_path",
                                              tmp_path / "lora.nemo", "--nemo_config", base])
    tuning = read_model_config(str(tmp_path / "lora.nemo"), "adapters").peft.lora_tuning
    assert tuning.variant == ("nemo" if arch == "gpt2" else "canonical") and tuning.adapter_dim == 4
    assert list(tuning.layer_selection or []) == ([2] if arch == "gemma" else [])
    torch.testing.assert_close(_ours(base, tmp_path / "lora.nemo", tokens), expected, atol=2e-5, rtol=1e-4)
    if arch == "llama":  # the converted adapters merge into their base (the .nemo named as base)
        proc = run_script("merge_lora_weights.py", [f"lora_model_path={tmp_path / 'lora.nemo'}",
                                                    f"merged_model_path={tmp_path / 'merged.nemo'}",
                                                    "trainer.precision=32"])
        assert "8 adapters merged" in proc.stdout, proc.stdout  # 2 layers x qkv, dense, fc1, fc2
        from test_hf_interop import our_logits

        torch.testing.assert_close(our_logits(str(tmp_path / "merged.nemo"), tokens), expected, atol=2e-5,
                                   rtol=1e-4)

    out = nemo_to_hf_peft(str(tmp_path / "lora.nemo"), str(tmp_path / "back"))
    again = peft.PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"), out).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(tokens).logits, expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", ["nemo", "canonical"])
def test_our_adapters_export_to_peft(tmp_path, mcore_single, variant):
    """Adapters trained here (either variant, all targets, layer 2 only) -> --hf_format -> PEFT on the
    base's Hugging Face model gives our logits; without --hf_format, the canonical .nemo gives them too."""
    import transformers as tf

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import read_model_config, save_nemo

    _, base = _base(tmp_path, "llama")
    cfg = OmegaConf.create({"micro_batch_size": 1, "seed": 3, "peft": {"peft_scheme": "lora", "lora_tuning": {
        "variant": variant, "target_modules": ["all"], "adapter_dim": 4, "alpha": 6,
        "row_init_method": "normal", "layer_selection": [2]}}})
    model = load_model(GPTSFTModel, cfg, "32", base)
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, 13))
    ours = forward_logits(model, tokens)[..., :VOCAB]
    adapters = save_nemo(model, str(tmp_path / "ours.nemo"))
    run_script("convert_nemo_to_canonical.py", ["--nemo_lora_path", adapters, "--output_path", tmp_path / "hf_lora",
                                                "--hf_format"])
    config = json.loads((tmp_path / "hf_lora" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["layers_to_transform"]) == (4, 6, [1])
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    hf = peft.PeftModel.from_pretrained(tf.AutoModelForCausalLM.from_pretrained(tmp_path / "hf"),
                                        tmp_path / "hf_lora").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours, atol=2e-5, rtol=1e-4)

    run_script("convert_nemo_to_canonical.py", ["--nemo_lora_path", adapters, "--output_path",
                                                tmp_path / "canonical.nemo"])
    assert read_model_config(str(tmp_path / "canonical.nemo"), "adapters").peft.lora_tuning.variant == "canonical"
    torch.testing.assert_close(_ours(base, tmp_path / "canonical.nemo", tokens), ours, atol=2e-5, rtol=1e-4)


def test_what_has_no_counterpart_is_refused_in_one_line(tmp_path, mcore_single):
    """DoRA, a fully trained lm_head, a rank that does not fit the model, a config of another model, a
    directory of other files and canonical adapters on GPT-2 are refused naming the key or tensor."""
    from safetensors.torch import load_file, save_file

    from nemo_aligner.models.nlp.gpt.peft_interop import hf_peft_to_nemo, nemo_to_hf_peft

    hf, base = _base(tmp_path, "llama")
    _peft_model(hf, "llama").save_pretrained(tmp_path / "good")

    def variant(name, config=None, weights=None):
        path = tmp_path / name
        path.mkdir()
        cfg = json.loads((tmp_path / "good" / "adapter_config.json").read_text())
        state = load_file(tmp_path / "good" / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps(dict(cfg, **(config or {}))))
        save_file(weights(state) if weights else state, path / "adapter_model.safetensors")
        return str(path)

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    cases = {
        variant("dora", {"use_dora": True}): "use_dora=True",
        variant("head", weights=lambda s: dict(s, **{"base_model.model.lm_head.weight": torch.zeros(300, 64)})):
            "base_model.model.lm_head.weight is not a LoRA matrix",
        variant("rank", weights=lambda s: dict(s, **{key: torch.zeros(64, 3)})):
            "layer 0's lora_B for self_attn.q_proj",
        variant("nan", weights=lambda s: dict(s, **{key: torch.full((64, 4), float("nan"))})): f"{key} holds a NaN",
        variant("halves", weights=lambda s: {k: v for k, v in s.items() if k != key}):
            "has lora_A or lora_B but not both",
        variant("dim", {"r": 0}): "r=0 must be a positive integer",
    }
    for path, message in cases.items():
        with pytest.raises(AlignerError, match=message):
            hf_peft_to_nemo(path, str(tmp_path / "x.nemo"), base)
    assert not (tmp_path / "x.nemo").exists()
    proc = run_script("convert_hf_to_canonical.py", ["--hf_lora_path", tmp_path / "dora", "--output_path",
                                                     tmp_path / "x.nemo", "--nemo_config", base], check=False)
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0 and "use_dora" in proc.stderr, proc.stderr

    good = hf_peft_to_nemo(str(tmp_path / "good"), str(tmp_path / "good.nemo"), base)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(AlignerError, match="holds files an export does not write"):
        nemo_to_hf_peft(good, str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"

    (tmp_path / "g").mkdir()
    _, gpt2 = _base(tmp_path / "g", "gpt2")
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.utils.nemo_file import save_nemo

    cfg = OmegaConf.create({"micro_batch_size": 1, "peft": {"peft_scheme": "lora", "lora_tuning": {
        "variant": "canonical", "target_modules": ["attention_qkv"], "adapter_dim": 4}}})
    canonical = save_nemo(load_model(GPTSFTModel, cfg, "32", gpt2), str(tmp_path / "g" / "lora.nemo"))
    with pytest.raises(AlignerError, match="c_attn is one fused layer"):
        nemo_to_hf_peft(canonical, str(tmp_path / "g" / "out"))


def test_mixture_of_experts_adapters(tmp_path, mcore_single):
    """On a routed model the canonical .nemo keeps the experts' adapters as they are (NeMo's canonical
    variant does) and gives the same logits; PEFT export refuses the experts' adapters, naming one."""
    from conftest import TINY_ARCH

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.peft_interop import nemo_to_canonical, nemo_to_hf_peft
    from nemo_aligner.utils.nemo_file import save_nemo
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    torch.manual_seed(0)
    arch = dict(TINY_ARCH, num_moe_experts=4, moe_router_topk=2, micro_batch_size=1)
    base = save_nemo(GPTSFTModel(OmegaConf.create(arch), ByteTokenizer(), "32"), str(tmp_path / "base.nemo"))
    cfg = OmegaConf.create({"micro_batch_size": 1, "peft": {"peft_scheme": "lora", "lora_tuning": {
        "target_modules": ["all"], "adapter_dim": 4, "row_init_method": "normal"}}})
    model = load_model(GPTSFTModel, cfg, "32", base)
    model.eval()
    tokens = torch.randint(0, VOCAB, (2, 11))
    ours = forward_logits(model, tokens)[..., :VOCAB]
    adapters = save_nemo(model, str(tmp_path / "lora.nemo"))
    canonical = nemo_to_canonical(adapters, str(tmp_path / "canonical.nemo"))
    torch.testing.assert_close(_ours(base, canonical, tokens), ours, atol=1e-5, rtol=1e-5)
    with pytest.raises(AlignerError, match=r"local_experts\.\d\.adapter_layer.* is an expert's adapter"):
        nemo_to_hf_peft(adapters, str(tmp_path / "hf_lora"))
    assert not (tmp_path / "hf_lora").exists()
