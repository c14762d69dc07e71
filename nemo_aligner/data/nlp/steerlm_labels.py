"""SteerLM attribute labels and prompts.

A label is ``"quality:4,helpfulness:3,..."`` on an Assistant turn of NeMo's chat format; the SFT
chat template renders it right after the turn header (``<turn_start>Assistant<eon><label_start>
{label}<eon>{value}<eot>``), so the model learns to produce the response the attributes describe.
At inference the same header with chosen values steers the response.
"""

from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

from nemo_aligner.data.nlp.chat_template import DEFAULT_CHAT_TOKENS
from nemo_aligner.utils.errors import DataError

# NeMo-Aligner's attribute order for a 9-attribute (HelpSteer/OASST) regression reward model.
NEMO_ATTRIBUTES = ("quality", "toxicity", "humor", "creativity", "helpfulness", "correctness", "coherence",
                   "complexity", "verbosity")


def format_label(values: Union[Mapping[str, float], Sequence[float]], names: Optional[Sequence[str]] = None) -> str:
    """``{"quality": 4, ...}`` (or values with ``names``) -> ``"quality:4,..."``; integral floats print as ints."""
    if not isinstance(values, Mapping):
        if names is None or len(names) != len(values):
            raise ValueError(f"{len(values)} attribute values need as many names, got {names}")
        values = dict(zip(names, values))
    parts = []
    for name, value in values.items():
        value = float(value)
        parts.append(f"{name}:{int(value) if value.is_integer() else value}")
    return ",".join(parts)


def parse_label(label: str, where: str = "label") -> Dict[str, float]:
    """``"quality:4,toxicity:0"`` -> ``{"quality": 4.0, "toxicity": 0.0}``; errors name ``where``."""
    out: Dict[str, float] = {}
    for part in filter(None, (p.strip() for p in str(label).split(","))):
        name, sep, value = part.partition(":")
        try:
            if not sep or not name.strip() or not math.isfinite(float(value)):
                raise ValueError
            out[name.strip()] = float(value)
        except ValueError:
            raise DataError(f"{where}: attribute {part!r} is not name:number with a finite number "
                            f"(label {label!r})") from None
    return out


def model_chat_tokens(model_cfg) -> Optional[dict]:
    """The chat template's strings a model was trained with (SFT keeps ``model.data.chat_prompt_tokens``
    in the .nemo's config); None: NeMo's defaults."""
    from omegaconf import OmegaConf

    tokens = (model_cfg.get("data") or {}).get("chat_prompt_tokens")
    if tokens is None:
        return None
    return OmegaConf.to_container(tokens) if not isinstance(tokens, dict) else dict(tokens)


def render_turns(system: str, turns: Sequence[Mapping], chat_tokens: Optional[dict] = None,
                 with_labels: bool = True) -> str:
    """NeMo's chat template for ``turns`` (``{"from", "value", "label"?}``), exactly as SFT trains on it."""
    t = dict(DEFAULT_CHAT_TOKENS, **(chat_tokens or {}))
    text = f"{t['system_turn_start']}System{t['end_of_name']}{system or ''}{t['end_of_turn']}"  # null: none, as SFT
    for turn in turns:
        text += f"{t['turn_start']}{turn['from']}{t['end_of_name']}"
        if with_labels and turn.get("label") is not None:
            text += f"{t['label_start']}{turn['label']}{t['end_of_name']}"
        text += f"{turn['value']}{t['end_of_turn']}"
    return text


def steer_prompt(conversation: Union[str, Sequence[Mapping]], attributes: Union[str, Mapping[str, float]],
                 system: str = "", assistant: str = "Assistant", chat_tokens: Optional[dict] = None) -> str:
    """The prompt that asks for an Assistant reply with the given attribute values.

    ``conversation`` is the user's message or the turns so far (``{"from", "value", "label"?}``).
    """
    t = dict(DEFAULT_CHAT_TOKENS, **(chat_tokens or {}))
    turns = [{"from": "User", "value": conversation}] if isinstance(conversation, str) else list(conversation)
    label = attributes if isinstance(attributes, str) else format_label(attributes)
    return (render_turns(system, turns, chat_tokens)
            + f"{t['turn_start']}{assistant}{t['end_of_name']}{t['label_start']}{label}{t['end_of_name']}")


def assistant_turn_texts(record: Mapping, chat_tokens: Optional[dict] = None,
                         assistant: str = "Assistant") -> List[Tuple[int, str]]:
    """``(turn index, text)`` for each Assistant turn: the conversation up to and including that
    turn, rendered without labels (what a SteerLM regression reward model scores)."""
    turns = record["conversations"]
    return [(i, render_turns(record.get("system") or "", turns[: i + 1], chat_tokens, with_labels=False))
            for i, turn in enumerate(turns) if turn.get("from") == assistant]
