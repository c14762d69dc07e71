""".nemo files as NeMo writes them: every tokenizer library, activation, archive and weight format.

Each checkpoint is built here from a tiny model's weights in the layout NeMo uses, loaded with
``load_model`` and compared with a forward of the original weights; tokenizers are compared with
their own libraries id for id.
"""

import base64
import json
import logging
import os
import re
import shutil
import tarfile

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from conftest import TINY_ARCH, forward_logits

TEXTS = ["hello world, the quick brown fox", "  two  spaces and ünïcödé 123", "<extra_id_0>User\nhi<extra_id_1>", ""]


# ----------------------------------------------------------------- tokenizers
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    lines = ["the quick brown fox jumps over the lazy dog", "hello world, alignment with nemo aligner",
             "ünïcödé text 123 and more words here", "User System Assistant turn"] * 40
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def sp_model(corpus):
    import sentencepiece as spm

    prefix = corpus.parent / "sp"
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix), vocab_size=90, model_type="bpe",
                                   character_coverage=1.0, bos_id=1, eos_id=2, unk_id=0, pad_id=-1,
                                   minloglevel=2)
    return str(prefix) + ".model"


def test_sentencepiece_ids_equal_the_library(sp_model):
    import sentencepiece as spm

    from nemo_aligner.utils.tokenizers import build_tokenizer

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    tok = build_tokenizer({"library": "sentencepiece", "model": sp_model, "sentencepiece_legacy": False})
    for text in TEXTS:
        assert tok.text_to_ids(text) == sp.encode(text)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (1, 2, 90)
    assert tok.pad_id == 2  # the model has no pad piece: EOS pads


def test_sentencepiece_legacy_special_tokens_follow_nemo(sp_model):
    """NeMo's legacy mode: unknown special tokens get ids after the pieces and are split out of text
    (a '▁' piece right after one is dropped); a known piece keeps its id; the key's absence means legacy."""
    import sentencepiece as spm

    from nemo_aligner.utils.tokenizers import build_tokenizer

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    cfg = {"library": "sentencepiece", "model": sp_model,
           "special_tokens": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                              "additional_special_tokens": None}}
    cfg["special_tokens"].pop("additional_special_tokens")
    tok = build_tokenizer(dict(cfg, additional_special_tokens=["<extra_id_0>", "<extra_id_1>"]))
    assert tok.legacy  # no sentencepiece_legacy key: NeMo's default for library sentencepiece
    assert tok.vocab_size == 93 and tok.pad_id == 90 and tok.eos_id == 2  # <pad> 90, markers 91, 92
    ids = tok.text_to_ids("<extra_id_0>User\nhi<extra_id_1> world")
    sep = sp.piece_to_id("\u2581")

    def after_special(text):  # NeMo drops a lone '▁' piece that starts the text after a special token
        pieces = sp.encode(text)
        return pieces[1:] if pieces and pieces[0] == sep else pieces

    assert sp.encode("User\nhi")[0] == sep  # so the rule is exercised
    assert ids == [91] + after_special("User\nhi") + [92] + after_special(" world")
    assert tok.ids_to_text(ids, skip_special=False).startswith("<extra_id_0>")


def test_gpt2_bpe_ids_equal_the_tokenizers_library(corpus, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    from nemo_aligner.utils.tokenizers import build_tokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=320, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(tmp_path))
    reference = ByteLevelBPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    reference.add_special_tokens(["<|endoftext|>"])
    tok = build_tokenizer({"library": "megatron", "type": "GPT2BPETokenizer",
                           "vocab_file": str(tmp_path / "vocab.json"), "merge_file": str(tmp_path / "merges.txt")})
    for text in TEXTS + ["end<|endoftext|>next"]:
        assert tok.text_to_ids(text) == reference.encode(text).ids
    assert tok.eos_id == reference.token_to_id("<|endoftext|>")


def _tiktoken_vocab(path, merges=(b"th", b"he", b"the", b" the", b"wo", b"rld", b"or", b"ld")):
    entries = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": chr(i)} for i in range(256)]
    for j, piece in enumerate(merges):
        entries.append({"rank": 256 + j, "token_bytes": base64.b64encode(piece).decode(), "token_str": piece.decode()})
    path.write_text(json.dumps(entries), encoding="utf-8")
    return {piece: i for i, piece in enumerate([bytes([i]) for i in range(256)] + list(merges))}


def test_tiktoken_ids_equal_the_library_shifted_by_the_special_ids(tmp_path):
    import tiktoken

    from nemo_aligner.utils.tokenizers import build_tokenizer
    from nemo_aligner.utils.tokenizers.tiktoken_tokenizer import PATTERN_TIKTOKEN

    ranks = _tiktoken_vocab(tmp_path / "vocab.json")
    enc = tiktoken.Encoding(name="reference", pat_str=PATTERN_TIKTOKEN, mergeable_ranks=ranks, special_tokens={})
    tok = build_tokenizer({"library": "tiktoken", "vocab_file": str(tmp_path / "vocab.json")})
    for text in TEXTS + ["the world"]:
        assert tok.text_to_ids(text) == [t + 1000 for t in enc.encode(text)]
        assert tok.ids_to_text(tok.text_to_ids(text)) == text
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (1, 2, 4, 1000 + len(ranks))


def test_byte_level_layouts():
    from nemo_aligner.utils.tokenizers import build_tokenizer

    nemo1 = build_tokenizer({"library": "byte-level"})  # NeMo 1.x: 259 ids, specials never parsed from text
    assert (nemo1.vocab_size, nemo1.pad_id, nemo1.bos_id, nemo1.eos_id) == (259, 256, 257, 258)
    assert nemo1.text_to_ids("é<eos>") == list("é<eos>".encode())
    nemo2 = build_tokenizer({"library": "byte-level"}, padded_vocab_size=512)  # NeMo 2.x
    assert (nemo2.vocab_size, nemo2.eos_id, nemo2.pad_id, nemo2.bos_id) == (512, 0, 1, None)
    builtin = build_tokenizer(None)
    assert (builtin.pad_id, builtin.bos_id, builtin.eos_id) == (256, 257, 258)  # NeMo 1.x's ids
    assert builtin.text_to_ids("a<extra_id_0>") == [97, 259]
    assert build_tokenizer(builtin.config()).text_to_ids("a<extra_id_0>") == [97, 259]
    old = build_tokenizer({"library": "byte"})  # this project's earlier checkpoints
    assert (old.bos_id, old.eos_id, old.pad_id) == (256, 257, 258)


