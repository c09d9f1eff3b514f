"""Random ops draw eager's numbers: with ``torch.manual_seed(s)`` before the eager and before the compiled run,
dropout masks, ``torch.rand``/``randn``/``randint``/``bernoulli`` and friends give eager's values, hence eager's
losses, gradients and parameters over whole training steps, and leave the global generator where eager
leaves it (docs/training_step.md, "Random numbers"). CPU: CUDA parity is not covered here.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FUSIONS = [None, "inductor"]
MODES = [False, True]


class DropMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(8, 32), nn.Dropout(p=0.1), nn.Linear(32, 4)

    def forward(self, x):
        h = self.drop(torch.relu(self.fc1(x)))
        h = F.dropout(h, 0.2, training=self.training)  # functional dropout too
        return self.fc2(h)


def random_step(model, opt, x, y):
    """A training step that also draws random numbers itself (noise, masks, label permutation)."""
    noise = torch.rand(x.shape) * 0.01 + torch.randn_like(x) * 0.01
    keep = torch.bernoulli(torch.full(x.shape, 0.9))
    shift = torch.randint(0, 4, (x.shape[0],))
    loss = F.cross_entropy(model(x * keep + noise), (y + shift) % 4)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _run(step, model, opt, batches, seed):
    torch.manual_seed(seed)
    losses = [step(model, opt, x, y) for x, y in batches]
    return losses, torch.get_rng_state()


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(n)]


def _assert_same_training(eager, compiled, eager_out, compiled_out):
    (le, se), (lc, sc) = eager_out, compiled_out
    for a, b in zip(lc, le):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(sc, se), "the compiled steps left the global generator in another state than eager"
    for (n, a), b in zip(eager[0].named_parameters(), compiled[0].parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("fusion", FUSIONS, ids=["unfused", "inductor"])
@pytest.mark.parametrize("thin", MODES, ids=["full", "thin"])
def test_dropout_and_random_ops_train_like_eager(thin, fusion):
    torch.manual_seed(0)
    model = DropMLP()
    eager = (model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    m2 = copy.deepcopy(model)
    compiled = (m2, torch.optim.AdamW(m2.parameters(), lr=1e-2, eps=1e-6))
    batches = _batches(5)
    cf = tt.compile(random_step, thin=thin, fusion=fusion)
    out_e = _run(random_step, *eager, batches, seed=123)
    out_c = _run(cf, *compiled, batches, seed=123)
    _assert_same_training(eager, compiled, out_e, out_c)
    if thin:
        assert cf.is_thin_bound
    # The masks really are random: another seed gives other losses.
    other = _run(cf, *copy.deepcopy(compiled), batches, seed=7)
    assert not torch.equal(other[0][0], out_c[0][0])


@pytest.mark.parametrize("thin", MODES, ids=["full", "thin"])
def test_compiled_module_forward_and_backward_with_dropout(thin):
    torch.manual_seed(0)
    model = DropMLP()
    twin = copy.deepcopy(model)
    cm = tt.compile(twin, thin=thin)
    x = torch.randn(6, 8)
    for seed in (1, 2, 3):
        torch.manual_seed(seed)
        want = model(x).square().mean()
        want.backward()
        torch.manual_seed(seed)
        got = cm(x).square().mean()
        got.backward()
        torch.testing.assert_close(got, want)
        for (n, a), b in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(b.grad, a.grad, msg=lambda m: f"{n}.grad: {m}")


# Random ops inside a function, one by one: values and the generator's state after the call.
RANDOM_OPS = {
    "rand": lambda x: x + torch.rand(x.shape),
    "randn_like": lambda x: x + torch.randn_like(x),
    "randint": lambda x: x + torch.randint(0, 5, x.shape),
    "bernoulli": lambda x: torch.bernoulli(torch.sigmoid(x)),
    "dropout": lambda x: F.dropout(x, 0.3),
    "dropout2d": lambda x: F.dropout2d(x.reshape(1, 2, 3, 4), 0.3),
    "uniform_": lambda x: x.clone().uniform_(),
    "normal": lambda x: torch.normal(x, 1.0),
    "randperm": lambda x: x[:, torch.randperm(12)],
    "multinomial": lambda x: torch.multinomial(torch.softmax(x, -1), 3),
    "rrelu": lambda x: F.rrelu(x, training=True),
    "sdpa_dropout": lambda x: F.scaled_dot_product_attention(*[x.reshape(1, 2, 3, 4)] * 3, dropout_p=0.3),
}


@pytest.mark.parametrize("fusion", FUSIONS, ids=["unfused", "inductor"])
@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_random_op_draws_eagers_numbers(name, fusion):
    f = RANDOM_OPS[name]
    cf = tt.compile(f, fusion=fusion)
    x = torch.randn(2, 12)
    torch.manual_seed(5)
    want = [f(x) for _ in range(3)]
    state = torch.get_rng_state()
    torch.manual_seed(5)
    got = [cf(x) for _ in range(3)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.get_rng_state(), state)


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.1,
                                  embd_pdrop=0.1, attn_pdrop=0.1, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    m = transformers.GPT2LMHeadModel(cfg)
    m.train()
    return m


def hf_step(model, opt, batch):
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("fusion", FUSIONS, ids=["unfused", "inductor"])
@pytest.mark.parametrize("thin", MODES, ids=["full", "thin"])
def test_gpt2_with_dropout_trains_like_eager(thin, fusion):
    model = _gpt2()
    twin = copy.deepcopy(model)
    eager = (model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6))
    compiled = (twin, torch.optim.AdamW(twin.parameters(), lr=1e-2, eps=1e-6))
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 64, (2, 12), generator=g)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    cf = tt.compile(hf_step, thin=thin, fusion=fusion)
    torch.manual_seed(11)
    le = [hf_step(*eager, b) for b in batches]
    se = torch.get_rng_state()
    torch.manual_seed(11)
    lc = [cf(*compiled, b) for b in batches]
    _assert_same_training(eager, compiled, (le, se), (lc, torch.get_rng_state()))


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("options", [dict(), dict(thin=True), dict(fuse_optimizer=True)], ids=["full", "thin", "whole_step"])
def test_thunder_callback_with_dropout_matches_plain_trainer(options):
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from thunder_train.callbacks import ThunderCallback

    class Dropped(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = DropMLP()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, eps=1e-6)

    from _lightning_losses import Losses

    def fit(callbacks):
        torch.manual_seed(0)
        module, losses = Dropped(), Losses()
        g = torch.Generator().manual_seed(1)
        data = DataLoader(TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g)), batch_size=8)
        trainer = L.Trainer(callbacks=[*callbacks, losses], max_steps=6, enable_progress_bar=False, logger=False,
                            enable_checkpointing=False, enable_model_summary=False, accelerator="cpu", devices=1,
                            limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(module, data)
        return module, torch.stack(losses.losses), torch.get_rng_state()

    (me, le, se), (mc, lc, sc) = fit([]), fit([ThunderCallback(**options)])
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    assert torch.equal(sc, se)
    for (n, a), b in zip(me.named_parameters(), mc.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")


def test_background_fusion_does_not_rewind_the_generator(monkeypatch):
    """Inductor sets the generators back to their state before it compiled; on the background worker that would
    rewind what the training loop drew meanwhile (dropout masks repeat). The compile is made to take 0.5 s inside
    that window, while the loop keeps stepping."""
    pytest.importorskip("torch._inductor")
    from torch._inductor import config

    # The entry's default, which every thread reads: a value set on the config module is the setting thread's alone
    # (torch's config values are per thread), and pytest's monkeypatch restores a module attribute it did not find
    # in the module's ``__dict__`` by deleting it, which hides the setting from every later compile in the process
    # (each then failed with "torch._inductor.config.sleep_sec_TESTING_ONLY does not exist").
    monkeypatch.setattr(config._config["sleep_sec_TESTING_ONLY"], "default", 0.5)
    monkeypatch.delenv("THUNDER_TRAIN_FUSION", raising=False)  # tests/conftest.py turns background fusion off
    torch.manual_seed(0)
    model = DropMLP()
    eager = (model, torch.optim.SGD(model.parameters(), lr=0.1))
    m2 = copy.deepcopy(model)
    compiled = (m2, torch.optim.SGD(m2.parameters(), lr=0.1))
    x, y = _batches(1)[0]
    cf = tt.compile(random_step, fusion="background")
    torch.manual_seed(3)
    got, after = [], None
    while after is None or len(got) < after + 3:
        got.append(cf(*compiled, x, y))
        if after is None and tt.wait_for_fusion(cf, timeout=0) and len(got) > 2:
            after = len(got)
        assert len(got) < 20000, "the background build did not finish"
    state = torch.get_rng_state()
    assert any("replaced the torch program" in n for n in tt.compile_stats(cf).fusion_notes), tt.compile_stats(cf).fusion_notes
    torch.manual_seed(3)
    want = [random_step(*eager, x, y) for _ in got]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert torch.equal(state, torch.get_rng_state())
