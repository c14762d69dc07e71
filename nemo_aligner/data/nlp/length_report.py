"""One warning per dataset for the samples longer than the sequence length: how many, and the first."""

from __future__ import annotations

import logging
from typing import Iterable, Tuple

logger = logging.getLogger(__name__)


def report_truncated(name: str, cuts: Iterable[Tuple[str, int]], seq_length: int, how: str, extra: str = "") -> int:
    """``cuts``: ``(file:line, tokens cut)`` of every sample. Logs the count of cut samples with the first
    one's place, once; returns that count."""
    count, total, first, first_cut = 0, 0, None, 0
    for where, cut in cuts:
        total += 1
        if cut > 0:
            count += 1
            if first is None:
                first, first_cut = where, cut
    if count:
        if not name or name == "None":  # records handed over in memory: name their file
            name = first.rsplit(":", 1)[0]
        logger.warning("%s: %d of %d samples are longer than the sequence length %d and are truncated (%s; first: "
                       "%s, %d tokens over)%s", name, count, total, seq_length, how, first, first_cut, extra)
    return count
