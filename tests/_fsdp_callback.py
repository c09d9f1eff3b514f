"""FSDP2 under Lightning: ``ModelParallelStrategy`` (fully_shard in ``configure_model``) on 2 CPU processes (gloo),
the plain Trainer against ``ThunderCallback(thin=True, fuse_optimizer=True)`` (the whole step compiled: forward,
backward with its reduce-scatters, AdamW) and against ``ThunderCallback(thin=True)`` (the training_step alone, its
backward outside the program: refused with a clear error).

Run by tests/test_fsdp.py as ``python tests/_fsdp_callback.py OUT_DIR``.  Lightning's launcher starts rank 1 by
running this script again; each rank writes ``OUT_DIR/rank{r}.pt``.
"""
from __future__ import annotations

import os
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from thunder_train import ThunderCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 33), nn.GELU(), nn.Linear(33, 4))

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())


def run(callbacks):
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 4, (96,), generator=g))
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=6, callbacks=[*callbacks, losses],
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, process_group_backend="gloo"),
        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=8))
    local = lambda p: (p._local_tensor if isinstance(p, DTensor) else p).detach().clone()  # noqa: E731
    return trainer, {"losses": torch.stack(losses.losses), "params": [local(p) for p in model.parameters()],
                     "param_types": sorted({type(p).__name__ for p in model.parameters()})}


def main(out_dir):
    results = {}
    trainer, results["eager"] = run([])
    cb = ThunderCallback(thin=True, fuse_optimizer=True)
    trainer, results["fused"] = run([cb])
    results["fused"]["programs"] = sorted(cb.steps["training_step"].programs)
    results["fused"]["thin_calls"] = cb.compiled().stats.thin_calls
    try:
        run([ThunderCallback(thin=True)])
        results["split"] = "no error"
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        results["split"] = f"{type(e).__name__}: {e}"
    torch.save(results, os.path.join(out_dir, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
