"""One rank of a 2-rank job (NODE_RANK = this rank, one device per node, so that HYBRID_SHARD has a mesh of two
dimensions): sets up Fabric as train.py does under fsdp and then fsdp2 with HYBRID_SHARD, creates the checkpoint
writer's group, and prints the timeout of every process group that exists, one line per group and strategy."""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from app.checkpoint import CheckpointSaver
from app.distributed.strategy import build_fabric
from arguments import read_config

rank, ports = int(sys.argv[1]), sys.argv[2:]
for strategy, port in zip(("fsdp", "fsdp2"), ports):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, NODE_RANK=str(rank), LOCAL_RANK="0")
    cfg = read_config(["--model_name", "unused", "--train_data_dir", "unused", "--accelerator", "cpu", "--devices", "1",
                       "--num_nodes", "2", "--strategy", strategy, "--sharding_strategy", "HYBRID_SHARD",
                       "--process_group_timeout_min", "7", "--stall_timeout_min", "5"])
    fabric = build_fabric(cfg, world_size=2, wrap_classes=set(), loggers=[])
    fabric.launch()
    CheckpointSaver(fabric, {}, sharded=True, background=False)
    for group in list(distributed_c10d._world.pg_map):
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        print(f"{strategy} group {group.group_name} ({group.size()} ranks): {timeout.total_seconds() / 60:g} min")
    dist.destroy_process_group()
