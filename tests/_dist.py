"""Gloo process groups on the CPU for the DDP and FSDP2 tests.

``run_script(script, out_dir, *args)`` (in a test) runs ``tests/<script>`` in a fresh interpreter; that script calls
``spawn(run, out_dir, world)``, which starts ``run(rank, world, out_dir)`` on ``world`` ranks joined in one gloo
process group.  The ranks are forked from the script's process, which has imported torch and thunder_train already:
a rank starts in milliseconds instead of importing them again (seconds each on CI's two cores).  No process group
or thread pool exists before the fork.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    mp.start_processes(_init_and_run, args=(world, out_dir, port, run), nprocs=world, join=True, start_method="fork")


def run_script(script, out_dir, *args, timeout=600):
    """Run ``tests/<script> OUT_DIR ARGS...``; its stderr's end is the failure message."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tests", script), str(out_dir), *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]


def refused(fn, *args):
    """The message of the error ``fn(*args)`` raises, with its type ("no error" if none)."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"