def test_refusals_name_the_key_and_what_is_supported(tmp_path):
    from nemo_aligner.utils.errors import ConfigError
    from nemo_aligner.utils.tokenizers import build_tokenizer

    cases = [({"library": "regex"}, "model.tokenizer.library='regex' is not supported (supported: byte-level"),
             ({"library": "megatron", "type": "BertWordPieceCase"}, "model.tokenizer.type='BertWordPieceCase'"),
             ({"library": "sentencepiece", "model": str(tmp_path / "none.model")}, "model.tokenizer.model="),
             ({"library": "huggingface", "type": "no-such-org/no-such-model"}, "nothing is downloaded")]
    for cfg, message in cases:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            build_tokenizer(cfg)


# ----------------------------------------------------------------- checkpoints
def _reference(tiny_cfg, tokenizer, seed=0):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel

    torch.manual_seed(seed)
    model = GPTSFTModel(OmegaConf.create(tiny_cfg), tokenizer)
    with torch.no_grad():  # norms away from their initial 1 (or 0 for layernorm1p) so their maths is tested
        for name, p in model.module.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _nemo_dir(path, config: dict, tokenizer_files=()):
    path.mkdir(parents=True)
    (path / "model_config.yaml").write_text(yaml.safe_dump(config), encoding="utf-8")
    for name, src in tokenizer_files:
        shutil.copy(src, path / name)
    return path


def _tar(directory, out, mode="w:"):
    with tarfile.open(out, mode) as tar:
        for name in sorted(os.listdir(directory)):
            tar.add(os.path.join(directory, name), arcname=f"./{name}")
    return str(out)


def _load(path, run_cfg=None):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.models.nlp.gpt.loading import load_model

    cfg = OmegaConf.create(dict(micro_batch_size=1, **(run_cfg or {})))
    return load_model(GPTSFTModel, cfg, "32", restore_path=str(path))


def _model_config(tiny_cfg, tokenizer_cfg, **extra):
    cfg = {k: v for k, v in tiny_cfg.items() if k not in ("micro_batch_size",)}
    cfg.update(tokenizer=tokenizer_cfg, precision=32, **extra)
    return cfg


def _legacy_names(state: dict, tp: int, fused: bool) -> list:
    """NeMo's Megatron (pre-mcore) key names for a megatron-core state dict, split over ``tp`` ranks as
    NeMo's tensor parallel layers hold them: fc1's gate and up halves in two linears (swiglu), or in one
    (fast-swiglu: [gate_r; up_r] on rank r)."""
    layer_map = {"input_layernorm": "input_layernorm", "self_attention.linear_qkv": "self_attention.query_key_value",
                 "self_attention.linear_proj": "self_attention.dense", "pre_mlp_layernorm": "post_attention_layernorm",
                 "mlp.linear_fc2": "mlp.dense_4h_to_h"}
    shards = [{} for _ in range(tp)]

    def put(name, tensor, dim):
        parts = tensor.chunk(tp, dim=dim) if dim is not None else [tensor] * tp
        for r in range(tp):
            shards[r][name] = parts[r].clone()

    for key, tensor in state.items():
        if key.endswith("_extra_state"):
            continue
        if key == "embedding.word_embeddings.weight":
            put("model.language_model.embedding.word_embeddings.weight", tensor, 0)
        elif key == "output_layer.weight":
            put("model.language_model.output_layer.weight", tensor, 0)
        elif key.startswith("decoder.final_layernorm"):
            put("model.language_model.encoder." + key[len("decoder."):], tensor, None)
        else:
            _, _, index, rest = key.split(".", 3)
            prefix = f"model.language_model.encoder.layers.{index}."
            module, param = rest.rsplit(".", 1)
            if module == "mlp.linear_fc1":
                gate, up = tensor.chunk(2, dim=0)
                if fused:
                    for r, (g, u) in enumerate(zip(gate.chunk(tp), up.chunk(tp))):
                        shards[r][prefix + f"mlp.dense_h_to_4h.{param}"] = torch.cat([g, u])
                    continue
                put(prefix + f"mlp.dense_h_to_4h.{param}", gate, 0)
                put(prefix + f"mlp.dense_h_to_4h_2.{param}", up, 0)
                continue
            dim = {"self_attention.linear_qkv": 0, "self_attention.linear_proj": 1, "mlp.linear_fc2": 1}.get(module)
            put(prefix + f"{layer_map[module]}.{param}", tensor, dim)
    return shards


def _zarr_write(directory, key, tensor):
    """One tensor as megatron-core's zarr strategy stored it: a zarr v2 array, Blosc-compressed, a chunk per layer."""
    import numcodecs
    import numpy as np

    array_dir = directory / key
    array_dir.mkdir(parents=True)
    data = tensor.detach().contiguous().numpy()
    chunks = [1] + list(data.shape[1:]) if data.ndim > 1 else list(data.shape)
    codec = numcodecs.Blosc(cname="lz4", clevel=5, shuffle=1)
    meta = {"zarr_format": 2, "shape": list(data.shape), "chunks": chunks, "dtype": "<f4", "order": "C",
            "compressor": codec.get_config(), "fill_value": None, "filters": None}
    (array_dir / ".zarray").write_text(json.dumps(meta))
    for i in range(data.shape[0] if data.ndim > 1 else 1):
        block = data[i:i + 1] if data.ndim > 1 else data
        name = ".".join(["0"] * data.ndim) if data.ndim <= 1 else ".".join([str(i)] + ["0"] * (data.ndim - 1))
        (array_dir / name).write_bytes(codec.encode(np.ascontiguousarray(block)))


TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight"}


@pytest.fixture(scope="module")
def llama_like(mcore_single, tmp_path_factory):
    """A NeMo-converted-Llama-shaped model (fast-swiglu, RMSNorm, RoPE, GQA, untied) and its logits."""
    from nemo_aligner.utils.tokenizers import build_tokenizer

    tok = build_tokenizer({"library": "byte-level"})
    tiny = dict(TINY_ARCH, activation="fast-swiglu", encoder_seq_length=24, micro_batch_size=1)
    model = _reference(tiny, tok)
    tokens = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(1))
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items() if not k.endswith("_extra_state")}
    return tiny, tok, state, tokens, forward_logits(model, tokens), tmp_path_factory.mktemp("llama_like")


