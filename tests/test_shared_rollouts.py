"""SharedWork, behind batch_iterator.use_flask (NeMo-Aligner's rollout balancer): the data-parallel ranks
share out their work items as each becomes free, and each gets back the results of its own items.
End to end: test_grpo.py (use_flask at data parallel 2 equals the even split)."""

import json
import os

from conftest import WORKERS, run_python


def test_a_slow_rank_runs_fewer_items_and_every_rank_gets_its_own_results(tmp_path):
    run_python(os.path.join(WORKERS, "shared_work_worker.py"), [str(tmp_path)], nproc=2)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for round_ in ("0", "1"):
        ran = [set(report[round_]["ran"]) for report in reports]
        assert ran[0].isdisjoint(ran[1]) and ran[0] | ran[1] == set(range(10))  # each item once
        assert len(ran[0]) > 6 and len(ran[1]) < 4, ran  # rank 1 sleeps per item: rank 0 takes some of its items
        assert reports[0][round_]["mine"] == [f"R0-{round_}-{j}" for j in range(6)]
        assert reports[1][round_]["mine"] == [f"R1-{round_}-{j}" for j in range(4)]
        assert reports[0][round_]["none"] is None and reports[1][round_]["none"] is None
    assert reports[0]["empty"] == ["x"] and reports[1]["empty"] == []

