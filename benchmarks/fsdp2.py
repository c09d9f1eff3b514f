"""A fully_shard (FSDP2) GPT training step on CPU ranks (gloo): eager FSDP2 against tt.compile(step, thin=True).

Run: python benchmarks/fsdp2.py [--world 2] [--steps 20] [--layers 4] [--d 256] [--reshard-after-forward 0|1]
                                [--prefetch 0|1] [--memory]

``--memory`` measures instead the peak memory of one rank of ``--world`` in this process on torch's fake process group
(collectives move no data): eager FSDP2 against the compiled step, both with reshard_after_forward True and False.
The timing run prints the peak on its gloo ranks, counted by c10's allocator across threads (tests/_peak.py:
``peak_call_bytes_all_threads``; gloo's worker threads free collective buffers, which the profiler's own per-thread
events miss).

``--prefetch 1`` sets THUNDER_TRAIN_PREFETCH=1: each unit's all-gathers start during the unit before it
(transforms/collectives.py; off on CPU ranks by default).

Each rank builds the recipe's GPT (recipes/gpt.py), applies fully_shard to every block and to the root (torchtitan's
layout), and trains two copies of the same weights with AdamW on the same batches: eager FSDP2 and the compiled
whole step.  The samples interleave (eager, compiled, eager, ...) so a slow phase of a shared machine costs both
alike.  Rank 0 prints the first call of each, the median step time and ``eager median / compiled median`` (> 1:
the compiled step is faster), the largest difference of the losses, and the peak memory of one step on rank 0
(bytes allocated during the step above what was live before it, from torch.profiler's allocator events, plus the
buffers the compiled program keeps between calls: as benchmarks/train_step.py measures it).  On a machine with GPUs the same script
with ``--device cuda`` and the nccl backend is the GPU measurement (not run here: no GPU).  Not a test: timings vary.
"""
from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fsdp_gpt import gpt, shard, step  # noqa: E402  (the GPT and step of tests/test_fsdp.py's peak-memory test)
from train_step import peak_call_bytes  # noqa: E402  (one way of measuring a step's peak, shared by the benchmarks)
from _peak import peak_call_bytes_all_threads  # noqa: E402  (the same count across threads: gloo's workers free memory)


def run(rank, args, port):
    import thunder_train as tt

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if args.prefetch is not None:
        os.environ["THUNDER_TRAIN_PREFETCH"] = str(args.prefetch)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // args.world))
    try:
        torch.manual_seed(0)
        base = gpt(vocab=1024, block=64, layers=args.layers, d=args.d)
        models = []
        for _ in range(2):
            m = shard(copy.deepcopy(base), bool(args.reshard_after_forward))
            models.append((m, torch.optim.AdamW(m.parameters(), lr=1e-3)))
        g = torch.Generator().manual_seed(rank)
        batches = [(torch.randint(0, 1024, (4, 64), generator=g), torch.randint(0, 1024, (4, 64), generator=g))
                   for _ in range(args.steps)]
        fns = [step, tt.compile(step, thin=True)]
        times, losses = [[], []], [[], []]
        first = [0.0, 0.0]
        for i, (x, y) in enumerate(batches):
            for k, ((m, o), fn) in enumerate(zip(models, fns)):
                dist.barrier()
                t0 = time.perf_counter()
                loss = fn(m, o, x, y)
                dt = time.perf_counter() - t0
                losses[k].append(float(loss.detach()))
                if i < 3:  # the first calls trace (and AdamW's lazy state retraces once)
                    first[k] += dt
                else:
                    times[k].append(dt)
        x, y = batches[-1]
        peaks = []
        for (m, o), fn in zip(models, fns):
            dist.barrier()
            peaks.append(peak_call_bytes_all_threads(lambda: fn(m, o, x, y), None if fn is step else fn))
        if rank == 0:
            diff = max(abs(a - b) for a, b in zip(*losses))
            print(f"world {args.world}, GPT {args.layers} x {args.d}, batch 4 x 64, {args.steps} steps")
            print(f"first {min(3, args.steps)} calls: eager {first[0]:.2f} s, compiled {first[1]:.2f} s")
            if times[0]:
                e, c = statistics.median(times[0]), statistics.median(times[1])
                print(f"median step: eager FSDP2 {e * 1e3:.1f} ms, tt.compile(thin) {c * 1e3:.1f} ms, ratio {e / c:.2f}")
            else:  # every call was one of the first three
                print("median step: not measured (the first 3 calls trace; run with --steps 4 or more)")
            print(f"largest loss difference: {diff:.2e}")
            print(f"peak memory of a step (rank 0): eager FSDP2 {peaks[0] / 2**20:.2f} MiB, compiled "
                  f"{peaks[1] / 2**20:.2f} MiB, ratio {peaks[1] / peaks[0]:.2f} (reshard_after_forward="
                  f"{bool(args.reshard_after_forward)}, prefetch={'default' if args.prefetch is None else args.prefetch})")
    finally:
        dist.destroy_process_group()


def fake_pg_memory(args):
    """The table of ``--memory`` (see the module's text)."""
    import thunder_train as tt
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.setdefault("THUNDER_TRAIN_FUSION", "off")  # the torch program: the one whose plan is measured
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    print(f"peak memory of a step, one rank of {args.world} (fake process group), GPT {args.layers} x {args.d}, "
          "batch 4 x 64, AdamW")
    for reshard in (True, False):
        peaks = []
        for compiled in (False, True):
            torch.manual_seed(0)
            m = shard(gpt(vocab=1024, block=64, layers=args.layers, d=args.d), reshard)
            o = torch.optim.AdamW(m.parameters(), lr=1e-3)
            x, y = torch.randint(0, 1024, (4, 64)), torch.randint(0, 1024, (4, 64))
            fn = tt.compile(step, thin=True) if compiled else step
            for _ in range(3):
                fn(m, o, x, y)
            peaks.append(peak_call_bytes(lambda: fn(m, o, x, y), fn if compiled else None))
        print(f"reshard_after_forward={reshard}: eager FSDP2 {peaks[0] / 2**20:.2f} MiB, compiled "
              f"{peaks[1] / 2**20:.2f} MiB, ratio {peaks[1] / peaks[0]:.2f}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--reshard-after-forward", type=int, default=1)
    ap.add_argument("--prefetch", type=int, choices=(0, 1), default=None)
    ap.add_argument("--memory", action="store_true")
    args = ap.parse_args()
    if args.prefetch is not None:
        os.environ["THUNDER_TRAIN_PREFETCH"] = str(args.prefetch)
    if args.memory:
        return fake_pg_memory(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args, port), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