@pytest.mark.stack
@pytest.mark.parametrize("activation", ["swiglu", "fast-swiglu"])
def test_legacy_megatron_names_tp2_sharded_gz_nemo(llama_like, activation):
    """NeMo's pre-mcore names, TP=2 shards in mp_rank_0X/, a gzip-compressed tar, no padded_vocab_size in the
    config: loads at TP=1 and computes the original logits."""
    tiny, tok, state, tokens, logits, work = llama_like
    cfg = _model_config(dict(tiny, activation=activation), tok.config(), mcore_gpt=False)
    directory = _nemo_dir(work / f"legacy_dir_{activation}", cfg)
    for rank, shard in enumerate(_legacy_names(state, tp=2, fused=activation.startswith("fast-"))):
        (directory / f"mp_rank_0{rank}").mkdir()
        torch.save(shard, directory / f"mp_rank_0{rank}" / "model_weights.ckpt")
    nemo = _tar(directory, work / f"legacy_{activation}.nemo", mode="w:gz")
    loaded = _load(nemo)
    assert loaded.cfg.encoder_seq_length == 24  # the checkpoint's, not a default
    torch.testing.assert_close(forward_logits(loaded, tokens), logits, rtol=0, atol=0)


def test_legacy_mcore_names_with_te_norms_in_one_ckpt(llama_like):
    tiny, tok, state, tokens, logits, work = llama_like
    stored = {}
    for key, tensor in state.items():
        for local, te in TE_NAMES.items():
            key = key.replace(local, te)
        stored["model.module." + key] = tensor  # megatron_amp_O2's prefix
    stored["model.module.decoder.layers.0.self_attention.core_attention._extra_state"] = torch.empty(0)
    directory = _nemo_dir(work / "mcore_ckpt_dir", _model_config(tiny, tok.config(), mcore_gpt=True,
                                                                   megatron_amp_O2=True))
    torch.save(stored, directory / "model_weights.ckpt")
    torch.testing.assert_close(forward_logits(_load(_tar(directory, work / "mcore_ckpt.nemo")), tokens), logits,
                               rtol=0, atol=0)


@pytest.mark.stack
def test_zarr_distributed_checkpoint(llama_like):
    tiny, tok, state, tokens, logits, work = llama_like
    directory = _nemo_dir(work / "zarr_dir", _model_config(tiny, tok.config(), mcore_gpt=True,
                                                             dist_ckpt_format="zarr"))
    weights = directory / "model_weights"
    weights.mkdir()
    (weights / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                       "common_backend": "torch", "common_backend_version": 1}))
    layers = {}
    for key, tensor in state.items():
        if key.startswith("decoder.layers."):
            _, _, index, rest = key.split(".", 3)
            layers.setdefault(TE_NAMES.get(rest, rest), {})[int(index)] = tensor
        else:
            _zarr_write(weights, "model." + key, tensor)
    for rest, per_layer in layers.items():
        _zarr_write(weights, "model.decoder.layers." + rest, torch.stack([per_layer[i] for i in sorted(per_layer)]))
    torch.testing.assert_close(forward_logits(_load(_tar(directory, work / "zarr.nemo")), tokens), logits,
                               rtol=0, atol=0)


def test_sentencepiece_nemo_round_trip_keeps_nemo_keys(llama_like, sp_model, tmp_path, caplog):
    """A .nemo whose tokenizer is a packed sentencepiece model (nemo:<uuid>_tokenizer.model) loads with
    that tokenizer, and saving writes the same keys back (no local paths); its HF export has the
    tokenizer converted to Hugging Face files that encode as sentencepiece does, with Llama's BOS."""
    from nemo_aligner.utils.nemo_file import save_nemo

    tiny, _, state, tokens, _, work = llama_like
    import sentencepiece as spm

    stored = "0123456789abcdef0123456789abcdef_tokenizer.model"
    cfg = _model_config(tiny, {"library": "sentencepiece", "type": None, "model": f"nemo:{stored}",
                               "vocab_file": None, "merge_file": None, "sentencepiece_legacy": False},
                        mcore_gpt=True)
    directory = _nemo_dir(tmp_path / "sp_dir", cfg, tokenizer_files=[(stored, sp_model)])
    torch.save({"model." + k: v for k, v in state.items()}, directory / "model_weights.ckpt")
    loaded = _load(_tar(directory, tmp_path / "sp.nemo"))
    assert loaded.tokenizer.text_to_ids("hello world") == spm.SentencePieceProcessor(model_file=sp_model).encode(
        "hello world")
    assert loaded.cfg.padded_vocab_size == state["embedding.word_embeddings.weight"].shape[0]
    out = save_nemo(loaded, str(tmp_path / "again.nemo"))
    with tarfile.open(out) as tar:
        written = yaml.safe_load(tar.extractfile("./model_config.yaml").read())
        names = [m.name[2:] for m in tar.getmembers()]
    tok_cfg = written["tokenizer"]
    assert tok_cfg["library"] == "sentencepiece" and tok_cfg["sentencepiece_legacy"] is False
    assert tok_cfg["model"].startswith("nemo:") and tok_cfg["model"][len("nemo:"):] in names
    assert tok_cfg["model"].endswith("_tokenizer.model") and "/" not in tok_cfg["model"]
    again = _load(out)
    torch.testing.assert_close(forward_logits(again, tokens), forward_logits(loaded, tokens), rtol=0, atol=0)
    from nemo_aligner.models.nlp.gpt.hf_interop import export_to_hf

    from transformers import AutoTokenizer

    with caplog.at_level("WARNING"):
        export_to_hf(out, str(tmp_path / "hf"))
    from test_hf_tokenizer_export import exact_sentencepiece_conversion

    if not exact_sentencepiece_conversion():  # transformers < 5.24: refused by name, the rest exported
        assert "needs transformers 5.24 or newer" in caplog.text, caplog.text
        assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json", "model.safetensors"]
        return
    # written; the one difference named is NFKC's (the model's normalizer: sentencepiece's default nmt_nfkc)
    assert "no tokenizer files" not in caplog.text and "a combining mark after a character NFKC replaces" in caplog.text
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "generation_config.json", "model.safetensors",
                                                   "tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"), local_files_only=True)
    sp = spm.SentencePieceProcessor(model_file=sp_model)
    for text in TEXTS:
        assert hf.encode(text) == [1] + sp.encode(text), text


