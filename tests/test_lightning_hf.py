"""ThunderCallback trains a LightningModule wrapping a transformers model exactly like the plain Trainer.

The zoo's tiny random-init models (``tests/_zoo.py``, no downloads) inside a LightningModule whose
``training_step`` is ``self.model(**batch).loss``: the same fit runs without and with the callback and the
per-step losses and final parameters are compared.
"""
from __future__ import annotations

import pytest
import torch

import _zoo

L = pytest.importorskip("lightning")
from _lightning_losses import Losses  # noqa: E402
pytest.importorskip("transformers")
from thunder_train import ThunderCallback  # noqa: E402
import thunder_train as tt  # noqa: E402

STEPS = 5
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning", "ignore::DeprecationWarning", "ignore::FutureWarning",
                                        "ignore:.*LeafSpec.*", "ignore:.*does not have many workers.*",
                                        "ignore:.*number of training batches.*")


class HFModule(L.LightningModule):
    def __init__(self, name):
        super().__init__()
        self.model = _zoo.build(name)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, eps=1e-6)


def fit(name, callbacks=()):
    module = HFModule(name)
    losses = Losses()
    trainer = L.Trainer(callbacks=[*callbacks, losses], max_steps=STEPS, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        num_sanity_val_steps=0, limit_val_batches=0)
    # The zoo's batches are already batched dicts: batch_size=None hands each one over as it is.
    data = torch.utils.data.DataLoader(_zoo.batches(name, STEPS), batch_size=None)
    trainer.fit(module, data)
    return trainer, module, torch.stack(losses.losses)


@pytest.mark.parametrize("name, options", [
    pytest.param("gpt2", dict(thin=True), id="gpt2-thin"),
    pytest.param("gpt2", dict(thin=True, fuse_optimizer=True), id="gpt2-thin-fused"),
    pytest.param("vit", dict(), id="vit"),
])
def test_callback_trains_hf_model_like_plain_trainer(name, options):
    eager_trainer, eager, eager_losses = fit(name)
    cb = ThunderCallback(**options)
    trainer, module, losses = fit(name, [cb])
    assert len(losses) == STEPS
    torch.testing.assert_close(losses, eager_losses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(trainer.callback_metrics["train_loss"], eager_trainer.callback_metrics["train_loss"],
                               rtol=1e-4, atol=1e-5)
    for (n, a), b in zip(eager.named_parameters(), module.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")
    stats = tt.compile_stats(cb.compiled("training_step"))
    assert stats.calls == STEPS
    if options.get("thin"):
        assert stats.thin_calls > 0
