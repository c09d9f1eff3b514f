"""DDP on 2 CPU processes (gloo): the plain Trainer, then the same run with ThunderCallback(thin=True).

Run by tests/test_callback.py::test_ddp_two_cpu_processes as ``python tests/_ddp_callback.py OUT_DIR``.
Lightning's launcher starts rank 1 by running this script again; each rank writes
``OUT_DIR/rank{r}.pt`` with the losses and final parameters of both runs.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
import lightning as L
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from thunder_train import ThunderCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

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
    data = TensorDataset(torch.randn(128, 8, generator=g), torch.randint(0, 4, (128,), generator=g))
    losses = Losses()
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=DDPStrategy(process_group_backend="gloo"), max_steps=12,
        callbacks=[*callbacks, losses], enable_progress_bar=False, logger=False, enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(data, batch_size=16))
    return trainer, {"losses": torch.stack(losses.losses), "params": [p.detach().clone() for p in model.parameters()],
                     "logged": float(trainer.callback_metrics["train_loss"])}


def main(out_dir):
    trainer, eager = run([])
    cb = ThunderCallback(thin=True)
    trainer, thunder = run([cb])
    thunder["thin_calls"] = cb.compiled().stats.thin_calls
    torch.save({"eager": eager, "thunder": thunder}, os.path.join(out_dir, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
