"""ThunderCallback against the plain Lightning Trainer: same losses, parameters and logged metrics.

Every test runs the same tiny fit twice, without and with the callback, and compares.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

L = pytest.importorskip("lightning")
from _dist import run_ranks  # noqa: E402
from _lightning_losses import Losses  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train.callbacks import ThunderCallback  # noqa: E402
from thunder_train.callbacks.compiled_step import BATCH_IDX, StepError  # noqa: E402

# Lightning's advice about dataloader workers, logging intervals etc. is noise here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:lightning", "ignore::DeprecationWarning",
                                        "ignore:.*LeafSpec.*", "ignore:.*does not have many workers.*",
                                        "ignore:.*number of training batches.*", "ignore:.*no `val_dataloader`.*")


class Tiny(L.LightningModule):
    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(8, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log_dict({"train_acc": (logits.argmax(-1) == y).float().mean()})
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self.net(x), y))

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0]).softmax(-1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def data(n=96, batch_size=16):
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
    return DataLoader(ds, batch_size=batch_size)


def fit(callbacks=(), *, module_cls=Tiny, max_steps=20, n=96, val=False, ckpt_path=None, model=None, **trainer_kwargs):
    """One fit from a fixed seed; returns (trainer, module, losses)."""
    torch.manual_seed(0)
    model = model if model is not None else module_cls()
    losses = Losses()
    options = dict(max_steps=max_steps, enable_progress_bar=False, logger=False, enable_checkpointing=False,
                   enable_model_summary=False, accelerator="cpu", devices=1, num_sanity_val_steps=0)
    if not val:
        options["limit_val_batches"] = 0
    options.update(trainer_kwargs)
    trainer = L.Trainer(callbacks=[*callbacks, losses], **options)
    trainer.fit(model, data(n), data(n) if val else None, ckpt_path=ckpt_path)
    return trainer, model, torch.stack(losses.losses)


def assert_same(run_a, run_b, rtol=1e-5, atol=1e-6):
    (ta, ma, la), (tb, mb, lb) = run_a, run_b
    torch.testing.assert_close(la, lb, rtol=rtol, atol=atol)
    for (name, pa), (_, pb) in zip(ma.named_parameters(), mb.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")
    assert ta.callback_metrics.keys() == tb.callback_metrics.keys()
    for k in ta.callback_metrics:
        torch.testing.assert_close(ta.callback_metrics[k], tb.callback_metrics[k], rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------
# Automatic optimization
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("thin", [False, True])
def test_automatic_optimization_matches_plain_trainer(thin):
    eager = fit()
    cb = ThunderCallback(thin=thin)
    compiled = fit([cb])
    assert_same(eager, compiled)
    stats = tt.compile_stats(cb.compiled("training_step"))
    assert stats.calls == 20
    assert stats.entries == 1, stats.retrace_reasons  # batch_idx changes every step; no retrace
    if thin:
        assert stats.thin_calls >= 17
    assert "train_loss" in compiled[0].callback_metrics and "train_acc" in compiled[0].callback_metrics
    # The executed program is thunder_train's, with its own backward.
    assert "def computation(" in str(tt.last_traces(cb.compiled())[-1])
    assert tt.last_backward_traces(cb.compiled())


def test_module_is_patched_not_wrapped():
    seen = {}

    class Probe(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen["patched"] = "training_step" in pl_module.__dict__
            seen["strategy_model"] = trainer.strategy.model is pl_module

    eager = fit(max_steps=3)
    trainer, model, _ = fit([ThunderCallback(thin=True), Probe()], max_steps=3)
    assert seen == {"patched": True, "strategy_model": True}
    assert "training_step" not in model.__dict__  # teardown restored the class method
    assert list(model.state_dict()) == list(eager[1].state_dict())


def test_gradient_accumulation_and_clipping():
    kwargs = dict(accumulate_grad_batches=3, gradient_clip_val=0.05, max_steps=6)
    eager = fit(**kwargs)
    cb = ThunderCallback(thin=True)
    compiled = fit([cb], **kwargs)
    assert len(compiled[2]) == 18  # 6 optimizer steps × 3 accumulated batches
    assert_same(eager, compiled)
    assert tt.compile_stats(cb.compiled()).entries == 1


def test_clipping_fires_on_before_optimizer_step():
    norms = {}

    class GradNorm(L.Callback):
        def __init__(self, key):
            self.key = key

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            norms.setdefault(self.key, []).append(sum(p.grad.norm() ** 2 for p in pl_module.parameters()).sqrt())

    fit([GradNorm("eager")], max_steps=5, gradient_clip_val=0.1)
    fit([ThunderCallback(), GradNorm("thunder")], max_steps=5, gradient_clip_val=0.1)
    torch.testing.assert_close(torch.stack(norms["eager"]), torch.stack(norms["thunder"]), rtol=1e-5, atol=1e-6)


def test_partial_last_batch_in_thin_mode():
    # 100 samples / 16: the last batch of every epoch has 4 samples.
    eager = fit(n=100, max_steps=20)
    cb = ThunderCallback(thin=True)
    compiled = fit([cb], n=100, max_steps=20)
    assert_same(eager, compiled)
    step = cb.steps["training_step"]
    # Epochs 1 and 2 ended on a smaller batch: no ThinModeError to catch since issue 26 (the batch size became
    # symbolic at the first one, and the bound symbolic program ran the second).
    assert step.thin_rebinds == 0
    stats = tt.compile_stats(cb.compiled())
    # Two traces: batch 16 specialised (freed once the batch size became symbolic), and the symbolic program traced
    # at 4, which serves every size (the step's means divide by the symbolic batch size, decided nowhere).
    assert stats.entries == 2 and len(cb.compiled()._lru) == 1 and stats.thin_calls > 0
    assert len(stats.retrace_reasons) == 1 and "(16, 8) → (4, 8)" in stats.retrace_reasons[0]


@pytest.mark.parametrize("precision", ["bf16-mixed"])
def test_bf16_mixed_matches_plain_trainer(precision):
    eager = fit(precision=precision, max_steps=10)
    cb = ThunderCallback(thin=True)
    compiled = fit([cb], precision=precision, max_steps=10)  # needs tracer autocast (compiler/torchlang/autocast.py)
    # bf16 matmuls: results agree to bf16 precision, and the trace sees bf16 values.
    assert_same(eager, compiled, rtol=2e-2, atol=2e-2)
    assert "bf16" in str(tt.last_traces(cb.compiled())[-1])


# ---------------------------------------------------------------------------
# Validation / test / predict
# ---------------------------------------------------------------------------
def test_eval_steps_stay_eager_by_default():
    patched = []

    class Probe(L.Callback):
        def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
            patched.append("validation_step" in pl_module.__dict__)

    cb = ThunderCallback()
    eager = fit(val=True, val_check_interval=5, limit_val_batches=2)
    compiled = fit([cb, Probe()], val=True, val_check_interval=5, limit_val_batches=2)
    assert_same(eager, compiled)
    assert patched and not any(patched)
    with pytest.raises(KeyError, match="validation_step has not been compiled"):
        cb.compiled("validation_step")


def test_compile_eval_validation_test_predict():
    class CountVal(L.Callback):
        n = 0

        def on_validation_batch_end(self, *args, **kwargs):
            CountVal.n += 1

    cb = ThunderCallback(thin=True, compile_eval=True)
    eager = fit(val=True, val_check_interval=5, limit_val_batches=3)
    compiled = fit([cb, CountVal()], val=True, val_check_interval=5, limit_val_batches=3)
    assert_same(eager, compiled)
    assert CountVal.n >= 9 and tt.compile_stats(cb.compiled("validation_step")).calls == CountVal.n
    for run in (eager, compiled):
        trainer, model = run[0], run[1]
        run[0].tested = trainer.test(model, data(100), verbose=False)
        run[0].predicted = torch.cat(trainer.predict(model, data(100)))
    # One dict of metrics per test dataloader (pytest.approx does not take nested structures).
    assert [d.keys() for d in eager[0].tested] == [d.keys() for d in compiled[0].tested]
    for e, c in zip(eager[0].tested, compiled[0].tested):
        assert c == pytest.approx(e, rel=1e-5)
    torch.testing.assert_close(eager[0].predicted, compiled[0].predicted, rtol=1e-5, atol=1e-6)
    assert cb.steps["predict_step"].calls == 7
    # Evaluation runs under torch.inference_mode: the program has no backward.
    assert not tt.last_backward_traces(cb.compiled("predict_step"))


# ---------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------
def test_checkpoint_saved_with_callback_loads_without_it(tmp_path):
    trainer, model, _ = fit([ThunderCallback(thin=True)], max_steps=8)
    path = tmp_path / "with_callback.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=False)
    assert list(ckpt["state_dict"]) == list(Tiny().state_dict())
    assert ckpt["callbacks"]["ThunderCallback"]["calls"] == {"training_step": 8}
    loaded = Tiny.load_from_checkpoint(path)
    for pa, pb in zip(model.parameters(), loaded.parameters()):
        torch.testing.assert_close(pa, pb)


def test_resume_from_checkpoint(tmp_path):
    """Fit 10 steps, save, resume to 20 (optimizer state restored after on_fit_start): with and without the callback."""
    runs = {}
    for name, make in (("eager", lambda: []), ("thunder", lambda: [ThunderCallback(thin=True)])):
        trainer, _, _ = fit(make(), max_steps=10)
        trainer.save_checkpoint(tmp_path / f"{name}.ckpt")
    runs["eager"] = fit([], max_steps=20, ckpt_path=tmp_path / "eager.ckpt")
    cb = ThunderCallback(thin=True)
    runs["thunder"] = fit([cb], max_steps=20, ckpt_path=tmp_path / "thunder.ckpt")
    # A checkpoint written with the callback resumes without it, and the other way round.
    runs["thunder_ckpt_eager_resume"] = fit([], max_steps=20, ckpt_path=tmp_path / "thunder.ckpt")
    runs["eager_ckpt_thunder_resume"] = fit([ThunderCallback(thin=True)], max_steps=20, ckpt_path=tmp_path / "eager.ckpt")
    assert len(runs["eager"][2]) == 10
    for name in ("thunder", "thunder_ckpt_eager_resume", "eager_ckpt_thunder_resume"):
        assert_same(runs["eager"], runs[name])
    assert runs["thunder"][0].global_step == 20
    assert tt.compile_stats(cb.compiled()).thin_calls >= 7
    assert cb.state_dict()["calls"] == {"training_step": 20}  # 10 before the checkpoint, 10 after


# ---------------------------------------------------------------------------
# DDP: 2 CPU processes, gloo
# ---------------------------------------------------------------------------
def test_ddp_two_cpu_processes(tmp_path):
    # Two gloo ranks forked from this process (tests/_dist.py), Lightning in each (tests/_ddp_callback.py).
    run_ranks("_ddp_callback", tmp_path)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    # The ranks saw different batches...
    assert not torch.allclose(r0["eager"]["losses"], r1["eager"]["losses"])
    runs = {"thunder": "eager", "fused": "eager", "fused_split": "eager", "fused_acc": "eager_acc"}
    for r in (r0, r1):
        for name, ref in runs.items():
            torch.testing.assert_close(r[name]["losses"], r[ref]["losses"], rtol=1e-5, atol=1e-6)
            for pe, pt in zip(r[ref]["params"], r[name]["params"]):
                torch.testing.assert_close(pt, pe, rtol=1e-5, atol=1e-6)
            assert r[name]["logged"] == pytest.approx(r[ref]["logged"], rel=1e-5)  # sync_dist=True replayed
            assert r[name]["thin_calls"] >= 9
        # fuse_optimizer=True: the program averages the gradients; split at on_after_backward, whose hook
        # sees the averaged gradients as in eager DDP; with accumulation, only the stepping batch averages.
        assert r["fused"]["programs"] == ["step"]
        assert r["fused_split"]["programs"] == ["backward_sync", "update"]
        torch.testing.assert_close(r["fused_split"]["grads"], r["eager"]["grads"])
        assert r["fused_acc"]["programs"] == ["backward", "step_acc"]
    # ...and still ended with the same parameters: gradients were reduced across ranks.
    for name in runs:
        for p0, p1 in zip(r0[name]["params"], r1[name]["params"]):
            torch.testing.assert_close(p0, p1)


# ---------------------------------------------------------------------------
# Whole steps: fuse_optimizer=True, manual optimization
# ---------------------------------------------------------------------------
class Scheduled(Tiny):
    """AdamW with a per-step StepLR: the learning rate halves every 3 optimizer steps."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Manual(Tiny):
    """Manual optimization: zero_grad, manual_backward, clip_gradients, step, and a scheduler stepped in the step."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        opt.step()
        self.lr_schedulers().step()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


class TwoOptimizers(Tiny):
    """Manual optimization with two optimizers (one per half of the network), GAN-style."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_a, opt_b = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        opt_a.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        loss_b = F.cross_entropy(self.net(x), y) * 0.5
        opt_b.zero_grad(set_to_none=False)
        self.manual_backward(loss_b)
        opt_b.step()
        self.log_dict({"loss_a": loss, "loss_b": loss_b})
        return loss

    def configure_optimizers(self):
        return (torch.optim.SGD(self.net[:2].parameters(), lr=0.1, momentum=0.9),
                torch.optim.Adam(self.net[2:].parameters(), lr=self.lr))


