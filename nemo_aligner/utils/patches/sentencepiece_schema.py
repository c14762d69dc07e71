"""``sentencepiece.sentencepiece_model_pb2`` (the model file's protobuf schema) where the module
sentencepiece ships cannot be imported: sentencepiece 0.2.3's refuses protobuf runtimes older than
its generator (7.36), and tritonclient (PyTriton's client) requires protobuf < 7. transformers
reads a ``tokenizer.model`` through that module (a Hugging Face directory without
``tokenizer.json``; converting a sentencepiece model), so it then falls back to its tiktoken reader
and fails. The same schema, generated for older runtimes, ships with transformers
(``transformers.utils.sentencepiece_model_pb2_new``) and is put in its place."""

from __future__ import annotations

import sys


def install() -> None:
    """Make ``from sentencepiece import sentencepiece_model_pb2`` work (idempotent; nothing changes
    where sentencepiece's own module imports)."""
    name = "sentencepiece.sentencepiece_model_pb2"
    if name in sys.modules:
        return
    try:
        import sentencepiece.sentencepiece_model_pb2  # noqa: F401
        return
    except Exception:  # protobuf's VersionError (a plain Exception), or the module missing
        pass
    try:
        import sentencepiece
        from transformers.utils import sentencepiece_model_pb2_new as schema
    except Exception:
        return  # nothing reads a sentencepiece model through transformers without these
    sys.modules[name] = schema
    sentencepiece.sentencepiece_model_pb2 = schema
