"""A model's tokenizer as Hugging Face tokenizer files, checked against the model's own tokenizer.

``library: huggingface`` copies the files it was built from. Megatron's GPT2BPE, ``sentencepiece``
and ``tiktoken`` are converted with the ``tokenizers``/``transformers`` converters into a
``tokenizer.json`` that ``AutoTokenizer`` loads (``PreTrainedTokenizerFast``, so transformers 4
and 5 both read it). Each conversion is loaded back and must give the model tokenizer's ids on a
set of probe texts (whitespace, Unicode that normalizers treat unevenly, the model's user-defined
pieces) and decode them back before it is kept: a tokenizer that differs is not written. Texts
of a few kinds some conversions cannot follow (special-token strings; a combining mark after a
character NFKC replaces) are reported instead, one warning line per kind.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import tempfile
from typing import List, Optional, Sequence, Tuple

PROBE_TEXTS = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces, two  inner  spaces and trailing   ",
    "new\nline\n\nparagraph\r\nwindows\tand\ttabs",
    "digits 0123456789, 3.14159 and 1,000,000",
    "Unicode: ünïcödé ＡＢＣ ﬁ café naïve 中文 日本語 한국어 🙂",
    "def f(x):\n    return {'a': [x ** 2, None]}  # code",
    "User: hi\nAssistant: hello!",
    " ",
    "\n",
    "a\u00a0b\u2003c",
    # what normalizers treat unevenly: combining marks (also after spaces and changed characters),
    # case, emoji modifiers and joiners, compatibility forms, invisible characters, a literal "▁"
    "Combining: e\u0301 E\u0301 \u00cd \u00c9\u00d6 \u015a \u015b 2\u0301 x\u0301\u0302 B\u0301",
    "Emoji: \U0001f44d\U0001f3fd Y\U0001f3fd \U0001f469\u200d\U0001f4bb \u2764\ufe0f \U0001f1eb\U0001f1f7",
    "Compatibility: \u2460 \u00b2 \ufb01 \u01c5 \uff21 \u338f \u00bd \u216b \u1e3e \u0130",
    "zero\u200bwidth\u200djoin\ufeffbom \u00adsoft",
    "\u2581 lone \u2581\u2581 marks\u2581inside",
    "\u2581starts with the mark",
    "\u2581!",
    "\u2581 \u2581 x",
    "ends with the mark\u2581",
    "x \u2581\u2581",
    "carriage\ronly\r",
)


# What a tokenizer's save_pretrained (or this export) may write.
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                        "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                        "vocab.txt", "spiece.model")


class NotExportable(Exception):
    """Why a tokenizer gets no Hugging Face files (one line, for a warning)."""


def write_hf_tokenizer(tokenizer, out_dir: str, add_bos: bool) -> List[str]:
    """Write ``tokenizer`` as Hugging Face files into ``out_dir`` and return the differences on the
    reported kinds of text (:func:`probe_texts`); raise :class:`NotExportable` (and write nothing)
    where it cannot be converted or the conversion differs on ordinary text.

    ``add_bos``: whether the written tokenizer adds BOS (Llama, Mistral and Gemma's convention)
    when ``encode`` is asked for special tokens; ``text_to_ids`` here never adds it."""
    library = getattr(tokenizer, "library", "")
    if library in ("byte", "byte-level"):
        raise NotExportable("the model uses the built-in byte tokenizer, which transformers cannot load "
                            "(token ids are UTF-8 bytes; see docs/hf_interop.md)")
    if library == "huggingface":
        _copy_huggingface(tokenizer, out_dir)
        return []
    from nemo_aligner.utils.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

    # sentencepiece also as Megatron's GPTSentencePieceTokenizer (library megatron)
    build = _sentencepiece if isinstance(tokenizer, SentencePieceTokenizer) else \
        {"megatron": _gpt2_bpe, "tiktoken": _tiktoken}.get(library)
    if build is None:
        raise NotExportable(f"the model's {library} tokenizer has no Hugging Face conversion")
    staging = tempfile.mkdtemp(prefix="hf_tokenizer_", dir=out_dir)
    try:
        try:
            extra_probes = build(tokenizer, staging, add_bos) or []
        except NotExportable:
            raise
        except Exception as err:  # the converters' own errors: the export goes on without a tokenizer
            raise NotExportable(f"the {library} tokenizer's conversion failed ({type(err).__name__}: {err})")
        caveats = check_same_encoding(tokenizer, staging, add_bos, extra_probes)
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
        return caveats
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _copy_huggingface(tokenizer, out_dir: str) -> None:
    # the files as imported (chat template, generation settings included), not a re-save of the
    # tokenizer as loaded here (which sets pad = eos where it had no pad token)
    for source in tokenizer.files():
        shutil.copy(source, os.path.join(out_dir, os.path.basename(source)))
    if not tokenizer.files():
        tokenizer.tokenizer.save_pretrained(out_dir)


# Text some conversions cannot follow, each with what it is: a written tokenizer that differs only
# on these is kept, and the export's warning names the difference.
COMBINING_AFTER_COMPATIBILITY = "a combining mark after a character NFKC replaces"
SPECIAL_TOKEN_STRINGS = "special-token strings"


def probe_texts(tokenizer) -> Tuple[List[str], dict]:
    """The texts a conversion must encode as ``tokenizer`` does (:data:`PROBE_TEXTS`), and, by what
    they hold, those where a difference is reported instead:
    - a combining mark after a character the NFKC normalizer replaces (``tokenizers``' precompiled
      normalizer drops the mark; sentencepiece keeps it);
    - special-token strings (sentencepiece never reads a control token out of text; NeMo's legacy
      mode splits its special tokens out and drops a lone "▁" after one)."""
    tokens = ["<s>", "</s>", "<unk>", "<pad>", "<|endoftext|>"]
    if getattr(tokenizer, "legacy", False):
        tokens += [t for t in getattr(tokenizer, "special_token_to_id", {}) if t not in tokens]
    special = [" ".join(tokens)]
    for token in tokens:
        special += [f"{token}User", f"x{token}y", f"a {token} b\n{token}\nc", f"{token}{token} z"]
    combining = ["\u00b2\u0301", "\u00a0\u0301", "x \u2003\u0301y", "\u210c\u0301", "\u2460\u0301"]
    return list(PROBE_TEXTS), {COMBINING_AFTER_COMPATIBILITY: combining, SPECIAL_TOKEN_STRINGS: special}


def _first_difference(tokenizer, hf, texts, decode: bool = False) -> Optional[str]:
    for text in texts:
        ours, theirs = tokenizer.text_to_ids(text), hf.encode(text, add_special_tokens=False)
        if ours != theirs:
            at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            return f"encodes {text!r} differently (token {at}: model {ours[at:at + 4]}, transformers {theirs[at:at + 4]})"
        # an unknown piece decodes as each library's own mark (sentencepiece " ⁇ ")
        if decode and hf.unk_token_id not in ours:
            back, hf_back = tokenizer.ids_to_text(ours), hf.decode(ours, skip_special_tokens=True)
            if back != hf_back:
                return f"decodes the ids of {text!r} differently (model {back!r}, transformers {hf_back!r})"
    return None


def check_same_encoding(tokenizer, hf_dir: str, add_bos: bool, extra_probes: Sequence[str] = ()) -> List[str]:
    """Load ``hf_dir`` with ``AutoTokenizer`` and compare it with ``tokenizer``: the ids of every
    probe text (and ``extra_probes``, the conversion's own), BOS/EOS, and BOS added (or not) by
    ``encode``. Raise :class:`NotExportable` naming
    the first difference on ordinary text; return the differences on the texts of :func:`probe_texts`'
    second kind, one line for each kind that differs."""
    from nemo_aligner.utils.tokenizers.huggingface import auto_tokenizer

    try:
        hf = auto_tokenizer(hf_dir)
    except Exception as err:  # a conversion transformers cannot load back is a failed conversion
        raise NotExportable(f"transformers cannot load the converted tokenizer ({type(err).__name__}: {err})")
    ordinary, reported = probe_texts(tokenizer)
    differs = _first_difference(tokenizer, hf, ordinary + list(extra_probes), decode=True)
    if differs:
        raise NotExportable(f"the converted tokenizer {differs}")
    for name in ("bos", "eos"):
        ours, theirs = getattr(tokenizer, f"{name}_id"), getattr(hf, f"{name}_token_id")
        if ours is not None and ours != theirs:
            raise NotExportable(f"the converted tokenizer's {name} id is {theirs}, the model's {ours}")
    starts = hf.encode("hi", add_special_tokens=True)[:1]
    if (starts == [tokenizer.bos_id]) != bool(add_bos and tokenizer.bos_id is not None):
        raise NotExportable("the converted tokenizer does not add BOS as the architecture's tokenizers do")
    caveats = []
    for kind, texts in reported.items():
        differs = _first_difference(tokenizer, hf, texts)
        if differs:
            caveats.append(f"on text with {kind} the converted tokenizer {differs}")
    return caveats


def _save(backend, out_dir: str, add_bos: bool, specials: dict, extra: Optional[dict] = None) -> None:
    """Save a ``tokenizers.Tokenizer`` as ``PreTrainedTokenizerFast`` files with BOS added when asked."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    bos = specials.get("bos_token")
    if add_bos and bos is not None:
        bos_id = backend.token_to_id(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, **{k: v for k, v in specials.items() if v is not None},
                                 **(extra or {}))
    hf.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    # the generic class, which reads tokenizer.json as written (a model class may rebuild it)
    config.update({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bool(add_bos and bos),
                   "add_eos_token": False})
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)


# ------------------------------------------------------------------------------ Megatron GPT2BPE
def _gpt2_bpe(tokenizer, out_dir: str, add_bos: bool) -> None:
    if not hasattr(tokenizer, "tokenizer"):
        raise NotExportable(f"the model's {tokenizer.library} tokenizer has no Hugging Face conversion")
    tokenizer.tokenizer.save_pretrained(out_dir)


# ------------------------------------------------------------------------------ sentencepiece
def _sentencepiece_proto(model_path: str):
    """The model file's ``ModelProto``."""
    from nemo_aligner.utils.patches import use_sentencepiece_schema

    use_sentencepiece_schema()
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb2
    except Exception as err:
        raise NotExportable(f"no sentencepiece model schema can be loaded ({type(err).__name__}: {err})")
    proto = pb2.ModelProto()
    with open(model_path, "rb") as f:
        proto.ParseFromString(f.read())
    return proto


def _sentencepiece(tokenizer, out_dir: str, add_bos: bool) -> List[str]:
    """The conversion, and probe texts of its own (built from the model's user-defined pieces)."""
    import inspect

    import transformers
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import SpmConverter

    build = getattr(SpmConverter, "build_tokenizer_from_spm_proto", None)
    # the form that follows the model's normalizer settings (dummy prefix, extra whitespace) came with 5.24
    if build is None or "legacy" not in inspect.signature(build).parameters:
        raise NotExportable(f"converting a sentencepiece model needs transformers 5.24 or newer (this is "
                            f"{transformers.__version__}); export with a newer transformers, e.g. in a separate venv")
    proto = _sentencepiece_proto(tokenizer.model_path)
    pieces = list(proto.pieces)
    if proto.trainer_spec.model_type == 1:  # unigram
        vocab = [(p.piece, p.score) for p in pieces]
    elif proto.trainer_spec.model_type == 2:
        vocab = {p.piece: i for i, p in enumerate(pieces)}
    else:
        raise NotExportable(f"sentencepiece model type {proto.trainer_spec.model_type} (only BPE and unigram "
                            "convert)")
    # `legacy=True` gives each chunk the dummy prefix as sentencepiece does, also on text that starts with "▁"
    backend = build(proto=proto, vocab=vocab, legacy=True)
    if backend is None:
        raise NotExportable("transformers could not build a tokenizer from the sentencepiece model")
    if proto.normalizer_spec.remove_extra_whitespaces:
        # sentencepiece's decoder then drops the "▁" of every leading piece until text comes out (the
        # converter's strips one space, as sentencepiece does without remove_extra_whitespaces)
        from tokenizers import decoders

        steps = [decoders.Replace("\u2581", " ")] + [decoders.ByteFallback()] * proto.trainer_spec.byte_fallback
        backend.decoder = decoders.Sequence(steps + [decoders.Fuse(), decoders.Strip(content=" ", left=2**32, right=0)])
    ts = proto.trainer_spec

    def piece(i: int) -> Optional[str]:
        return pieces[i].piece if 0 <= i < len(pieces) else None

    specials = {"bos_token": piece(ts.bos_id), "eos_token": piece(ts.eos_id), "unk_token": piece(ts.unk_id),
                "pad_token": piece(ts.pad_id)}
    # control and unknown pieces keep their ids as special tokens (decode skips them)
    backend.add_special_tokens([AddedToken(p.piece, special=True, normalized=False) for p in pieces
                                if p.type in (2, 3)])
    legacy_specials = tokenizer.special_token_to_id if tokenizer.legacy else {}
    for token_id, token in sorted(tokenizer.id_to_special_token.items()) if legacy_specials else ():
        if token_id >= len(pieces) and token_id != backend.get_vocab_size(with_added_tokens=True):
            raise NotExportable(f"the special token {token!r} has id {token_id}, which a converted vocabulary "
                                "cannot give it")
        backend.add_special_tokens([AddedToken(token, special=True, normalized=False)])
    for name, token in tokenizer.named_special_tokens.items():
        if name in specials and tokenizer.legacy:
            specials[name] = token
    # NeMo's non-legacy mode encodes special-token strings in text as text, as sentencepiece does
    _save(backend, out_dir, add_bos, specials, {"split_special_tokens": not legacy_specials})
    shutil.copy(tokenizer.model_path, os.path.join(out_dir, "tokenizer.model"))
    # user-defined pieces repeated or overlapping (sentencepiece and a split pattern may cut "\n\n\n"
    # differently around a user-defined "\n\n")
    return [text for p in pieces if p.type == 4 for text in (p.piece * 2 + p.piece[:1], p.piece[-1:] + p.piece,
                                                             f"a{p.piece}b {p.piece}")]


# ------------------------------------------------------------------------------ tiktoken
def _tiktoken(tokenizer, out_dir: str, add_bos: bool) -> None:
    """NeMo's ids: the special tokens first, then each byte sequence at its rank + ``num_special_tokens``."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from nemo_aligner.utils.tokenizers.tiktoken_tokenizer import load_mergeable_ranks

    ranks = load_mergeable_ranks(tokenizer.vocab_file, max_vocab=tokenizer.vocab_size - tokenizer.num_special_tokens)
    # transformers 4 calls it additional_special_tokens, 5 extra_special_tokens
    converter = TikTokenConverter(pattern=tokenizer.pattern, extra_special_tokens=tokenizer.special_tokens,
                                  additional_special_tokens=tokenizer.special_tokens)
    # the vocabulary as a .tiktoken file (base64 bytes and rank per line), the converter's input
    with tempfile.NamedTemporaryFile("w", suffix=".tiktoken", dir=out_dir, delete=False) as f:
        f.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items())
    try:
        vocab, merges = converter.extract_vocab_merges_from_model(f.name)
    finally:
        os.remove(f.name)
    vocab = {piece: rank + tokenizer.num_special_tokens for piece, rank in vocab.items()}
    clash = next((t for t in tokenizer.special_tokens if t in vocab), None)
    if clash is not None:
        raise NotExportable(f"the special token {clash!r} is also a byte sequence of the vocabulary")
    vocab.update({token: i for i, token in enumerate(tokenizer.special_tokens)})
    # the converter's tokenizer (tiktoken's split pattern, GPT-2's byte mapping) over NeMo's ids
    converter.extract_vocab_merges_from_model = lambda _: (vocab, merges)
    backend = converter.converted()
    names = {"unk_token": tokenizer.unk_id, "bos_token": tokenizer.bos_id, "eos_token": tokenizer.eos_id,
             "pad_token": tokenizer.pad_id}
    specials = {name: tokenizer.special_tokens[i] for name, i in names.items()}
    # NeMo encodes special-token strings in text as text (tiktoken with no allowed special tokens)
    _save(backend, out_dir, add_bos, specials, {"split_special_tokens": True})
