"""A teacher's top-k logits for every token of SFT data, written as knowledge-distillation records
(NeMo-Aligner's ``compute_topk_logits.py``): megatron-parallel (TP/PP/DP) and resumable: records
already in ``output_path`` (by ``index``) are skipped, and each global batch is appended and
flushed as it is done."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from typing import Dict, List, Set

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from nemo_aligner.data.nlp.builders import build_sft_dataset
from nemo_aligner.data.nlp.sft_dataset import collate_sft
from nemo_aligner.models.nlp.gpt.loading import load_model
from nemo_aligner.models.nlp.gpt.megatron_gpt_model import MegatronGPTModel
from nemo_aligner.utils.distributed import broadcast_object, is_global_rank_zero
from nemo_aligner.utils.errors import ConfigError, DataError
from nemo_aligner.utils.run_setup import init_run

logger = logging.getLogger(__name__)


def _record_index(line: bytes) -> int:
    return int(json.loads(line)["index"])


def processed_indices(path: str) -> Set[int]:
    """The ``index`` of every complete record in ``path``. A last line without its newline that is not
    a whole record (a killed run) is cut off the file (written to a temporary name, then renamed), so
    appending continues cleanly."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    complete, _, tail = data.rpartition(b"\n")  # tail: what follows the last newline
    done = set()
    for number, line in enumerate(complete.split(b"\n"), 1):
        if line.strip():
            try:
                done.add(_record_index(line))
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}:{number}: not a record of compute_topk_logits.py; choose another "
                                "output_path or remove the file") from None
    if tail.strip():
        try:
            done.add(_record_index(tail))
            kept = data
        except (ValueError, KeyError, TypeError):
            logger.warning("%s:%d: an unfinished record (a stopped run); it is computed again", path,
                           data.count(b"\n") + 1)
            kept = data[: len(data) - len(tail)]
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(kept if not kept or kept.endswith(b"\n") else kept + b"\n")
        os.replace(tmp, path)
    return done


REPORT_EVERY_S = 30.0  # progress lines while records are written (the final count is always printed)


def topk_records(model, samples: List[Dict], indices: List[int], top_k: int, micro_batch_size: int) -> List[Dict]:
    """KD records of ``samples`` (SFT samples) from ``model``'s logits; on the last pipeline stage, else []."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    seq = max(len(s["input_ids"]) - 1 for s in samples)
    batch = collate_sft(samples, model.tokenizer.eos_id, seq, pad_to_multiple_of=1)
    data = {k: batch[k] for k in ("tokens", "position_ids")}
    model.eval()
    with torch.no_grad():
        outputs = model.forward_backward(data, None, True, micro_batch_size,
                                         forward_fn=lambda m, mb: m(mb["tokens"], mb["position_ids"], None))
    if not parallel_state.is_pipeline_last_stage():
        return []
    vocab = model.tokenizer.vocab_size
    records = []
    row = 0
    for logits in outputs:
        full = gather_from_tensor_model_parallel_region(logits.float())[..., :vocab]  # vocabulary padding never counts
        values, ids = torch.topk(full, top_k, dim=-1)
        lse = torch.logsumexp(full, dim=-1)
        for b in range(full.shape[0]):
            n = int(batch["lengths"][row])
            records.append({"tokens": batch["tokens"][row, :n].tolist(), "labels": batch["labels"][row, :n].tolist(),
                            "loss_mask": [int(x) for x in batch["loss_mask"][row, :n].tolist()],
                            "topk_logits": values[b, :n].cpu().tolist(), "topk_token_ids": ids[b, :n].cpu().tolist(),
                            "log_sum_exp_logits": lse[b, :n].cpu().tolist(), "index": indices[row]})
            row += 1
    return records


def run_compute_topk_logits(cfg: DictConfig) -> Dict:
    """Write ``output_path``: one record per sample of ``data.data.file_path`` in ``[start_from_idx, end_at_idx]``."""
    restore = (cfg.get("pretrained_checkpoint") or {}).get("restore_from_path")
    if not restore:
        raise ConfigError("pretrained_checkpoint.restore_from_path is required: the teacher .nemo")
    output = cfg.get("output_path")
    if not output:
        raise ConfigError("output_path is required: the jsonl file of top-k logits to write")
    top_k = int(cfg.get("top_k") or 0)
    if top_k < 1:
        raise ConfigError(f"top_k={cfg.get('top_k')} must be >= 1")
    info = init_run(cfg, restore, "pretrained_checkpoint.restore_from_path")
    model = load_model(MegatronGPTModel, cfg.model, cfg.trainer.precision, restore,
                       key="pretrained_checkpoint.restore_from_path", trainable=False)
    if top_k > model.tokenizer.vocab_size:
        raise ConfigError(f"top_k={top_k} is larger than the teacher's vocabulary ({model.tokenizer.vocab_size})")
    data_cfg = cfg.data
    dataset = build_sft_dataset(data_cfg.data, model.tokenizer, int(model.cfg.encoder_seq_length),
                                bool(data_cfg.get("chat", False)), True, data_cfg.get("chat_prompt_tokens"),
                                key="data.data")
    start = int(cfg.get("start_from_idx") or 0)
    end = cfg.get("end_at_idx")
    end = len(dataset) - 1 if end is None else min(int(end), len(dataset) - 1)
    if not 0 <= start <= end:
        raise ConfigError(f"start_from_idx={start}, end_at_idx={cfg.get('end_at_idx')}: not a range of the "
                          f"{len(dataset)} samples")
    gbs, mbs = int(cfg.model.global_batch_size), int(cfg.model.micro_batch_size)
    if gbs % (mbs * info.dp):
        raise ConfigError(f"model.global_batch_size={gbs} must be a multiple of model.micro_batch_size={mbs} "
                          f"x data-parallel size {info.dp}")
    done: Set[int] = set()
    if is_global_rank_zero():
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        done = processed_indices(output)
    done = broadcast_object(done)
    todo = [i for i in range(start, end + 1) if i not in done]
    if done:
        logger.info("%s: %d records already written; %d to compute", output, len(done & set(range(start, end + 1))),
                    len(todo))
    from megatron.core import parallel_state

    writes = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    written, last_report = 0, time.monotonic()
    for first in range(0, len(todo), gbs):
        chunk = todo[first:first + gbs]
        per_rank = -(-len(chunk) // info.dp)
        mine = chunk[info.dp_rank * per_rank:(info.dp_rank + 1) * per_rank] or chunk[-1:]
        # Every rank runs as many micro-batches (the experts of an expert-parallel group compute
        # together): a rank short of samples in a partial last block repeats its last one, and the
        # micro-batch is the largest that divides the block's share and micro_batch_size.
        mine = mine + mine[-1:] * (per_rank - len(mine))
        records = topk_records(model, [dataset[i] for i in mine], mine, top_k, math.gcd(mbs, per_rank))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records if writes else [])
        if is_global_rank_zero():
            by_index = {r["index"]: r for part in gathered for r in part}
            with open(output, "a", encoding="utf-8") as f:
                for i in chunk:
                    f.write(json.dumps(by_index[i], ensure_ascii=False) + "\n")
                f.flush()
                os.fsync(f.fileno())
            written += len(chunk)
            if time.monotonic() - last_report >= REPORT_EVERY_S and written < len(todo):  # one line, not one per batch
                logger.info("top-k logits: %d of %d samples written", written, len(todo))
                last_report = time.monotonic()
    if is_global_rank_zero():
        print(f"Top-{top_k} logits of {len(todo)} samples written to {output} "
              f"({len(done)} were already there)", flush=True)
    return {"written": len(todo), "skipped": len(done), "output_path": output}
