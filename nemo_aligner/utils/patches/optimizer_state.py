"""Scoped changes to megatron-core's optimizers while their state is saved or loaded (0.16-0.19),
used around the checkpoint code's ``sharded_state_dict`` calls (``utils.train_checkpoint``)."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def float32_params_listed(optimizer):
    """Let megatron-core's mixed-precision optimizer save and load float32 parameters kept in a
    bf16/fp16 model (the reward and value heads).

    Its ``sharded_state_dict`` maps optimizer slots to model tensors through ``float16_groups``
    alone, so a float32 parameter in a param group has no entry (``KeyError``). For the duration,
    each group's lists name every slot in the optimizer's order: the bf16 model parameter and its
    float32 master, or the float32 parameter twice. ``load_state_dict`` then copies the saved values
    into the same tensors.

    The distributed optimizer has the same blind spot in another form: its map from a model parameter
    to its optimizer slot (``model_param_group_index_map``) counts a group's parameters in gradient-
    buffer order, while the slots list the group's float32 parameters first. Where the bf16 buffer
    comes first, every slot of a group holding both kinds is off and saving meets another parameter's
    state (an AssertionError on its shape). For the duration the map follows the slots' order
    (unchanged where it already did)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    inners = [o for o in parts if any(getattr(o, "fp32_from_fp32_groups", None) or [])]
    saved = [(o, o.float16_groups, o.fp32_from_float16_groups) for o in inners]
    distributed = [(o, o.model_param_group_index_map, [g["params"] for g in o.opt_group_ranges])
                   for o in parts if hasattr(o, "model_param_group_index_map") and hasattr(o, "opt_group_ranges")]
    try:
        for inner, index_map, _ in distributed:
            inner.model_param_group_index_map = _slot_order(inner.opt_group_ranges, index_map)
        for inner in inners:
            model_groups, main_groups = [], []
            for group, halves, masters in zip(inner.optimizer.param_groups, inner.float16_groups,
                                              inner.fp32_from_float16_groups):
                half_of = {id(main): half for half, main in zip(halves, masters)}
                model_groups.append([half_of.get(id(p), p) for p in group["params"]])
                main_groups.append(list(group["params"]))
            inner.float16_groups, inner.fp32_from_float16_groups = model_groups, main_groups
        yield
    finally:
        for inner, halves, masters in saved:
            inner.float16_groups, inner.fp32_from_float16_groups = halves, masters
        for inner, index_map, params in distributed:
            inner.model_param_group_index_map = index_map
            for group_range, group_params in zip(inner.opt_group_ranges, params):
                group_range["params"] = group_params


def _slot_order(group_ranges, index_map):
    """``index_map`` with each group's float32 parameters first, as the distributed optimizer lists the
    slots (``_build_model_and_main_param_groups``); ``group_ranges``' lists are put in that order too."""
    import torch

    ordered = dict(index_map)
    for group_index, group_range in enumerate(group_ranges):
        params = group_range["params"]
        group_range["params"] = ([p for p in params if p.dtype == torch.float32]
                                 + [p for p in params if p.dtype != torch.float32])
        for order, param in enumerate(group_range["params"]):
            ordered[param] = (group_index, order)
    return ordered


@contextmanager
def without_stub_optimizers(optimizer):
    """A chained optimizer without its parameter-less parts for the duration. megatron-core chains a
    dense and an expert-parallel optimizer and makes the dense one a stub when no dense parameter
    trains (LoRA on experts alone); its chained ``sharded_state_dict`` then fails on the stub's missing
    torch optimizer (0.16-0.19). A stub has no state to save or load."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if not chained or len(chained) < 2 or not any(getattr(o, "is_stub_optimizer", False) for o in chained):
        yield
        return
    real = [o for o in chained if not getattr(o, "is_stub_optimizer", False)]
    optimizer.chained_optimizers = real or chained[:1]
    try:
        yield
    finally:
        optimizer.chained_optimizers = chained
