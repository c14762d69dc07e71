"""NeMo's ``sentencepiece`` tokenizer over the ``sentencepiece`` library, with its legacy mode.

``sentencepiece_legacy: True`` (NeMo's default for ``library: sentencepiece`` when the key is
absent) lets the config add special tokens: a token the model lacks gets the next id after its
pieces, and special-token strings in text are split out before the rest is encoded (a leading
``▁`` piece right after a special token is dropped, as NeMo does for chat templates).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

SPM_SEPARATOR = "\u2581"  # sentencepiece's word-start mark


class SentencePieceTokenizer:
    library = "sentencepiece"

    def __init__(self, model_path: str, legacy: bool = False, special_tokens=None,
                 additional_special_tokens: Optional[List[str]] = None, library: str = "sentencepiece",
                 type_name: Optional[str] = None):
        import sentencepiece

        self.library = library
        self.type_name = type_name
        self.model_path = model_path
        self.sp = sentencepiece.SentencePieceProcessor()
        self.sp.Load(model_path)
        self.legacy = bool(legacy)
        self.special_tokens_cfg = special_tokens
        self.original_vocab_size = self.sp.get_piece_size()
        self._vocab_size = self.original_vocab_size
        self.special_token_to_id: Dict[str, int] = {}
        self.id_to_special_token: Dict[int, str] = {}
        self._named: Dict[str, str] = {}  # bos_token / eos_token / pad_token ... from a dict of special tokens
        self._separator_id = self.sp.piece_to_id(SPM_SEPARATOR)
        if special_tokens:
            if not self.legacy:
                from nemo_aligner.utils.errors import ConfigError

                raise ConfigError("model.tokenizer.special_tokens needs model.tokenizer.sentencepiece_legacy=True "
                                  "(NeMo's rule: a non-legacy sentencepiece model has its special tokens built in)")
            self.add_special_tokens(special_tokens)
        if additional_special_tokens:
            if not self.legacy:
                from nemo_aligner.utils.errors import ConfigError

                raise ConfigError("model.tokenizer.additional_special_tokens needs "
                                  "model.tokenizer.sentencepiece_legacy=True")
            self.add_special_tokens(list(additional_special_tokens))

    def add_special_tokens(self, special_tokens) -> None:
        """NeMo's rule: a token the model knows keeps its id; an unknown one gets the next free id."""
        if isinstance(special_tokens, dict):
            items = list(special_tokens.items())
        else:
            items = [(None, t) for t in special_tokens]
        unk = self.sp.unk_id()
        for name, token in items:
            if name is not None:
                self._named[name] = token
            piece_id = self.sp.piece_to_id(token)
            if piece_id == unk and token not in self.special_token_to_id:
                self.special_token_to_id[token] = self._vocab_size
                self.id_to_special_token[self._vocab_size] = token
                self._vocab_size += 1
            elif piece_id != unk:
                self.special_token_to_id[token] = piece_id
                self.id_to_special_token[piece_id] = token

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def named_special_tokens(self) -> Dict[str, str]:
        """The special tokens given by role (``bos_token``, ``eos_token``, ...): NeMo's dict form."""
        return dict(self._named)

    def _special(self, name: str, fallback: int) -> Optional[int]:
        token = self._named.get(name)
        if self.legacy and token is not None:
            return self.token_to_id(token)
        return fallback if fallback >= 0 else None

    @property
    def bos_id(self) -> Optional[int]:
        return self._special("bos_token", self.sp.bos_id())

    @property
    def eos_id(self) -> Optional[int]:
        return self._special("eos_token", self.sp.eos_id())

    @property
    def pad_id(self) -> Optional[int]:
        pad = self._special("pad_token", self.sp.pad_id())
        return self.eos_id if pad is None else pad  # most models define no pad piece: pad with EOS

    def token_to_id(self, token: str) -> int:
        if self.legacy and token in self.special_token_to_id:
            return self.special_token_to_id[token]
        return self.sp.piece_to_id(token)

    def text_to_ids(self, text: str) -> List[int]:
        if not (self.legacy and self.special_token_to_id):
            return self.sp.encode_as_ids(text)
        ids: List[int] = []
        cur = 0
        while True:
            found = {tok: text.find(tok, cur) for tok in self.special_token_to_id}
            found = {tok: at for tok, at in found.items() if at >= 0}
            if not found:
                break
            # the earliest occurrence; ties go to the first token listed, as in NeMo's min() over a dict
            token = min(found, key=found.get)
            start = found[token]
            piece_ids = self.sp.encode(text[cur:start])
            if ids and ids[-1] in self.id_to_special_token and piece_ids and piece_ids[0] == self._separator_id:
                piece_ids.pop(0)
            ids.extend(piece_ids)
            ids.append(self.special_token_to_id[token])
            cur = start + len(token)
        ids.extend(self.sp.encode_as_ids(text[cur:]))
        return ids

    def ids_to_text(self, ids: Iterable[int], skip_special: bool = True) -> str:
        ids = [int(i) for i in ids]
        added = [i for i in ids if i >= self.original_vocab_size]
        if not added and not (self.legacy and not skip_special and self.id_to_special_token):
            return self.sp.decode_ids(ids)
        parts: List[str] = []
        run: List[int] = []
        for i in ids:
            if i in self.id_to_special_token or i >= self.original_vocab_size:
                if run:
                    parts.append(self.sp.decode_ids(run))
                    run = []
                if not skip_special and i in self.id_to_special_token:
                    parts.append(self.id_to_special_token[i])
            else:
                run.append(i)
        if run:
            parts.append(self.sp.decode_ids(run))
        return "".join(parts)

    def artifacts(self) -> Dict[str, str]:
        return {"model": self.model_path}

    def config(self) -> dict:
        cfg = {"library": self.library, "type": self.type_name, "model": self.model_path, "vocab_file": None,
               "merge_file": None, "delimiter": None, "sentencepiece_legacy": self.legacy}
        if self.special_tokens_cfg:
            cfg["special_tokens"] = self.special_tokens_cfg
        return cfg