def test_hf_hub_name_with_packed_tokenizer_files(llama_like, tmp_path):
    """``library: huggingface`` with a hub name for ``type`` and the tokenizer's files packed in the .nemo:
    loads offline, and the name (not a temporary directory) is written back."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from nemo_aligner.utils.nemo_file import save_nemo

    tiny, _, state, _, _, work = llama_like
    vocab = {chr(c): i for i, c in enumerate(range(32, 127))}
    vocab.update({"<unk>": len(vocab), "</s>": len(vocab) + 1})
    hf = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    src = tmp_path / "hf"
    PreTrainedTokenizerFast(tokenizer_object=hf, eos_token="</s>", unk_token="<unk>").save_pretrained(src)
    tag = "fedcba9876543210fedcba9876543210"
    files = [(f"{tag}_{name}", src / name) for name in os.listdir(src)]
    cfg = _model_config(tiny, {"library": "huggingface", "type": "meta-llama/Meta-Llama-3-8B", "use_fast": True,
                               "files": [f"nemo:{n}" for n, _ in files]}, mcore_gpt=True)
    directory = _nemo_dir(tmp_path / "hf_dir", cfg, tokenizer_files=files)
    torch.save({"model." + k: v for k, v in state.items()}, directory / "model_weights.ckpt")
    loaded = _load(_tar(directory, tmp_path / "hf.nemo"))
    reference = AutoTokenizer.from_pretrained(src)
    assert loaded.tokenizer.text_to_ids("hi there") == reference.encode("hi there", add_special_tokens=False)
    with tarfile.open(save_nemo(loaded, str(tmp_path / "hf_again.nemo"))) as tar:
        written = yaml.safe_load(tar.extractfile("./model_config.yaml").read())["tokenizer"]
    assert written["type"] == "meta-llama/Meta-Llama-3-8B" and written["library"] == "huggingface"
    assert all(ref.startswith("nemo:") for ref in written["files"])


@pytest.mark.parametrize("norm", ["layernorm1p", "layernorm"])
def test_layernorm1p_is_layernorm_with_weight_plus_one(mcore_single, norm):
    """The same stored weights give LayerNorm(gamma = w + 1) under layernorm1p and LayerNorm(gamma = w)
    under layernorm; checked against F.layer_norm of the whole model's first norm."""
    import torch.nn.functional as F

    from nemo_aligner.utils.tokenizers import build_tokenizer

    tiny = dict(TINY_ARCH, normalization=norm, activation="squared-relu", encoder_seq_length=16, micro_batch_size=1)
    model = _reference(tiny, build_tokenizer(None))
    norm_module = model.module.decoder.layers[0].input_layernorm
    x = torch.randn(3, 64)
    gamma = norm_module.weight + (1 if norm == "layernorm1p" else 0)
    torch.testing.assert_close(norm_module(x), F.layer_norm(x, (64,), gamma, norm_module.bias, norm_module.eps))


def test_encoder_seq_length_comes_from_the_checkpoint_unless_set(base_nemo, tmp_path):
    """The shipped configs leave model.encoder_seq_length null: a run takes the .nemo's value; a value set by
    the user wins."""
    from omegaconf import open_dict

    from conftest import REPO
    from nemo_aligner.utils.nemo_file import read_model_config
    from nemo_aligner.utils.run_setup import effective_model_config, resolve_sequence_length

    nemo, _ = base_nemo
    shipped = OmegaConf.load(os.path.join(REPO, "examples/nlp/gpt/conf/gpt_sft.yaml"))
    assert shipped.model.encoder_seq_length is None
    own = int(read_model_config(nemo).encoder_seq_length)
    model_cfg = shipped.model
    arch = effective_model_config(model_cfg, nemo, "model.restore_from_path")
    assert resolve_sequence_length(model_cfg, arch, nemo) == own
    assert shipped.model.data.train_ds.max_seq_length == own  # the interpolation follows
    with open_dict(model_cfg):
        model_cfg.encoder_seq_length = own // 2
    assert resolve_sequence_length(model_cfg, effective_model_config(model_cfg, nemo, "k"), nemo) == own // 2


@pytest.mark.parametrize("role", ["actor", "reward"])
def test_sequence_parallel_of_a_checkpoint_is_off_at_tp1(mcore_single, base_nemo, tmp_path, role):
    """A NeMo checkpoint trained with sequence parallelism loads at TP=1 on the CPU into the roles that refuse
    it with TP > 1 (NeMo turns it off at TP=1), and computes what the same checkpoint without it does."""
    from nemo_aligner.models.nlp.gpt.loading import load_model
    from nemo_aligner.models.nlp.gpt.megatron_gpt_ppo_actor import MegatronGPTActorModel
    from nemo_aligner.models.nlp.gpt.megatron_gpt_reward_model import MegatronGPTRewardModel
    from nemo_aligner.utils.model_config import sequence_parallel_on

    nemo, _ = base_nemo
    unpacked = tmp_path / "unpacked"
    with tarfile.open(nemo) as tar:
        tar.extractall(unpacked, filter="data")
    config = yaml.safe_load((unpacked / "model_config.yaml").read_text())
    assert not config.get("sequence_parallel")
    (unpacked / "model_config.yaml").write_text(yaml.safe_dump(dict(config, sequence_parallel=True)))
    with_sp = _tar(unpacked, tmp_path / "sp.nemo")
    cls = {"actor": MegatronGPTActorModel, "reward": MegatronGPTRewardModel}[role]
    run_cfg = OmegaConf.create({"micro_batch_size": 1, "encoder_seq_length": 32})
    models = [load_model(cls, run_cfg.copy(), "32", restore_path=path, allow_missing=("rm_head",))
              for path in (with_sp, nemo)]
    assert models[0].cfg.sequence_parallel is True and not sequence_parallel_on(models[0].cfg)
    assert not models[0].module.config.sequence_parallel
    tokens = torch.randint(1, 200, (2, 12))
    if role == "actor":
        outputs = [forward_logits(model, tokens) for model in models]
    else:  # the new reward head is drawn from model.seed: the same in both
        outputs = [model.infer(tokens, torch.tensor([12, 7])) for model in models]
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


