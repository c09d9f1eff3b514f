"""Issue 14 through ThunderCallback: a user callback changing training state between steps gives eager's result.

The same tiny fit runs on the plain Trainer and with ``ThunderCallback(thin=True)`` (also
``fuse_optimizer=True``: forward, backward and ``optimizer.step()`` in one program); a user callback
changes the optimizer's ``betas``, resets its state, toggles ``maximize`` or switches BatchNorm to eval
at fixed steps. Losses, parameters and buffers must match.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

L = pytest.importorskip("lightning")
from _lightning_losses import Losses  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train.callbacks import ThunderCallback  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning", "ignore::DeprecationWarning",
                                        "ignore:.*LeafSpec.*", "ignore:.*does not have many workers.*",
                                        "ignore:.*number of training batches.*", "ignore:.*no `val_dataloader`.*")


class WithBN(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.BatchNorm1d(16), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class Hazard(L.Callback):
    """Applies ``fn(module, optimizer)`` before the training batch ``at``."""

    def __init__(self, at, fn):
        self.at, self.fn = at, fn

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step in self.at:
            self.fn(pl_module, trainer.optimizers[0])


def data(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, torch.randint(0, 4, (n,), generator=g)), batch_size=8)


def fit(callbacks, max_steps=10):
    torch.manual_seed(0)
    model = WithBN()
    losses = Losses()
    trainer = L.Trainer(callbacks=[*callbacks, losses], max_steps=max_steps, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(model, data())
    return model, torch.stack(losses.losses), trainer


def _betas(m, o):
    o.param_groups[0]["betas"] = (0.5, 0.9)


def _clear(m, o):
    o.state.clear()


def _reset_one(m, o):
    o.state[m.net[0].weight] = {}


def _maximize(m, o):
    o.param_groups[0]["maximize"] = not o.param_groups[0]["maximize"]


def _bn_eval(m, o):
    m.net[2].eval()  # freeze BatchNorm statistics (Lightning's model.train() each epoch would undo it)


HAZARDS = {"betas": _betas, "state.clear": _clear, "state[p]={}": _reset_one, "maximize": _maximize, "bn.eval": _bn_eval}


@pytest.mark.parametrize("fuse", [False, True], ids=["step", "fuse_optimizer"])
@pytest.mark.parametrize("name", list(HAZARDS))
def test_user_callback_hazard_matches_plain_trainer(name, fuse):
    at = (4, 7)
    m_ref, l_ref, _ = fit([Hazard(at, HAZARDS[name])])
    cb = ThunderCallback(thin=True, fuse_optimizer=True) if fuse else ThunderCallback(thin=True)
    m, l, trainer = fit([cb, Hazard(at, HAZARDS[name])])
    torch.testing.assert_close(l, l_ref, rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(m_ref.named_parameters(), m.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda s: f"{n}: {s}")
    for (n, a), b in zip(m_ref.named_buffers(), m.buffers()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda s: f"{n}: {s}")
    sa, sb = m_ref.trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    assert tt.compile_stats(cb.compiled()).thin_calls > 0


@pytest.mark.parametrize("option", ["thin", "strict", "fuse_optimizer", "compile_eval"])
@pytest.mark.parametrize("value", ["False", 1, None])
def test_callback_flags_must_be_bools(option, value):
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match=f"{option} must be a bool"):
        ThunderCallback(**{option: value})
