"""Two-process gloo runs for the DDP tests: ``spawn(run, out_dir)`` starts ``run(rank, world, out_dir)`` on 2 ranks."""
from __future__ import annotations

import os
import socket

import torch.distributed as dist
import torch.multiprocessing as mp


def _init_and_run(rank, world, out_dir, port, run):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, out_dir)
    finally:
        dist.destroy_process_group()


def spawn(run, out_dir, world: int = 2):
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_init_and_run, args=(world, out_dir, port, run), nprocs=world, join=True)
