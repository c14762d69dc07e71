"""NeMo tokenizers written as Hugging Face tokenizer files: sentencepiece (BPE and unigram, NeMo's
normalizer settings, Llama's and Gemma's, user-defined pieces, legacy special tokens), tiktoken and
Megatron's GPT2BPE. Each written directory is loaded with ``AutoTokenizer`` and compared id for id
with the tokenizer's own library on texts the export's probes do not contain."""

import base64
import json
import os
import random

import pytest


def exact_sentencepiece_conversion() -> bool:
    """transformers 5.24+: build_tokenizer_from_spm_proto follows the model's normalizer settings."""
    import inspect

    from transformers.convert_slow_tokenizer import SpmConverter

    build = getattr(SpmConverter, "build_tokenizer_from_spm_proto", None)
    return build is not None and "legacy" in inspect.signature(build).parameters


needs_exact_conversion = pytest.mark.skipif(
    not exact_sentencepiece_conversion(),
    reason="this transformers converts no sentencepiece model exactly (5.24+ does); the export refuses it, as "
           "test_a_transformers_without_the_exact_sentencepiece_conversion_is_named checks")

LINES = ["the quick brown fox jumps over the lazy dog", "hello world, alignment with nemo aligner",
         "ünïcödé text 123 and more words here", "User System Assistant turn",
         "def f(x):\n\treturn x  +  1", "numbers 42 and 3.14, quotes 'a' \"b\""] * 40
# held-out texts: random draws over letters, digits, punctuation, whitespace runs and characters
# outside every vocabulary here (the export's own probe texts are fixed strings)
ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;'\"()[]{}+-*/") + \
    [" ", " ", " ", "  ", "\n", "\n\n", "\t", "\r\n", "ü", "ï", "é", "ß", "中", "🙂", "ﬁ", "Ａ", "\u00a0", "\u2581"]


def held_out_texts(seed, n=60):
    rng = random.Random(seed)
    texts = ["", "the quick brown fox", " leading", "trailing ", "a  b   c", "\n\nx"]
    texts += ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40))) for _ in range(n)]
    texts += [" ".join(rng.choice(LINES).split()[:rng.randint(1, 8)]) for _ in range(n // 3)]
    return texts


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(LINES), encoding="utf-8")
    return path


# name: sentencepiece trainer settings (NeMo's own GPT models: nmt_nfkc with extra-whitespace removal;
# Llama: identity normalizer, byte fallback, digits split; Gemma: no dummy prefix)
SP_KINDS = {
    "bpe_nmt_nfkc": dict(model_type="bpe", vocab_size=120),
    "llama": dict(model_type="bpe", vocab_size=400, byte_fallback=True, normalization_rule_name="identity",
                  remove_extra_whitespaces=False, split_digits=True),
    "gemma": dict(model_type="bpe", vocab_size=400, byte_fallback=True, add_dummy_prefix=False,
                  normalization_rule_name="identity", remove_extra_whitespaces=False),
    "unigram": dict(model_type="unigram", vocab_size=60),
    "user_defined": dict(model_type="bpe", vocab_size=400, byte_fallback=True,
                         user_defined_symbols=["<extra_id_0>", "<|im_start|>"]),
}


@pytest.fixture(scope="module")
def sp_models(corpus):
    import sentencepiece as spm

    paths = {}
    for name, settings in SP_KINDS.items():
        prefix = corpus.parent / name
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(prefix), character_coverage=1.0,
                                       bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2, **settings)
        paths[name] = str(prefix) + ".model"
    return paths


def _export(tokenizer, out, add_bos=True):
    from nemo_aligner.utils.tokenizers.hf_export import write_hf_tokenizer

    os.makedirs(out, exist_ok=True)
    caveats = write_hf_tokenizer(tokenizer, str(out), add_bos=add_bos)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out), local_files_only=True), caveats


