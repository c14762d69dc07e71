"""Work items of all data-parallel ranks, handed out to whichever rank asks first.

NeMo-Aligner's ``batch_iterator.use_flask=True``: ranks whose responses come out short take more
prompts and ranks with long responses fewer, so no rank waits long for the slowest. The hand-out is
an atomic counter in torch.distributed's key-value store (the one the process group started with),
so it needs no server, port or extra listener. Results go back to the rank that owns each item, in
its order, so what follows sees the same rows as without sharing.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

_rounds = itertools.count()  # every rank builds SharedWork in the same order: one key per round


def _claim_store():
    from torch.distributed.distributed_c10d import _get_default_store

    return dist.PrefixStore("nemo_aligner/shared_work/", _get_default_store())


class SharedWork:
    """Collective over ``group`` (the data-parallel group): every rank's ``local_items`` become one
    list, claimed one item at a time by the ``claimer`` ranks (one per model-parallel group) and
    shared by ``share`` with the rest of that group (they run the same item together).

    ``for index, item in work`` runs this rank's share; ``work.mine({index: result})`` (collective)
    returns the results of this rank's own items, in their order."""

    def __init__(self, local_items: Sequence[Any], group=None, claimer: bool = True,
                 share: Callable[[Optional[int]], int] = lambda index: index):
        self.group = group
        self.claimer = claimer
        self.share = share
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        per_rank: List[Optional[Sequence[Any]]] = [list(local_items)]
        if self.size > 1:
            per_rank = [None] * self.size
            dist.all_gather_object(per_rank, list(local_items), group=group)
        self.owners: List[Tuple[int, int]] = [(r, j) for r, items in enumerate(per_rank) for j in range(len(items))]
        self.items = [item for items in per_rank for item in items]
        self.key = f"round-{next(_rounds)}"
        self._store = _claim_store() if self.size > 1 and claimer else None
        self._key_dropped = False
        self.claimed: List[int] = []

    def _next(self) -> Optional[int]:
        index = None
        if self.claimer:
            index = self._store.add(self.key, 1) - 1 if self._store is not None else len(self.claimed)
        return self.share(index)

    def __iter__(self) -> Iterator[Tuple[int, Any]]:
        while True:
            index = self._next()
            if index >= len(self.items):
                return
            self.claimed.append(index)
            yield index, self.items[index]

    def mine(self, results: Optional[Dict[int, Any]]) -> Optional[List[Any]]:
        """Collective: the results of this rank's own items, in order, from whichever rank ran them
        (None where every rank of the group passed None: results only a model-parallel source holds)."""
        gathered = [results]
        if self.size > 1:
            gathered = [None] * self.size
            dist.all_gather_object(gathered, results, group=self.group)
        # Every rank has stopped claiming once it is here: the round's counter can go.
        if self._store is not None and not self._key_dropped:
            self._key_dropped = True
            if self.rank == 0:
                self._store.delete_key(self.key)
        if all(part is None for part in gathered):
            return None
        union: Dict[int, Any] = {}
        for part in gathered:
            union.update(part or {})
        return [union[index] for index, (owner, _) in enumerate(self.owners) if owner == self.rank]