def assert_same_training_state(run_a, run_b, rtol=1e-5, atol=1e-6):
    """``assert_same`` plus ``.grad``, optimizer state, learning rates and the step counter."""
    assert_same(run_a, run_b, rtol=rtol, atol=atol)
    (ta, ma, _), (tb, mb, _) = run_a, run_b
    for (name, pa), (_, pb) in zip(ma.named_parameters(), mb.named_parameters()):
        assert (pa.grad is None) == (pb.grad is None), name
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, rtol=rtol, atol=atol, msg=lambda m: f"{name}.grad: {m}")
    assert len(ta.optimizers) == len(tb.optimizers)
    for oa, ob in zip(ta.optimizers, tb.optimizers):
        torch.testing.assert_close(oa.state_dict(), ob.state_dict(), rtol=rtol, atol=atol)
    assert ta.global_step == tb.global_step


@pytest.mark.parametrize("thin", [False, True])
def test_fuse_optimizer_matches_plain_trainer_with_scheduler(thin):
    eager = fit(module_cls=Scheduled)
    cb = ThunderCallback(thin=thin, fuse_optimizer=True)
    compiled = fit([cb], module_cls=Scheduled)
    assert_same_training_state(eager, compiled)
    assert compiled[0].optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 6)
    step = cb.steps["training_step"]
    assert list(step.programs) == ["step"]  # no accumulation: every batch steps
    stats = tt.compile_stats(cb.compiled())
    # The first step creates the AdamW state, the second program is the steady state; the scheduler never retraces.
    assert stats.calls == 20 and stats.entries == 2 and stats.thin_calls >= (17 if thin else 0), stats.retrace_reasons
    final = str(tt.last_traces(cb.compiled())[-1])
    assert "lr" in final.split("\n")[2] and "exp_avg" in final  # lr is an input, the AdamW update is in the program
    assert not tt.last_backward_traces(cb.compiled())  # the backward is part of the program too