@pytest.mark.stack
@needs_exact_conversion
@pytest.mark.parametrize("kind", sorted(SP_KINDS))
def test_sentencepiece_export_encodes_as_the_sentencepiece_library(sp_models, kind, tmp_path):
    import sentencepiece as spm

    from nemo_aligner.utils.tokenizers import build_tokenizer

    sp = spm.SentencePieceProcessor(model_file=sp_models[kind])
    tok = build_tokenizer({"library": "sentencepiece", "model": sp_models[kind], "sentencepiece_legacy": False})
    hf, caveats = _export(tok, tmp_path / "hf")
    # reported, not refused: tokenizers' NFKC drops a combining mark after a character it replaces (the
    # identity normalizers of Llama and Gemma replace none), and a unigram lattice takes a control piece's
    # string whole (sentencepiece never reads one out of text)
    expected = {"on text with a combining mark after a character NFKC replaces"} if kind not in ("llama", "gemma") \
        else set()
    expected |= {"on text with special-token strings"} if kind == "unigram" else set()
    assert {c.split(" the converted tokenizer")[0] for c in caveats} == expected, caveats
    assert sorted(os.listdir(tmp_path / "hf")) == ["tokenizer.json", "tokenizer.model", "tokenizer_config.json"]
    for text in held_out_texts(seed=len(kind)) + ["<s> literal </s> <unk>"] * (kind != "unigram"):
        ids = sp.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, (kind, text)
        assert hf.encode(text) == [1] + ids  # Llama-style BOS
        if sp.unk_id() not in ids:
            assert hf.decode(ids) == sp.decode(ids), (kind, text)
    # generated ids need not be an encoding: lone "▁" pieces first (sentencepiece drops the "▁" of every
    # leading piece under remove_extra_whitespaces, of the first one only otherwise)
    lone = sp.piece_to_id("\u2581")
    if lone != sp.unk_id():
        for ids in ([lone, *sp.encode("!")], [lone, lone, *sp.encode("hello world")], [*sp.encode("a"), lone, lone]):
            if sp.unk_id() not in ids:  # an unknown piece decodes as each library's own mark
                assert hf.decode(ids) == sp.decode(ids), (kind, [sp.id_to_piece(i) for i in ids])
    assert (hf.bos_token_id, hf.eos_token_id, len(hf)) == (1, 2, sp.get_piece_size())
    assert hf.decode([1, *sp.encode("hello world"), 2], skip_special_tokens=True) == "hello world"


@needs_exact_conversion
def test_sentencepiece_export_without_bos_for_architectures_that_add_none(sp_models, tmp_path):
    from nemo_aligner.utils.tokenizers import build_tokenizer

    tok = build_tokenizer({"library": "sentencepiece", "model": sp_models["llama"], "sentencepiece_legacy": False})
    hf, _ = _export(tok, tmp_path / "hf", add_bos=False)
    assert hf.encode("hello world") == tok.text_to_ids("hello world")
    with open(tmp_path / "hf" / "tokenizer_config.json") as f:
        config = json.load(f)
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["add_bos_token"] is False


