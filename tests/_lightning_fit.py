"""One Lightning ``Trainer.fit`` on 2 CPU ranks (gloo), as the distributed callback scenarios run it
(tests/_ddp_callback.py: DDPStrategy, tests/_fsdp_callback.py: ModelParallelStrategy): a seeded model, the same
seeded data on every rank (the sampler gives each rank its part), each step's loss recorded, nothing else on.

Both run inside ranks forked by tests/_dist.py: ``in_rank(rank, world)`` sets what Lightning reads to find itself
launched (``LOCAL_RANK`` and friends), so it starts no process and takes the gloo group that exists."""
from __future__ import annotations

import contextlib
import os

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from _lightning_losses import Losses


@contextlib.contextmanager
def in_rank(rank: int, world: int):
    """Lightning's view of this process: rank ``rank`` of ``world``, launched externally (the variables are
    removed afterwards)."""
    env = {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world)}
    os.environ.update(env)
    try:
        yield
    finally:
        for k in env:
            os.environ.pop(k, None)


def fit(make_model, strategy, callbacks, *, samples, batch_size, max_steps, accumulate=1, **trainer_kw):
    """``(trainer, model, losses)`` after ``max_steps`` steps of ``make_model()`` (seeded) on 8 random features and
    4 classes per sample; ``trainer_kw``: more arguments of the Trainer."""
    torch.manual_seed(0)
    model = make_model()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, 8, generator=g), torch.randint(0, 4, (samples,), generator=g))
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=max_steps, callbacks=[*callbacks, losses],
        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False,
        accumulate_grad_batches=accumulate, **trainer_kw)
    trainer.fit(model, DataLoader(data, batch_size=batch_size))
    return trainer, model, torch.stack(losses.losses)
