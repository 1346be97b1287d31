"""Rank program for test_two_torchrun_agents_detect_topology (run by torchrun)."""
import os
import sys

import torch.distributed as dist

from tests.scenarios import train_side_by_side

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res = train_side_by_side(rank, dist.get_world_size(), {"steps": 3, "bucket_cap_mb": 0.0001})
    assert res["comm_stats"].keys() == {"intra", "inter"}, res["comm_stats"]
    status = "ok" if res["param_diff"] <= 2e-5 else f"diff {res['param_diff']}"
    node = int(os.environ["GROUP_RANK"])
    local = int(os.environ["LOCAL_RANK"])
    with open(os.path.join(sys.argv[1], f"rank{rank}.txt"), "w") as f:
        f.write(f"{rank} {node} {local} {res['slice_index']} {status}")
    dist.destroy_process_group()
