"""Tokenizers NeMo writes into ``model.tokenizer``, built from the real libraries.

Every tokenizer exposes NeMo's surface: ``text_to_ids``, ``ids_to_text``, ``bos_id``, ``eos_id``,
``pad_id``, ``vocab_size``, and ``config()`` (the ``model.tokenizer`` entry to write back).

=================  ==========================================  ===========================
``library``        keys                                        built with
=================  ==========================================  ===========================
``byte-level``     (none)                                      built in (UTF-8 bytes)
``sentencepiece``  ``model``, ``sentencepiece_legacy``,        ``sentencepiece``
                   ``special_tokens``
``huggingface``    ``type`` (local dir or cached hub name),    ``transformers``
                   files packed in the ``.nemo``
``megatron``       ``type: GPT2BPETokenizer``, ``vocab_file``,  ``transformers`` (GPT-2 BPE)
                   ``merge_file``; ``GPTSentencePieceTokenizer``
``tiktoken``       ``vocab_file``                              ``tiktoken``
=================  ==========================================  ===========================
"""

from __future__ import annotations

from typing import Optional

from omegaconf import DictConfig, ListConfig, OmegaConf

from nemo_aligner.utils.errors import CheckpointError, ConfigError
from nemo_aligner.utils.tokenizers.byte_tokenizers import (
    BYTE_SPECIAL_TOKENS,
    CHAT_MARKERS,
    LEGACY_BYTE_SPECIAL_TOKENS,
    ByteTokenizer,
    NeMo2ByteLevelTokenizer,
    byte_level_tokenizer,
)
from nemo_aligner.utils.tokenizers.huggingface import TOKENIZER_FILES, GPT2BPETokenizer, HFTokenizer, resolve_hf_tokenizer

SUPPORTED = ("byte-level", "sentencepiece", "huggingface", "megatron (GPT2BPETokenizer, GPTSentencePieceTokenizer)",
             "tiktoken")

__all__ = ["BYTE_SPECIAL_TOKENS", "CHAT_MARKERS", "LEGACY_BYTE_SPECIAL_TOKENS", "ByteTokenizer", "GPT2BPETokenizer",
           "HFTokenizer", "NeMo2ByteLevelTokenizer", "SUPPORTED", "TOKENIZER_FILES", "build_tokenizer"]


def _plain(value):
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def _file(cfg, key: str, library: str) -> str:
    import os

    path = cfg.get(key)
    if not path:
        raise ConfigError(f"model.tokenizer.{key} is required for library {library!r}")
    if not os.path.isfile(str(path)):
        raise ConfigError(f"model.tokenizer.{key}={path}: no such file")
    return str(path)


def _sentencepiece_legacy(cfg) -> bool:
    """NeMo's rule: ``sentencepiece_legacy`` when the key is there, else True for ``library: sentencepiece``."""
    if "sentencepiece_legacy" in cfg:
        return bool(cfg.get("sentencepiece_legacy"))
    return str(cfg.get("library")).lower() == "sentencepiece"


def build_tokenizer(tokenizer_cfg, padded_vocab_size: Optional[int] = None, packed_dir: Optional[str] = None):
    """Tokenizer from ``model.tokenizer``.

    ``padded_vocab_size``: the checkpoint's embedding rows (tells NeMo's two byte-level layouts
    apart). ``packed_dir``: where a ``.nemo``'s Hugging Face tokenizer files were restored. Files the
    tokenizer library cannot read (damaged, empty, of another format) are a CheckpointError naming them.
    """
    if tokenizer_cfg is None:
        return ByteTokenizer()
    cfg = {k: _plain(v) for k, v in (tokenizer_cfg.items() if hasattr(tokenizer_cfg, "items") else [])}
    library = str(cfg.get("library") or "byte-level").lower()
    try:
        return _build(cfg, library, padded_vocab_size, packed_dir)
    except (ConfigError, CheckpointError):
        raise
    except Exception as err:  # the tokenizer library's own error (sentencepiece, tokenizers, json, ...)
        files = [str(cfg[k]) for k in ("model", "vocab_file", "merge_file") if cfg.get(k)] or \
            [str(packed_dir or cfg.get("type"))]
        detail = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise CheckpointError(f"model.tokenizer (library {library!r}, {', '.join(files)}): the tokenizer files cannot "
                              f"be read ({type(err).__name__}{': ' + detail if detail else ''})") from None


def _build(cfg: dict, library: str, padded_vocab_size: Optional[int], packed_dir: Optional[str]):
    if library == "byte-level":
        return byte_level_tokenizer(cfg, padded_vocab_size)
    if library == "byte":  # this project's earlier layout
        return ByteTokenizer(LEGACY_BYTE_SPECIAL_TOKENS, library="byte")
    if library in ("huggingface", "hf"):
        return resolve_hf_tokenizer(cfg, packed_dir=packed_dir)
    if library == "sentencepiece" or (library == "megatron" and cfg.get("type") == "GPTSentencePieceTokenizer"):
        from nemo_aligner.utils.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(
            _file(cfg, "model", library), legacy=_sentencepiece_legacy(cfg), special_tokens=cfg.get("special_tokens"),
            additional_special_tokens=cfg.get("additional_special_tokens"), library=library,
            type_name=cfg.get("type"))
    if library == "megatron":
        kind = cfg.get("type")
        if kind != "GPT2BPETokenizer":
            raise ConfigError(f"model.tokenizer.type={kind!r} is not supported with library 'megatron' "
                              "(supported: GPT2BPETokenizer, GPTSentencePieceTokenizer)")
        return GPT2BPETokenizer(_file(cfg, "vocab_file", library), _file(cfg, "merge_file", library),
                                special_tokens=cfg.get("special_tokens") or None)
    if library == "tiktoken":
        from nemo_aligner.utils.tokenizers.tiktoken_tokenizer import (
            DEFAULT_NUM_SPECIAL_TOKENS,
            DEFAULT_VOCAB_SIZE,
            TiktokenTokenizer,
        )

        return TiktokenTokenizer(_file(cfg, "vocab_file", library),
                                 vocab_size=int(cfg.get("vocab_size") or DEFAULT_VOCAB_SIZE),
                                 num_special_tokens=int(cfg.get("num_special_tokens") or DEFAULT_NUM_SPECIAL_TOKENS),
                                 special_tokens=cfg.get("special_tokens") or None)
    raise ConfigError(f"model.tokenizer.library={library!r} is not supported (supported: {', '.join(SUPPORTED)})")