@pytest.mark.parametrize("cfg, on", [
    ({"sequence_parallel": True, "tensor_model_parallel_size": 2}, True),
    ({"sequence_parallel": True, "tensor_model_parallel_size": 1}, False),
    ({"sequence_parallel": True}, False),
    ({"sequence_parallel": True, "tensor_model_parallel_size": None}, False),
    ({"sequence_parallel": False, "tensor_model_parallel_size": 4}, False),
    ({"tensor_model_parallel_size": 4}, False),
])
def test_sequence_parallel_only_with_tensor_parallelism(cfg, on):
    from nemo_aligner.utils.model_config import sequence_parallel_on

    assert sequence_parallel_on(OmegaConf.create(cfg)) is on


def _tp_pp_legacy_nemo(llama_like):
    """tp_rank_0X_pp_rank_00Y/model_weights.ckpt (TP=2 x PP=2) with megatron-core names: each stage numbers
    its layers from 0 and holds its own part (embedding first, final norm and output layer last)."""
    tiny, tok, state, tokens, logits, work = llama_like
    if (work / "tp_pp.nemo").exists():
        return str(work / "tp_pp.nemo")
    split = {"self_attention.linear_qkv": 0, "self_attention.linear_proj": 1, "mlp.linear_fc2": 1}
    directory = _nemo_dir(work / "tp_pp_dir", _model_config(tiny, tok.config(), mcore_gpt=True))
    shards = {(t, p): {} for t in range(2) for p in range(2)}
    for key, tensor in state.items():
        if key.startswith("decoder.layers."):
            _, _, index, rest = key.split(".", 3)
            stage, local = int(index), 0  # one layer per stage
            module = rest.rsplit(".", 1)[0]
            if module == "mlp.linear_fc1":  # megatron-core's TP fc1: [gate_r; up_r] on rank r
                gate, up = tensor.chunk(2)
                parts = [torch.cat([g, u]) for g, u in zip(gate.chunk(2), up.chunk(2))]
            elif module in split:
                parts = tensor.chunk(2, dim=split[module])
            else:
                parts = [tensor, tensor]
            for t in range(2):
                shards[(t, stage)][f"model.decoder.layers.{local}.{rest}"] = parts[t].clone()
        else:
            stage = 0 if key.startswith("embedding") else 1
            parts = tensor.chunk(2) if key in ("embedding.word_embeddings.weight", "output_layer.weight") \
                else [tensor, tensor]
            for t in range(2):
                shards[(t, stage)]["model." + key] = parts[t].clone()
    for (t, p), shard in shards.items():
        (directory / f"tp_rank_0{t}_pp_rank_00{p}").mkdir()
        torch.save(shard, directory / f"tp_rank_0{t}_pp_rank_00{p}" / "model_weights.ckpt")
    return _tar(directory, work / "tp_pp.nemo")


def test_legacy_tensor_and_pipeline_sharded_files(llama_like):
    tokens, logits = llama_like[3], llama_like[4]
    torch.testing.assert_close(forward_logits(_load(_tp_pp_legacy_nemo(llama_like)), tokens), logits,
                               rtol=0, atol=0)


