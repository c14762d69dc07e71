"""Hugging Face tokenizers (``library: huggingface``) and Megatron's GPT2BPE (``library: megatron``),
both through ``transformers``; nothing is ever downloaded.

``type`` is what NeMo passes to ``AutoTokenizer.from_pretrained``: a local directory or a hub name.
A hub name loads from files packed in the ``.nemo`` or from the local Hugging Face cache only.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, List, Optional

# Files of a Hugging Face model directory that belong with its tokenizer (besides *token* files).
TOKENIZER_FILES = ("vocab.json", "merges.txt", "vocab.txt", "spiece.model", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")
# NeMo's tokenizer keys whose value is a file (stored in the .nemo as nemo:<uuid>_<name>).
ARTIFACT_KEYS = ("model", "vocab_file", "merge_file")
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
                 "additional_special_tokens")


class HFTokenizer:
    """A ``transformers`` tokenizer with NeMo's surface (``text_to_ids``, ``eos_id``, ...)."""

    library = "huggingface"

    def __init__(self, path: Optional[str] = None, type_name: Optional[str] = None, tokenizer=None,
                 special_tokens: Optional[dict] = None, use_fast: bool = True):
        from nemo_aligner.utils.errors import ConfigError

        if tokenizer is None:
            if not path or not os.path.isdir(path):
                raise ConfigError(f"tokenizer directory {path!r} does not exist (model.tokenizer.type)")
            tokenizer = auto_tokenizer(path, use_fast=use_fast)
        self.path = path
        self.type_name = type_name if type_name is not None else (os.path.abspath(path) if path else None)
        self.tokenizer = tokenizer
        self.special_tokens_cfg = special_tokens
        if special_tokens:
            add_special_tokens(self.tokenizer, special_tokens)
        self.own_pad_id = self.tokenizer.pad_token_id  # before the fallback below: what an export declares
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    @property
    def bos_id(self) -> Optional[int]:
        return self.tokenizer.bos_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    def token_to_id(self, token: str) -> int:
        return self.tokenizer.convert_tokens_to_ids(token)

    def text_to_ids(self, text: str) -> List[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def ids_to_text(self, ids: Iterable[int], skip_special: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def files(self) -> List[str]:
        """Files that make up this tokenizer (stored inside a ``.nemo``), with the chat template and
        the generation settings (EOS ids) that travel with it into an export."""
        if not self.path or not os.path.isdir(self.path):
            return []
        names = []
        for name in sorted(os.listdir(self.path)):
            full = os.path.join(self.path, name)
            if os.path.isfile(full) and ("token" in name or name in TOKENIZER_FILES):
                names.append(full)
        return names

    def artifacts(self) -> Dict[str, str]:
        """NeMo's keys for the files its ``AutoTokenizer`` takes besides ``type``."""
        found = {}
        for key, name in (("vocab_file", "vocab.json"), ("merge_file", "merges.txt"), ("model", "tokenizer.model")):
            full = os.path.join(self.path, name) if self.path else None
            if full and os.path.isfile(full):
                found[key] = full
        return found

    def config(self) -> dict:
        cfg = {"library": "huggingface", "type": self.type_name, "use_fast": True, "model": None,
               "vocab_file": None, "merge_file": None}
        cfg.update(self.artifacts())
        if self.special_tokens_cfg:
            cfg["special_tokens"] = dict(self.special_tokens_cfg)
        return cfg


class GPT2BPETokenizer(HFTokenizer):
    """Megatron's ``GPT2BPETokenizer`` (``library: megatron``): GPT-2's byte-level BPE over a
    ``vocab_file`` (vocab.json) and ``merge_file`` (merges.txt), ``<|endoftext|>`` as EOS."""

    library = "megatron"

    def __init__(self, vocab_file: str, merge_file: str, special_tokens: Optional[dict] = None):
        import inspect

        from transformers import GPT2TokenizerFast

        self.vocab_file, self.merge_file = vocab_file, merge_file
        # transformers 5 takes the files as vocab=/merges= (vocab_file= is then silently ignored); 4.x as *_file=
        if "vocab" in inspect.signature(GPT2TokenizerFast.__init__).parameters:
            tokenizer = GPT2TokenizerFast(vocab=vocab_file, merges=merge_file)
        else:
            tokenizer = GPT2TokenizerFast(vocab_file=vocab_file, merges_file=merge_file)
        super().__init__(path=None, type_name="GPT2BPETokenizer", tokenizer=tokenizer, special_tokens=special_tokens)

    def artifacts(self) -> Dict[str, str]:
        return {"vocab_file": self.vocab_file, "merge_file": self.merge_file}

    def config(self) -> dict:
        cfg = {"library": "megatron", "type": "GPT2BPETokenizer", "model": None, "vocab_file": self.vocab_file,
               "merge_file": self.merge_file, "delimiter": None}
        if self.special_tokens_cfg:
            cfg["special_tokens"] = dict(self.special_tokens_cfg)
        return cfg


def add_special_tokens(tokenizer, special_tokens: dict) -> None:
    """NeMo's ``special_tokens`` for ``AutoTokenizer``: named tokens (bos_token, ...) and
    ``additional_special_tokens``, added through the tokenizer's own API."""
    from nemo_aligner.utils.errors import ConfigError

    if not isinstance(special_tokens, dict):
        raise ConfigError(f"model.tokenizer.special_tokens={special_tokens!r}: for a Hugging Face tokenizer this is "
                          f"a mapping with keys among {list(_SPECIAL_KEYS)}")
    unknown = [k for k in special_tokens if k not in _SPECIAL_KEYS]
    if unknown:
        raise ConfigError(f"model.tokenizer.special_tokens: unknown key(s) {unknown}; supported: {list(_SPECIAL_KEYS)}")
    tokenizer.add_special_tokens({k: v for k, v in special_tokens.items() if v})


def auto_tokenizer(name_or_path: str, use_fast: bool = True):
    """``AutoTokenizer.from_pretrained`` offline, able to read a ``tokenizer.model`` whatever protobuf
    is installed."""
    from transformers import AutoTokenizer

    from nemo_aligner.utils.patches import use_sentencepiece_schema

    use_sentencepiece_schema()
    return AutoTokenizer.from_pretrained(name_or_path, local_files_only=True, use_fast=use_fast)


def _has_tokenizer_files(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, n)) for n in ("tokenizer.json", "tokenizer_config.json"))


