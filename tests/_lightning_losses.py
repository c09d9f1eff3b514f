"""The Lightning callback the tests use to record each step's loss (lightning is imported on use)."""
from __future__ import annotations

import lightning as L


class Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].detach().clone())
