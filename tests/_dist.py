"""Gloo process groups on the CPU for the DDP and FSDP2 tests.

``spawn(run, out_dir, world)`` starts ``run(rank, world, out_dir)`` on ``world`` ranks joined in one gloo process
group, forked from the calling process: a rank starts in milliseconds and finds torch, thunder_train (and whatever
the caller imported or warmed up) ready, instead of importing them again (seconds each on CI's two cores).

``run_ranks(module, out_dir, *args)`` (in a test) runs the scenarios of ``tests/<module>.py`` (its
``main(out_dir, *args)``, which calls ``spawn``) from the test process itself: under pytest-xdist every worker has
imported torch, thunder_train and lightning while collecting, so the ranks cost no interpreter start and no
import.  Where forking this process is not safe (CUDA initialized here: a forked child cannot use it, nor should
it inherit it), the module runs in a fresh interpreter instead (``python tests/<module>.py OUT_DIR ARGS...``).
"""
from __future__ import annotations

import gc
import importlib
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _init_and_run(rank, world, out_dir, port, run):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # One intra-op thread per rank: the ranks share CI's two cores, and a forked child never enters an OpenMP
    # pool its parent may have started.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, out_dir)
    finally:
        dist.destroy_process_group()


def spawn(run, out_dir, world: int = 2, timeout: float = 600):
    """Fork ``world`` ranks running ``run(rank, world, out_dir)``; a rank's exception is raised here with its
    traceback, and ranks still running after ``timeout`` seconds (a collective that never completes) are killed."""
    from thunder_train.compiler.acquisition.acquire import TRACING_LOCK

    assert not dist.is_initialized(), "a process group exists in the process that forks the ranks"
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Held while forking: no other thread of this process is half-way through a trace the children would inherit.
    # Frozen: the ranks' garbage collector skips the objects they inherit (the test process's modules, some 400k
    # objects), which each full collection would otherwise walk and, by touching them, copy page by page.
    with TRACING_LOCK:
        gc.freeze()
        try:
            ranks = mp.start_processes(_init_and_run, args=(world, out_dir, port, run), nprocs=world, join=False,
                                       start_method="fork")
        finally:
            gc.unfreeze()
    deadline = time.monotonic() + timeout
    while not ranks.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for p in ranks.processes:
                p.kill()
            raise TimeoutError(f"{world} ranks of {run.__module__}.{run.__name__} still running after {timeout} s")


def run_ranks(module, out_dir, *args, timeout=600):
    """Run ``tests/<module>.py``'s ``main(out_dir, *args)``: in this process (its ranks forked from it), or in a
    fresh interpreter where CUDA is initialized here."""
    if torch.cuda.is_initialized():
        return run_script(f"{module}.py", out_dir, *args, timeout=timeout)
    importlib.import_module(module).main(str(out_dir), *args)


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