def test_convert_gpt_nemo_to_mcore_command(llama_like, tmp_path, capsys, monkeypatch):
    """NeMo's convert_gpt_nemo_to_mcore.py command line (path changed): an extracted legacy TP=2 x PP=2
    .nemo becomes a megatron-core .nemo (torch_dist weights, mcore_gpt) with the same logits."""
    import importlib.util

    from conftest import SCRIPTS
    from nemo_aligner.utils.nemo_file import MODEL_WEIGHTS, extracted, read_model_config

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", ""))  # restored afterwards
    spec = importlib.util.spec_from_file_location("convert_gpt_nemo_to_mcore",
                                                  os.path.join(SCRIPTS, "convert_gpt_nemo_to_mcore.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tokens, logits = llama_like[3], llama_like[4]
    source = tmp_path / "model_checkpoint"
    with tarfile.open(_tp_pp_legacy_nemo(llama_like)) as tar:
        tar.extractall(source)
    out = str(tmp_path / "mcore" / "mcore_gpt.nemo")
    script.main(["--input_name_or_path", str(source), "--output_path", out, "--cpu-only"])
    assert "megatron-core .nemo written to" in capsys.readouterr().out
    assert read_model_config(out, "out")["mcore_gpt"] is True
    with extracted(out, "out") as directory:
        assert os.path.isfile(os.path.join(directory, MODEL_WEIGHTS, ".metadata"))  # torch_dist
        assert not [n for n in os.listdir(directory) if n.startswith(("mp_rank", "tp_rank"))]
    torch.testing.assert_close(forward_logits(_load(out), tokens), logits, rtol=0, atol=0)
    before = os.path.getmtime(out)
    script.main(["--in-folder", str(source), "--out-file", out])  # NeMo's default: an existing output is kept
    assert "already exists; kept" in capsys.readouterr().out and os.path.getmtime(out) == before


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_legacy_weights_load_at_other_parallel_sizes(llama_like, tmp_path, tp, pp):
    """The merged legacy weights are cut for each rank: the loss at TP=2 or PP=2 (two processes) equals
    the loss of one process."""
    from conftest import WORKERS, run_python

    worker = os.path.join(WORKERS, "parallel_loss_worker.py")
    nemo = _tp_pp_legacy_nemo(llama_like)
    run_python(worker, ["--nemo", nemo, "--out", tmp_path / "one.json"], like_nproc=2)
    run_python(worker, ["--nemo", nemo, "--tp", str(tp), "--pp", str(pp), "--out", tmp_path / "two.json"], nproc=2)
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert two["loss0"] == pytest.approx(one["loss0"], rel=1e-6)


def test_written_nemo_follows_nemo_restore_rules(llama_like, tmp_path):
    """A .nemo we write, read with the rules NeMo's restore_from applies (NeMo cannot be installed beside
    this project): an uncompressed tar ("r:" first); model_config.yaml at the top with mcore_gpt and the
    tokenizer under NeMo's keys; model_weights/ a distributed checkpoint (metadata.json, torch_dist) whose
    tensors carry megatron-core's names; every nemo: reference a member of the archive."""
    from megatron.core import dist_checkpointing

    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.nemo_file import save_nemo
    from nemo_aligner.utils.checkpoint_io import checkpoint_shapes

    tiny, tok, _, _, _, _ = llama_like
    nemo = save_nemo(GPTSFTModel(OmegaConf.create(tiny), tok), str(tmp_path / "ours.nemo"))
    with tarfile.open(nemo, "r:") as tar:  # NeMo's first try; gz only for old files
        names = {m.name[2:] if m.name.startswith("./") else m.name for m in tar.getmembers()}
        config = yaml.safe_load(tar.extractfile("./model_config.yaml").read())
        tar.extractall(tmp_path / "x", filter="data")
    assert config["mcore_gpt"] is True and config["dist_ckpt_format"] == "torch_dist"
    assert config["target"].endswith("MegatronGPTModel") and config["encoder_seq_length"] == 24
    assert config["activation"] == "fast-swiglu" and config["normalization"] == "rmsnorm"
    assert config["tokenizer"]["library"] == "byte-level" and "model_weights.ckpt" not in names
    # NeMo builds megatron-core's local spec unless transformer_engine is True: the names written must match
    assert config["transformer_engine"] is False
    for key in ("model", "vocab_file", "merge_file"):
        value = config["tokenizer"].get(key)
        assert value is None or (value.startswith("nemo:") and value[5:] in names)
    weights = tmp_path / "x" / "model_weights"
    assert json.loads((weights / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert dist_checkpointing.check_is_distributed_checkpoint(str(weights))
    stored = checkpoint_shapes(str(weights))  # torch DCP's metadata: what megatron-core's loaders read
    assert {"model.embedding.word_embeddings.weight", "model.decoder.layers.self_attention.linear_qkv.weight",
            "model.decoder.layers.mlp.linear_fc1.weight", "model.decoder.final_layernorm.weight",
            "model.output_layer.weight",
            # megatron-core's local spec stores its norms under Transformer Engine's names: both NeMo specs read them
            "model.decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "model.decoder.layers.mlp.linear_fc1.layer_norm_weight"} <= set(stored)
    assert stored["model.decoder.layers.self_attention.linear_qkv.weight"][0] == 2  # stacked


def test_zarr_bfloat16_and_uncompressed_arrays(tmp_path):
    """megatron-core stored bfloat16 as 2-byte words with dtype "bfloat16", and later wrote chunks without a
    compressor; a chunk at the edge of the array is padded to the full chunk shape."""
    import numpy as np

    from nemo_aligner.utils.zarr_checkpoint import read_zarr_array

    tensor = torch.randn(3, 5).to(torch.bfloat16)
    words = tensor.view(torch.int16).numpy().view(np.uint16)
    directory = tmp_path / "model.decoder.final_layernorm.weight"
    directory.mkdir()
    (directory / ".zarray").write_text(json.dumps({"zarr_format": 2, "shape": [3, 5], "chunks": [2, 5],
                                                   "dtype": "bfloat16", "order": "C", "compressor": None,
                                                   "fill_value": None, "filters": None}))
    (directory / "0.0").write_bytes(words[:2].tobytes())
    (directory / "1.0").write_bytes(np.concatenate([words[2:], np.zeros((1, 5), np.uint16)]).tobytes())
    read = read_zarr_array(str(directory))
    assert read.dtype == torch.bfloat16 and torch.equal(read, tensor)
    os.remove(directory / "1.0")
    from nemo_aligner.utils.errors import CheckpointError

    with pytest.raises(CheckpointError, match="chunk 1.0 is missing"):
        read_zarr_array(str(directory))


def test_model_config_numbers_in_short_exponent_form_are_numbers(tmp_path):
    """``layernorm_epsilon: 1e-5`` (no dot: a string to YAML 1.1) is the number NeMo's OmegaConf reads, so a
    hand-written model_config.yaml passes the architecture checks."""
    from nemo_aligner.utils.model_config import check_architecture_values
    from nemo_aligner.utils.nemo_file import read_model_config

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model_config.yaml").write_text("num_layers: 2\nhidden_size: 64\nnum_attention_heads: 4\n"
                                                      "layernorm_epsilon: 1e-5\ninit_method_std: 2e-2\n")
    cfg = read_model_config(str(tmp_path / "m"))
    assert cfg.layernorm_epsilon == 1e-5 and cfg.init_method_std == 0.02
    check_architecture_values(cfg)


# ----------------------------------------------------------------- mixture of experts (Mixtral-shaped)
MOE_ARCH = dict(TINY_ARCH, num_moe_experts=4, moe_router_topk=2)
EXPERTS = "mlp.experts.local_experts."


@pytest.fixture(scope="module")
def moe_like(mcore_single, tmp_path_factory):
    """A Mixtral-shaped model (4 routed experts per layer, 2 per token), its state and its logits."""
    from nemo_aligner.utils.tokenizers import build_tokenizer

    tok = build_tokenizer({"library": "byte-level"})
    tiny = dict(MOE_ARCH, encoder_seq_length=24, micro_batch_size=1)
    model = _reference(tiny, tok, seed=4)
    tokens = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(2))
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items() if not k.endswith("_extra_state")}
    assert any(EXPERTS + "3.linear_fc1" in k for k in state) and any("mlp.router.weight" in k for k in state)
    return tiny, tok, state, tokens, forward_logits(model, tokens), tmp_path_factory.mktemp("moe_like"), model


def test_moe_nemo_round_trip_and_routing_matters(moe_like, tmp_path):
    """A MoE .nemo we write loads back with the same logits; its dist checkpoint holds the experts the
    way megatron-core's SequentialMLP stores them ([layer, expert, ...] under mlp.experts.experts.*),
    and the router's weights change the logits (the routing is computed, not skipped)."""
    from nemo_aligner.utils.nemo_file import save_nemo

    tiny, tok, state, tokens, logits, work, model = moe_like
    path = save_nemo(model, str(tmp_path / "moe.nemo"))
    with tarfile.open(path) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "x")
    cfg = yaml.safe_load((tmp_path / "x" / "model_config.yaml").read_text())
    assert cfg["num_moe_experts"] == 4 and cfg["moe_router_topk"] == 2
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(tmp_path / "x" / "model_weights")).read_metadata().state_dict_metadata
    fc1 = stored["model.decoder.layers.mlp.experts.experts.linear_fc1.weight"]
    assert list(fc1.size) == [2, 4, 2 * 128, 64], names
    loaded = _load(path)
    torch.testing.assert_close(forward_logits(loaded, tokens), logits, rtol=0, atol=0)
    with torch.no_grad():
        loaded.module.decoder.layers[0].mlp.router.weight.mul_(-1.0)
    assert not torch.allclose(forward_logits(loaded, tokens), logits, atol=1e-3)