@needs_exact_conversion
def test_sentencepiece_legacy_special_tokens_keep_nemo_ids(sp_models, tmp_path):
    """NeMo's legacy mode: added special tokens get the ids after the pieces, and text with them
    encodes as NeMo does, except a lone '▁' piece NeMo drops after one (named in the caveat)."""
    from nemo_aligner.utils.tokenizers import build_tokenizer

    tok = build_tokenizer({"library": "sentencepiece", "model": sp_models["llama"],
                           "special_tokens": {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
                           "additional_special_tokens": ["<extra_id_0>", "<extra_id_1>"]})
    hf, caveats = _export(tok, tmp_path / "hf")
    assert [hf.convert_tokens_to_ids(t) for t in ("<pad>", "<extra_id_0>", "<extra_id_1>")] == [400, 401, 402]
    assert len(hf) == tok.vocab_size == 403
    for text in ["<extra_id_0>User\nhi<extra_id_1>Assistant\nhello</s>", "x<extra_id_0>y", "plain text only"]:
        assert hf.encode(text, add_special_tokens=False) == tok.text_to_ids(text), text
    assert len(caveats) == 1 and caveats[0].startswith("on text with special-token strings"), caveats
    assert hf.encode(" after", add_special_tokens=False) == tok.text_to_ids(" after")


def _tiktoken_vocab(path, corpus_text, size=300):
    from tiktoken._educational import bpe_train

    from nemo_aligner.utils.tokenizers.tiktoken_tokenizer import PATTERN_TIKTOKEN

    ranks = bpe_train(corpus_text, size, PATTERN_TIKTOKEN)
    entries = [{"rank": r, "token_bytes": base64.b64encode(b).decode(), "token_str": b.decode("utf-8", "replace")}
               for b, r in sorted(ranks.items(), key=lambda item: item[1])]
    path.write_text(json.dumps(entries), encoding="utf-8")
    return ranks


@pytest.mark.stack
def test_tiktoken_export_encodes_as_the_tiktoken_library(corpus, tmp_path):
    import tiktoken

    from nemo_aligner.utils.tokenizers import build_tokenizer
    from nemo_aligner.utils.tokenizers.tiktoken_tokenizer import PATTERN_TIKTOKEN

    ranks = _tiktoken_vocab(tmp_path / "vocab.json", corpus.read_text(encoding="utf-8"))
    reference = tiktoken.Encoding(name="ref", pat_str=PATTERN_TIKTOKEN, mergeable_ranks=ranks, special_tokens={})
    tok = build_tokenizer({"library": "tiktoken", "vocab_file": str(tmp_path / "vocab.json")})
    hf, caveats = _export(tok, tmp_path / "hf")
    assert caveats == [] and len(hf) == 1000 + len(ranks)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 4, 0)
    for text in held_out_texts(seed=3) + ["<s> and </s> and <SPECIAL_20> as text"]:
        ids = [t + 1000 for t in reference.encode(text)]
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids) == reference.decode([t - 1000 for t in ids])
    assert hf.encode("hi")[0] == 1
    assert hf.convert_ids_to_tokens(20) == "<SPECIAL_20>"


