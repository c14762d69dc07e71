"""Two gloo ranks share out their work items with SharedWork; rank 1 is slow, so rank 0 runs more
of them. Writes what each rank ran and got back as JSON to ``<out>/rank<r>.json``."""

import json
import os
import sys
import time

import torch.distributed as dist

from nemo_aligner.utils.shared_work import SharedWork

out = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
report = {}
for round_ in range(2):  # a second round starts from its own counter
    local = [f"r{rank}-{round_}-{j}" for j in range(6 if rank == 0 else 4)]
    work = SharedWork(local, group=None, claimer=True)
    ran = {}
    for index, item in work:
        if rank == 1:
            time.sleep(0.3)
        ran[index] = item.upper()
    report[round_] = {"ran": sorted(ran), "mine": work.mine(ran), "none": work.mine(None)}
empty = SharedWork([] if rank == 1 else ["x"], group=None, claimer=True)  # a rank with nothing of its own
report["empty"] = empty.mine({i: item for i, item in empty})
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()