@pytest.mark.parametrize("halves", [False, True], ids=["fused_fc1", "gated_halves"])
def test_moe_zarr_checkpoint_with_te_layer_names(moe_like, halves):
    """NeMo's zarr dist checkpoint of a Mixtral-shaped model built with Transformer Engine's spec: the
    experts stacked over [layer, expert], the pre-MLP norm under its own name (TE fuses no norm into a
    routed MLP), the attention norm fused into linear_qkv; the experts' fc1 whole, or as
    megatron-core's gated halves (``linear_fc1.weight_w`` and ``_v``)."""
    tiny, tok, state, tokens, logits, work, _ = moe_like
    directory = _nemo_dir(work / f"zarr_dir_{halves}", _model_config(tiny, tok.config(), mcore_gpt=True,
                                                                      dist_ckpt_format="zarr", transformer_engine=True))
    weights = directory / "model_weights"
    weights.mkdir()
    (weights / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr", "sharded_backend_version": 1,
                                                       "common_backend": "torch", "common_backend_version": 1}))
    layers, experts = {}, {}
    for key, tensor in state.items():
        if not key.startswith("decoder.layers."):
            _zarr_write(weights, "model." + key, tensor)
            continue
        _, _, index, rest = key.split(".", 3)
        if rest.startswith(EXPERTS):
            expert, name = rest[len(EXPERTS):].split(".", 1)
            experts.setdefault(name, {})[(int(index), int(expert))] = tensor
        else:
            rest = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}.get(rest, rest)
            layers.setdefault(rest, {})[int(index)] = tensor
    for rest, per_layer in layers.items():
        _zarr_write(weights, "model.decoder.layers." + rest, torch.stack([per_layer[i] for i in sorted(per_layer)]))
    for name, parts in experts.items():
        stacked = torch.stack([torch.stack([parts[(i, e)] for e in range(4)]) for i in range(2)])
        key = "model.decoder.layers.mlp.experts.experts." + name
        if halves and name == "linear_fc1.weight":  # [layer, expert, 2F, H] -> the gate and up halves
            gate, up = stacked.chunk(2, dim=-2)
            _zarr_write(weights, key + "_w", gate.contiguous())
            _zarr_write(weights, key + "_v", up.contiguous())
            continue
        _zarr_write(weights, key, stacked)
    torch.testing.assert_close(forward_logits(_load(_tar(directory, work / f"zarr_{halves}.nemo")), tokens), logits,
                               rtol=0, atol=0)


def _moe_legacy_nemo(moe_like) -> str:
    tiny, tok, state, tokens, logits, work, _ = moe_like
    path = work / "mcore_ckpt.nemo"
    if not path.exists():
        directory = _nemo_dir(work / "mcore_ckpt_dir", _model_config(tiny, tok.config(), mcore_gpt=True))
        torch.save({"model." + k: v for k, v in state.items()}, directory / "model_weights.ckpt")
        _tar(directory, path)
    return str(path)


def test_moe_legacy_mcore_names_in_one_ckpt(moe_like):
    """NeMo's single-file model_weights.ckpt of a megatron-core MoE model (per-layer, per-expert names)."""
    tokens, logits = moe_like[3], moe_like[4]
    torch.testing.assert_close(forward_logits(_load(_moe_legacy_nemo(moe_like)), tokens), logits, rtol=0, atol=0)


@pytest.mark.parametrize("cfg,message", [
    ({"num_moe_experts": -1}, "model.num_moe_experts=-1 must be >= 0"),
    ({"num_moe_experts": 4, "moe_router_topk": 5}, "model.moe_router_topk=5 must be a whole number from 1 to"),
    ({"num_moe_experts": 4, "moe_aux_loss_coeff": -0.1}, "model.moe_aux_loss_coeff=-0.1 must be >= 0"),
    ({"num_moe_experts": 4, "moe_shared_expert_intermediate_size": -8}, "model.moe_shared_expert_intermediate_size=-8 must be > 0"),
    ({"num_moe_experts": 4, "moe_pad_expert_input_to_capacity": True}, "mixture-of-experts settings"),
    ({"num_moe_experts": 4, "moe_ffn_hidden_size": "abc"}, "model.moe_ffn_hidden_size='abc' must be"),
    ({"num_moe_experts": 4, "moe_layer_freq": [1, 2]}, "model.moe_layer_freq=[1, 2] must be"),
    ({"num_moe_experts": 4, "moe_apply_probs_on_input": True}, "model.moe_apply_probs_on_input=True needs"),
    ({"num_moe_experts": 4, "moe_router_topk": 1}, "model.moe_router_topk=1 needs model.moe_router_pre_softmax=True"),
    ({"num_moe_experts": 4, "moe_router_load_balancing_type": "nope"}, "model.moe_router_load_balancing_type='nope'"),
])
def test_moe_settings_are_checked(mcore_single, cfg, message):
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.errors import ConfigError
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    with pytest.raises(ConfigError, match=re.escape(message)):
        GPTSFTModel(OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, encoder_seq_length=16, **cfg)),
                    ByteTokenizer()).module(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], None)


def test_moe_layer_freq_is_not_read_as_in_nemo(mcore_single, caplog):
    """NeMo builds every layer from one layer spec, which routes every layer whatever moe_layer_freq says
    (its checkpoints hold experts in every layer): the same here, with a warning naming the key."""
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    with caplog.at_level(logging.WARNING):
        model = GPTSFTModel(OmegaConf.create(dict(TINY_ARCH, micro_batch_size=1, encoder_seq_length=16,
                                                  num_moe_experts=4, moe_layer_freq=[1, 0])), ByteTokenizer())
    assert "model.moe_layer_freq=[1, 0] is not read" in caplog.text
    assert all(hasattr(layer.mlp, "router") for layer in model.module.decoder.layers)


def test_moe_with_tensor_parallelism_needs_sequence_parallelism():
    """megatron-core's MoE layer refuses to train at TP > 1 without sequence parallelism: said at start-up."""
    from nemo_aligner.models.nlp.gpt.gpt_builder import moe_config_kwargs
    from nemo_aligner.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="model.tensor_model_parallel_size=2 with a mixture of experts needs"):
        moe_config_kwargs(OmegaConf.create({"num_moe_experts": 4, "tensor_model_parallel_size": 2}))
    assert moe_config_kwargs(OmegaConf.create({"num_moe_experts": 4, "tensor_model_parallel_size": 2,
                                               "sequence_parallel": True}))["num_moe_experts"] == 4