def test_gpt2_bpe_export(corpus, tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    from nemo_aligner.utils.tokenizers import build_tokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train([str(corpus)], vocab_size=320, min_frequency=1, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(tmp_path))
    reference = ByteLevelBPETokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    tok = build_tokenizer({"library": "megatron", "type": "GPT2BPETokenizer",
                           "vocab_file": str(tmp_path / "vocab.json"), "merge_file": str(tmp_path / "merges.txt")})
    hf, _ = _export(tok, tmp_path / "hf", add_bos=False)
    for text in held_out_texts(seed=5):
        assert hf.encode(text) == reference.encode(text).ids, text
    assert hf.eos_token_id == tok.eos_id


@needs_exact_conversion
def test_a_conversion_that_encodes_differently_is_not_written(sp_models, tmp_path, monkeypatch):
    """The nmt_nfkc model without its normalizer (what transformers' Llama conversion builds): the
    probe texts catch it, and nothing is left in the directory."""
    from transformers.convert_slow_tokenizer import SpmConverter

    from nemo_aligner.utils.tokenizers import build_tokenizer
    from nemo_aligner.utils.tokenizers.hf_export import NotExportable, write_hf_tokenizer

    build = SpmConverter.build_tokenizer_from_spm_proto

    def without_normalizer(proto, vocab, merges=None, legacy=True):
        backend = build(proto, vocab, merges=merges, legacy=legacy)
        backend.normalizer = None
        return backend

    monkeypatch.setattr(SpmConverter, "build_tokenizer_from_spm_proto", staticmethod(without_normalizer))
    tok = build_tokenizer({"library": "sentencepiece", "model": sp_models["bpe_nmt_nfkc"],
                           "sentencepiece_legacy": False})
    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(NotExportable, match="encodes '.*' differently"):
        write_hf_tokenizer(tok, str(out), add_bos=True)
    assert os.listdir(out) == []


def test_a_transformers_without_the_exact_sentencepiece_conversion_is_named(sp_models, tmp_path, monkeypatch):
    """transformers 5.3-5.23 have build_tokenizer_from_spm_proto without the model's normalizer
    settings (no ``legacy``), 4.x none."""
    import transformers
    from transformers.convert_slow_tokenizer import SpmConverter

    from nemo_aligner.utils.tokenizers import build_tokenizer
    from nemo_aligner.utils.tokenizers.hf_export import NotExportable, write_hf_tokenizer

    monkeypatch.setattr(SpmConverter, "build_tokenizer_from_spm_proto",
                        staticmethod(lambda proto, vocab, merges=None: None), raising=False)
    tok = build_tokenizer({"library": "sentencepiece", "model": sp_models["llama"], "sentencepiece_legacy": False})
    with pytest.raises(NotExportable, match=rf"needs transformers 5.24 or newer \(this is {transformers.__version__}\)"):
        write_hf_tokenizer(tok, str(tmp_path), add_bos=True)
    assert os.listdir(tmp_path) == []


def test_byte_tokenizer_is_not_exportable(tmp_path):
    from nemo_aligner.utils.tokenizers import ByteTokenizer
    from nemo_aligner.utils.tokenizers.hf_export import NotExportable, write_hf_tokenizer

    with pytest.raises(NotExportable, match="built-in byte tokenizer"):
        write_hf_tokenizer(ByteTokenizer(), str(tmp_path), add_bos=False)
    assert os.listdir(tmp_path) == []


def test_a_hugging_face_directory_with_only_tokenizer_model_loads(sp_models, tmp_path):
    """Llama's slow-tokenizer layout (tokenizer.model, no tokenizer.json): transformers reads the file
    through sentencepiece's protobuf schema, which sentencepiece 0.2.3 ships for protobuf >= 7.36
    only (PyTriton's client needs < 7); the schema transformers ships stands in for it."""
    import shutil

    import sentencepiece as spm

    from nemo_aligner.utils.tokenizers import build_tokenizer

    directory = tmp_path / "llama_tokenizer"
    directory.mkdir()
    shutil.copy(sp_models["llama"], directory / "tokenizer.model")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    tok = build_tokenizer({"library": "huggingface", "type": str(directory)})
    sp = spm.SentencePieceProcessor(model_file=sp_models["llama"])
    for text in ["hello world, the quick brown fox", "User System\nAssistant turn 123", "ünïcödé 🙂"]:
        assert tok.text_to_ids(text) == sp.encode(text), text
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString((directory / "tokenizer.model").read_bytes())
    assert [p.piece for p in proto.pieces] == [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def test_a_converter_error_is_a_warning_not_a_traceback(corpus, tmp_path, monkeypatch):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from nemo_aligner.utils.tokenizers import build_tokenizer
    from nemo_aligner.utils.tokenizers.hf_export import NotExportable, write_hf_tokenizer

    _tiktoken_vocab(tmp_path / "vocab.json", corpus.read_text(encoding="utf-8"))
    tok = build_tokenizer({"library": "tiktoken", "vocab_file": str(tmp_path / "vocab.json")})

    def broken(self, *args):
        raise KeyError("pattern")

    monkeypatch.setattr(TikTokenConverter, "converted", broken)
    out = tmp_path / "hf"
    out.mkdir()
    with pytest.raises(NotExportable, match=r"the tiktoken tokenizer's conversion failed \(KeyError: 'pattern'\)"):
        write_hf_tokenizer(tok, str(out), add_bos=False)
    assert os.listdir(out) == []
