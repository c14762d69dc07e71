"""Metric logging on global rank 0: TensorBoard always, wandb when asked, and a metrics.jsonl file."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Dict, List, Optional, Sequence

from nemo_aligner.utils.distributed import is_global_rank_zero

logger = logging.getLogger(__name__)


def _scalar(value) -> Optional[float]:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


class MetricLogger:
    """Writes scalars and tables to TensorBoard (``<log_dir>``), wandb and ``<log_dir>/metrics.jsonl``.

    wandb runs offline unless ``WANDB_API_KEY`` is set (or ``WANDB_MODE`` says otherwise),
    so a run never blocks on the network. Every method is a no-op on ranks other than 0.
    """

    def __init__(self, log_dir: str, create_tensorboard: bool = True, create_wandb: bool = False,
                 wandb_kwargs: Optional[dict] = None, config: Optional[dict] = None, on_first_log=None):
        self.log_dir = log_dir
        # called once, before the first metrics are written: what a run writes only once it runs
        self._on_first_log = on_first_log
        self.enabled = is_global_rank_zero()
        self.tb = None
        self.wandb_run = None
        self._jsonl = None
        if not self.enabled:
            return
        os.makedirs(log_dir, exist_ok=True)
        path = os.path.join(log_dir, "metrics.jsonl")
        self._jsonl = open(path, "a", encoding="utf-8")
        if _ends_mid_line(path):  # a run killed mid-write: keep its torn line apart from ours
            self._jsonl.write("\n")
        if create_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=log_dir)
        if create_wandb:
            import wandb

            kwargs = {k: v for k, v in (wandb_kwargs or {}).items() if v is not None}
            if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
                os.environ["WANDB_MODE"] = "offline"
            kwargs.setdefault("dir", log_dir)
            self.wandb_run = wandb.init(config=config, **kwargs)

    def _first_log(self) -> None:
        if self._on_first_log is not None:
            callback, self._on_first_log = self._on_first_log, None
            callback()

    def log_metrics(self, metrics: Dict[str, float], step: int, prefix: str = "") -> None:
        if not self.enabled:
            return
        self._first_log()
        clean = {}
        for key, value in metrics.items():
            value = _scalar(value)
            if value is None:
                continue
            name = f"{prefix}{key}"
            clean[name] = value
            if self.tb is not None:
                self.tb.add_scalar(name, value, step)
        if self.wandb_run is not None and clean:
            self.wandb_run.log(clean, step=step)
        self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        self._jsonl.flush()

    def log_table(self, key: str, columns: Sequence[str], rows: List[Sequence], step: int) -> None:
        """A table of samples (prompt, response, reward, ...)."""
        if not self.enabled:
            return
        self._first_log()
        if self.tb is not None:
            header = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
            body = "".join("| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |\n"
                           for row in rows)
            self.tb.add_text(key, header + body, step)
        if self.wandb_run is not None:
            import wandb

            self.wandb_run.log({key: wandb.Table(columns=list(columns), data=[list(r) for r in rows])}, step=step)
        self._jsonl.write(json.dumps({"step": step, key: [dict(zip(columns, r)) for r in rows]}, default=str) + "\n")
        self._jsonl.flush()

    def finalize(self) -> None:
        if not self.enabled:
            return
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None


def _ends_mid_line(path: str) -> bool:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"