def test_moe_pipeline_parallel_matches_one_process(moe_like, tmp_path):
    """A MoE model split over two pipeline stages has the loss, gradient norm and updated loss of one process."""
    from conftest import WORKERS, run_python
    from nemo_aligner.utils.nemo_file import save_nemo

    worker = os.path.join(WORKERS, "parallel_loss_worker.py")
    nemo = save_nemo(moe_like[-1], str(tmp_path / "moe.nemo"))
    run_python(worker, ["--nemo", nemo, "--out", tmp_path / "one.json"], like_nproc=2)
    run_python(worker, ["--nemo", nemo, "--pp", "2", "--out", tmp_path / "two.json"], nproc=2)
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    for key in ("loss0", "grad_norm", "loss1"):
        assert two[key] == pytest.approx(one[key], rel=1e-5), key


MOE_KEYS = ["num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
            "moe_layer_freq", "moe_router_pre_softmax", "moe_router_score_function", "moe_router_topk_scaling_factor",
            "moe_router_num_groups", "moe_router_group_topk", "moe_router_enable_expert_bias",
            "moe_apply_probs_on_input", "moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff",
            "moe_input_jitter_eps", "moe_token_dispatcher_type", "moe_expert_capacity_factor",
            "moe_pad_expert_input_to_capacity", "moe_token_drop_policy", "moe_router_dtype",
            "moe_router_bias_update_rate", "moe_grouped_gemm", "expert_model_parallel_size"]


@pytest.mark.parametrize("key", MOE_KEYS)
def test_hostile_moe_values_are_refused_or_computed(mcore_single, key):
    """Every MoE key at text, -1, 0, 1.5, 1e18, NaN, true, a list or a dict: a one-line ConfigError, or a
    model whose training forward and backward are finite (no error from deep inside megatron-core)."""
    from nemo_aligner.models.nlp.gpt.gpt_sft_model import GPTSFTModel
    from nemo_aligner.utils.errors import ConfigError
    from nemo_aligner.utils.tokenizers import ByteTokenizer

    for value in ["abc", -1, 0, 1.5, 1e18, float("nan"), True, [1, 2], {"a": 1}]:
        cfg = dict(MOE_ARCH, micro_batch_size=1, encoder_seq_length=16, **{key: value})
        try:
            model = GPTSFTModel(OmegaConf.create(cfg), ByteTokenizer(), trainable=True)
        except ConfigError as err:
            assert "\n" not in str(err) and key in str(err) or "mixture-of-experts" in str(err), (value, err)
            continue
        model.module.train()
        out = model.module(torch.randint(0, 250, (2, 8)), torch.arange(8)[None].expand(2, 8), None)
        out.float().sum().backward()
        assert torch.isfinite(out).all(), (key, value)


@pytest.mark.stack
@pytest.mark.parametrize("source", ["torch_dist", "legacy"])
def test_moe_expert_parallel_matches_one_process(moe_like, tmp_path, source):
    """Two ranks each holding 2 of the 4 experts (model.expert_model_parallel_size=2, data parallel 2): the
    loss, gradient norm and loss after one Adam step of one process; each rank takes its own experts of a
    whole-model checkpoint; the .nemo they write holds all experts and loads in one process."""
    from conftest import WORKERS, run_python
    from nemo_aligner.utils.nemo_file import save_nemo

    worker = os.path.join(WORKERS, "parallel_loss_worker.py")
    nemo = save_nemo(moe_like[-1], str(tmp_path / "moe.nemo")) if source == "torch_dist" else _moe_legacy_nemo(moe_like)
    run_python(worker, ["--nemo", nemo, "--out", tmp_path / "one.json"], like_nproc=2)
    run_python(worker, ["--nemo", nemo, "--ep", "2", "--out", tmp_path / "two.json", "--save", tmp_path / "ep2.nemo"],
               nproc=2)
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert two["params"] < one["params"]  # each rank holds half the experts
    for key in ("loss0", "grad_norm", "loss1"):
        assert two[key] == pytest.approx(one[key], rel=1e-6), key
    torch.testing.assert_close(forward_logits(_load(tmp_path / "ep2.nemo"), moe_like[3]), moe_like[4], rtol=0, atol=0)


def test_expert_parallel_sizes_are_checked(tmp_path):
    from nemo_aligner.utils.distributed import check_expert_parallel_size
    from nemo_aligner.utils.errors import ConfigError

    check_expert_parallel_size(2, 4, 8)
    for ep, dp, experts, message in [(2, 2, None, "needs a mixture-of-experts model"),
                                     (4, 2, 8, "does not divide the data-parallel size 2"),
                                     (2, 2, 3, "does not divide model.num_moe_experts=3")]:
        with pytest.raises(ConfigError, match=re.escape(f"model.expert_model_parallel_size={ep} ") + ".*" + message):
            check_expert_parallel_size(ep, dp, experts)


def test_expert_parallel_ranks_with_different_token_counts(moe_like, tmp_path):
    """Ranks whose micro-batches hold different numbers of tokens (each cut to its own longest row, as
    preference pairs are padded) with the load-balancing loss on: experts split over the two ranks give
    what two data-parallel ranks holding every expert give (the padding the MoE layers add for
    megatron-core's all-gather dispatcher counts in no routing statistic)."""
    from conftest import WORKERS, run_python
    from nemo_aligner.utils.nemo_file import save_nemo

    worker = os.path.join(WORKERS, "parallel_loss_worker.py")
    nemo = save_nemo(moe_like[-1], str(tmp_path / "moe.nemo"))
    common = ["--nemo", nemo, "--ragged", "--aux-loss", "0.05"]
    run_python(worker, common + ["--out", tmp_path / "dp.json"], nproc=2)
    run_python(worker, common + ["--ep", "2", "--out", tmp_path / "ep.json"], nproc=2)
    dp, ep = (json.loads((tmp_path / name).read_text()) for name in ("dp.json", "ep.json"))
    for key in ("loss0", "grad_norm", "loss1"):
        assert ep[key] == pytest.approx(dp[key], rel=1e-6), key