@pytest.mark.parametrize("kernels", ["fused", "traced"])
def test_fuse_optimizer_with_either_optimizer_kernels(kernels):
    eager = fit(module_cls=Scheduled)
    cb = ThunderCallback(thin=True, fuse_optimizer=True, optimizer_kernels=kernels)
    compiled = fit([cb], module_cls=Scheduled)
    assert_same_training_state(eager, compiled)
    final = str(tt.last_traces(cb.compiled())[-1])
    assert ("ttex.adam_update_(" in final) == (kernels == "fused")  # one fused AdamW kernel, or AdamW's own ops
    assert cb.state_dict()["options"]["optimizer_kernels"] == kernels
    with pytest.raises(MisconfigurationException, match="optimizer_kernels"):
        ThunderCallback(optimizer_kernels="nvfuser")


class Warmup(Tiny):
    """The learning-rate warm-up of Lightning's ``optimizer_step`` documentation: lr changes after every step."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        for pg in optimizer.param_groups:
            pg["lr"] = self.lr * min(1.0, (self.trainer.global_step + 1) / 4)


@pytest.mark.parametrize("module_cls, algorithm", [(Tiny, "norm"), (Warmup, "value")])
def test_fuse_optimizer_accumulation_and_clipping(module_cls, algorithm):
    kwargs = dict(accumulate_grad_batches=3, gradient_clip_val=0.05, gradient_clip_algorithm=algorithm, max_steps=6,
                  module_cls=module_cls)
    eager = fit(**kwargs)
    cb = ThunderCallback(thin=True, fuse_optimizer=True)
    compiled = fit([cb], **kwargs)
    assert len(compiled[2]) == 18
    assert_same_training_state(eager, compiled)
    step = cb.steps["training_step"]
    # Chosen per batch by Lightning's loop: the window's first batch (fresh gradients), the next one (adds to them),
    # the last one (adds, clips, steps).
    assert step.program_calls == {"backward": 6, "backward_acc": 6, "step_acc": 6}
    assert tt.compile_stats(cb.compiled("training_step", "backward_acc")).thin_calls == 4
    assert "clamp" in str(tt.last_traces(cb.compiled("training_step", "step_acc"))[-1])


class HookLog(L.Callback):
    """Records the optimization hooks Lightning fires, with the gradient norm they see."""

    def __init__(self):
        self.calls = []

    def _norm(self, pl_module):
        return float(sum(p.grad.norm() ** 2 for p in pl_module.parameters() if p.grad is not None) ** 0.5)

    def on_before_zero_grad(self, trainer, pl_module, optimizer):
        self.calls.append(("on_before_zero_grad",))

    def on_after_backward(self, trainer, pl_module):
        self.calls.append(("on_after_backward", self._norm(pl_module)))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.calls.append(("on_before_optimizer_step", self._norm(pl_module), optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.calls.append(("on_train_batch_end", self._norm(pl_module)))


class CustomClipping(Scheduled):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.02, gradient_clip_algorithm="value")


@pytest.mark.parametrize("module_cls", [Scheduled, CustomClipping])
def test_fuse_optimizer_hooks_see_the_gradients(module_cls):
    """A hook between backward and update splits the stepping batch there; hooks fire in order with real gradients."""
    kwargs = dict(module_cls=module_cls, max_steps=6, accumulate_grad_batches=2)
    if module_cls is Scheduled:
        kwargs["gradient_clip_val"] = 0.1
    hooks_eager, hooks_thunder = HookLog(), HookLog()
    eager = fit([hooks_eager], **kwargs)
    cb = ThunderCallback(thin=True, fuse_optimizer=True)
    compiled = fit([cb, hooks_thunder], **kwargs)
    assert_same_training_state(eager, compiled)
    assert [c[0] for c in hooks_thunder.calls] == [c[0] for c in hooks_eager.calls]
    for a, b in zip(hooks_eager.calls, hooks_thunder.calls):
        assert a[1:] == pytest.approx(b[1:], rel=1e-5)
    step = cb.steps["training_step"]
    assert step.program_calls == {"backward": 6, "backward_acc": 6, "update": 6}
    update = str(tt.last_traces(cb.compiled("training_step", "update"))[-1])
    assert ("clamp" in update) == (module_cls is Scheduled)  # a custom configure_gradient_clipping runs eagerly


def test_fuse_optimizer_bf16_mixed():
    kwargs = dict(precision="bf16-mixed", max_steps=10, accumulate_grad_batches=2)
    eager = fit(**kwargs)
    cb = ThunderCallback(thin=True, fuse_optimizer=True)
    compiled = fit([cb], **kwargs)
    # The same casts as eager autocast, backward and AdamW outside autocast as Lightning runs them.
    assert_same_training_state(eager, compiled, rtol=2e-2, atol=2e-2)
    final = str(tt.last_traces(cb.compiled())[-1])
    assert "bf16" in final and '@torch.autocast("cpu", enabled=False)' in final


def test_fuse_optimizer_resume_from_checkpoint(tmp_path):
    trainer, _, _ = fit([], module_cls=Scheduled, max_steps=10)
    trainer.save_checkpoint(tmp_path / "eager.ckpt")
    trainer, _, _ = fit([ThunderCallback(thin=True, fuse_optimizer=True)], module_cls=Scheduled, max_steps=10)
    trainer.save_checkpoint(tmp_path / "thunder.ckpt")
    eager = fit([], module_cls=Scheduled, max_steps=20, ckpt_path=tmp_path / "eager.ckpt")
    cb = ThunderCallback(thin=True, fuse_optimizer=True)
    resumed = fit([cb], module_cls=Scheduled, max_steps=20, ckpt_path=tmp_path / "thunder.ckpt")
    assert len(resumed[2]) == 10
    assert_same_training_state(eager, resumed)
    # Bound after Lightning restored the AdamW state: one program, no retrace for the state.
    stats = tt.compile_stats(cb.compiled())
    assert stats.entries == 1 and stats.thin_calls >= 8
    assert cb.state_dict()["calls"] == {"training_step": 20}


def test_manual_optimization_matches_plain_trainer():
    # 100 samples: every epoch ends on a batch of 4, which thin mode runs on the full path.
    eager = fit(module_cls=Manual, n=100)
    cb = ThunderCallback(thin=True)
    compiled = fit([cb], module_cls=Manual, n=100)
    assert_same_training_state(eager, compiled)
    assert compiled[0].global_step == 20  # LightningOptimizer.step's counting, replayed after every call
    assert compiled[0].optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5 ** 6)  # sched.step() replayed
    step = cb.steps["training_step"]
    # The last batch of an epoch raises no ThinModeError since issue 26 (nothing for the callback to catch).
    assert list(step.programs) == ["manual"] and step.calls == 20 and step.thin_rebinds == 0
    stats = tt.compile_stats(cb.compiled())
    # First step (no optimizer state), steady state at 16 (freed once the batch size became symbolic), and the
    # symbolic program traced at the last batch of 4, which serves every size.
    assert stats.entries == 3 and len(cb.compiled()._lru) == 1 and stats.thin_calls > 10
    assert not stats.thin_invalidations
    final = str(tt.last_traces(cb.compiled())[-1])
    assert "exp_avg" in final and "linalg_vector_norm" in final  # AdamW and clip_gradients are in the program


def test_manual_optimization_two_optimizers_bf16_mixed():
    eager = fit(module_cls=TwoOptimizers, precision="bf16-mixed", max_steps=20)
    cb = ThunderCallback(thin=True)
    compiled = fit([cb], module_cls=TwoOptimizers, precision="bf16-mixed", max_steps=20)
    assert_same_training_state(eager, compiled, rtol=2e-2, atol=2e-2)
    assert len(compiled[2]) == 10 and compiled[0].global_step == 20  # two optimizer steps per batch
    assert "momentum_buffer" in str(tt.last_traces(cb.compiled())[-1])


# ---------------------------------------------------------------------------
# What is refused, and how
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["fsdp", "deepspeed"])
def test_sharded_strategies_rejected(strategy):
    from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy

    strategy_obj = FSDPStrategy() if strategy == "fsdp" else DeepSpeedStrategy.__new__(DeepSpeedStrategy)
    trainer = type("T", (), {"strategy": strategy_obj, "callbacks": [], "precision": "32-true"})()
    with pytest.raises(MisconfigurationException, match=f"does not support {type(strategy_obj).__name__} yet"):
        ThunderCallback().setup(trainer, Tiny(), "fit")


def test_manual_optimization_rejected_under_ddp():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = Manual()
    with pytest.raises(MisconfigurationException, match="manual optimization.* not supported with DDPStrategy.*all-reduce"):
        ThunderCallback().setup(trainer, model, "fit")
    assert "training_step" not in model.__dict__
    # The autograd path and fused automatic steps (the program averages the gradients) are available under DDP.
    ThunderCallback().setup(trainer, Tiny(), "fit")
    ThunderCallback(fuse_optimizer=True).setup(trainer, Tiny(), "fit")


def test_fuse_optimizer_refuses_on_before_backward():
    class LossProbe(L.Callback):
        def on_before_backward(self, trainer, pl_module, loss):
            pass

    with pytest.raises(MisconfigurationException, match=r"LossProbe.on_before_backward cannot fire at its place"):
        fit([ThunderCallback(fuse_optimizer=True), LossProbe()], max_steps=2)
    fit([ThunderCallback(), LossProbe()], max_steps=2)  # fine on the autograd path


def test_manual_optimization_refuses_hooks_inside_the_step():
    with pytest.raises(MisconfigurationException, match=r"HookLog.on_after_backward, HookLog.on_before_optimizer_step "
                                                        r"cannot fire at its place"):
        fit([ThunderCallback(), HookLog()], module_cls=Manual, max_steps=2)


class SchedulerFirst(Manual):
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        self.lr_schedulers().step()  # replayed after the program: the update would use the old lr
        opt.step()
        return loss


class SchedulerAttribute(Manual):
    def configure_optimizers(self):
        opt, schedulers = super().configure_optimizers()
        self.scheduler = schedulers[0]
        return opt, schedulers

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.scheduler.step()  # not through self.lr_schedulers(): would step only while tracing
        return loss


class Toggles(TwoOptimizers):
    def training_step(self, batch, batch_idx):
        opt_a, _ = self.optimizers()
        self.toggle_optimizer(opt_a)
        loss = F.cross_entropy(self.net(batch[0]), batch[1])
        self.manual_backward(loss)
        opt_a.step()
        self.untoggle_optimizer(opt_a)
        return loss


@pytest.mark.parametrize("module_cls, match", [
    (SchedulerFirst, r"calls sched.step\(\) before opt.step\(\)"),
    (SchedulerAttribute, r"steps a StepLR it did not get from self.lr_schedulers\(\)"),
    (Toggles, r"toggle_optimizer\(\)/untoggle_optimizer\(\).*set requires_grad"),
])
def test_manual_steps_a_compiled_step_cannot_replay_are_refused(module_cls, match):
    with pytest.raises(StepError, match=match):
        fit([ThunderCallback()], module_cls=module_cls, max_steps=2)


def test_optimizer_step_hooks_are_refused_in_whole_steps():
    class Hooked(Tiny):
        def configure_optimizers(self):
            opt = super().configure_optimizers()
            opt.register_step_post_hook(lambda optimizer, args, kwargs: None)
            return opt

    with pytest.raises(StepError, match="optimizer step hooks are registered.*AdamW.register_step_pre_hook/post_hook"):
        fit([ThunderCallback(fuse_optimizer=True)], module_cls=Hooked, max_steps=2)


def test_unsupported_precision_rejected():
    with pytest.raises(MisconfigurationException, match="supports precision '32-true' and 'bf16-mixed'.*'64-true'"):
        fit([ThunderCallback()], precision="64-true", max_steps=2)


def test_step_reading_batch_idx_is_refused():
    class UsesBatchIdx(Tiny):
        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            return loss * 2 if batch_idx % 2 else loss

    with pytest.raises(MisconfigurationException, match=r"reads batch_idx \(.*test_callback.py:\d+\)"):
        fit([ThunderCallback()], module_cls=UsesBatchIdx, max_steps=2)


def test_step_reading_global_step_in_a_helper_is_refused():
    class UsesGlobalStep(Tiny):
        def _scale(self):
            return 0.5 if self.global_step > 3 else 1.0

        def training_step(self, batch, _):
            return F.cross_entropy(self.net(batch[0]), batch[1]) * self._scale()

    with pytest.raises(MisconfigurationException, match=r"reads self.global_step \(.*_scale"):
        fit([ThunderCallback()], module_cls=UsesGlobalStep, max_steps=2)


def test_batch_idx_sentinel_fails_loudly():
    for use in (int, bool, lambda b: b % 2, lambda b: b < 3, lambda b: f"{b:d}"):
        with pytest.raises(StepError, match="batch_idx is not available"):
            use(BATCH_IDX)


def test_training_step_without_batch_idx():
    class NoBatchIdx(Tiny):
        def training_step(self, batch):
            return F.cross_entropy(self.net(batch[0]), batch[1])

    eager = fit(module_cls=NoBatchIdx, max_steps=5)
    compiled = fit([ThunderCallback(thin=True)], module_cls=NoBatchIdx, max_steps=5)
    assert_same(eager, compiled)


def test_logging_a_python_value_warns_and_replays_it():
    class LogsConstant(Tiny):
        def training_step(self, batch, batch_idx):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("answer", 42.0)
            return loss

    with pytest.warns(UserWarning, match="logs 'answer' with a Python value computed while tracing"):
        trainer, _, _ = fit([ThunderCallback()], module_cls=LogsConstant, max_steps=3)
    assert float(trainer.callback_metrics["answer"]) == 42.0


def test_retrace_storm_warns_with_reasons():
    class Counts(Tiny):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def training_step(self, batch, batch_idx):
            self.calls += 1  # a Python side effect: happens only while tracing, and changes a guarded attribute
            return F.cross_entropy(self.net(batch[0]), batch[1])

    with pytest.warns(UserWarning, match=r"training_step was traced 9 times.*args\[0\]\.calls\.value"):
        fit([ThunderCallback()], module_cls=Counts, max_steps=10)


def test_failed_fit_leaves_the_module_unpatched():
    class Boom(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                raise ValueError("boom")

    model = Tiny()
    with pytest.raises(ValueError, match="boom"):
        fit([ThunderCallback(thin=True), Boom()], model=model)
    assert "training_step" not in model.__dict__ and "log" not in model.__dict__


def test_importable_from_package_and_fit_twice():
    assert tt.ThunderCallback is ThunderCallback
    cb = ThunderCallback(thin=True)
    trainer, model, _ = fit([cb], max_steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit_loop.epoch_loop.max_steps = 8
        trainer.fit(model, data())
    assert trainer.global_step == 8 and tt.compile_stats(cb.compiled()).calls == 4  # a fresh compile for the new fit