def resolve_hf_tokenizer(cfg, packed_dir: Optional[str] = None) -> HFTokenizer:
    """``library: huggingface`` as NeMo builds it, offline: files packed in the ``.nemo`` first, then
    ``type`` as a local directory, then ``type`` as a hub name already in the local cache."""
    from nemo_aligner.utils.errors import ConfigError

    type_name = cfg.get("type")
    special = cfg.get("special_tokens") or None
    use_fast = bool(cfg.get("use_fast", True) if cfg.get("use_fast") is not None else True)
    if packed_dir and _has_tokenizer_files(packed_dir):
        return HFTokenizer(packed_dir, type_name=type_name, special_tokens=special, use_fast=use_fast)
    if not type_name:
        raise ConfigError("model.tokenizer.type must be a local Hugging Face tokenizer directory (or a hub name "
                          "whose files are in the local Hugging Face cache)")
    type_name = str(type_name)
    if os.path.isdir(type_name):
        return HFTokenizer(type_name, special_tokens=special, use_fast=use_fast)
    looks_like_hub_name = not os.path.isabs(type_name) and type_name.count("/") <= 1
    if looks_like_hub_name:
        try:
            tokenizer = auto_tokenizer(type_name, use_fast=use_fast)
        except Exception:  # not in the cache: transformers raises OSError or ValueError, by version
            tokenizer = None
        if tokenizer is not None:
            return HFTokenizer(None, type_name=type_name, tokenizer=tokenizer, special_tokens=special)
        raise ConfigError(
            f"model.tokenizer.type={type_name!r} is a Hugging Face hub name that is neither packed in the .nemo nor in "
            "the local Hugging Face cache, and nothing is downloaded: set model.tokenizer.type to a local tokenizer "
            "directory")
    raise ConfigError(f"tokenizer directory {type_name!r} does not exist (model.tokenizer.type)")
