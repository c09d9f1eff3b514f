"""A 0-d parameter trained by a fused optimizer: a CLIP/SigLIP learnable temperature, clamped after the step.

Torch's fused Adam, AdamW and Adagrad kernels write each parameter in its own dtype.  The traced form of the update
(``torchlang/optim.py``) computed the bias corrections as 0-d double tensors, which promote a 0-d float32
parameter to double: for the rest of the step the parameter read as float64.  ``logit_scale.data.clamp_(0, 4.6)``
then raised a misleading "in-place update of a float64 view of a float32 tensor", and ``torch.zeros(2,
dtype=w.dtype)`` was silently a double tensor.  The update now ends in the parameter's dtype.
Also here: ``torch.nn.utils.prune`` is refused naming pruning and its supported replacement (a parametrization
holding the mask), which is compared with eager.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune

import thunder_train as tt
from _scenario_harness import MODES, assert_matches_eager


class _Clip(nn.Module):
    def __init__(self):
        super().__init__()
        self.img, self.txt = nn.Linear(6, 8), nn.Linear(5, 8)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, a, b):
        return self.logit_scale.exp() * F.normalize(self.img(a), dim=-1) @ F.normalize(self.txt(b), dim=-1).t()


def _clip(opt_cls, clamp):
    def setup(wrap):
        m = _Clip()
        cm = wrap(m)
        opt = opt_cls(m.parameters(), lr=0.5)

        def step(a, b):
            logits = cm(a, b)
            labels = torch.arange(a.shape[0])
            loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
            loss.backward()
            opt.step()
            opt.zero_grad()
            if clamp == "data":
                m.logit_scale.data.clamp_(0, 2.7)
            elif clamp == "no_grad":
                with torch.no_grad():
                    m.logit_scale.clamp_(0, 2.7)
            return loss, torch.zeros(2, dtype=m.logit_scale.dtype) + m.logit_scale.detach()

        return dict(step=step, calls=[(torch.randn(6, 6), torch.randn(6, 5)) for _ in range(4)], modules=[m], opts=[opt])

    return setup


OPTS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}


@pytest.mark.parametrize("mode", [m for m in MODES if m != "model"])
@pytest.mark.parametrize("clamp", ["data", "no_grad", None])
@pytest.mark.parametrize("opt", OPTS)
def test_clip_temperature_clamped_after_a_fused_update_matches_eager(opt, clamp, mode):
    assert_matches_eager(_clip(OPTS[opt], clamp), mode)


@pytest.mark.parametrize("opt", ["adam", "adagrad"])
def test_zero_dim_parameter_keeps_its_dtype_after_the_update(opt):
    w = nn.Parameter(torch.tensor(2.6))
    v = nn.Parameter(torch.ones(3))
    o = OPTS[opt]([w, v], lr=0.5)

    def step(x):
        loss = (x * w + v).sum()
        loss.backward()
        o.step()
        o.zero_grad()
        return torch.zeros(2, dtype=w.dtype) + w, w.dtype

    out, dtype = tt.compile(step, fusion=None)(torch.ones(3))
    assert dtype == out.dtype == torch.float32


def _squared_output_step(cm, opt):
    """One training step of ``cm`` on the mean squared output."""
    def step(x):
        loss = cm(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


def _pruned_setup(wrap):
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    prune.l1_unstructured(m[0], "weight", amount=0.3)
    cm = wrap(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    return m, opt, _squared_output_step(cm, opt)


@pytest.mark.parametrize("mode", MODES)
def test_torch_prune_is_refused_naming_the_parametrization_replacement(mode):
    torch.manual_seed(0)
    wrap = tt.compile if mode == "model" else (lambda m: m)
    m, opt, step = _pruned_setup(wrap)
    f = step if mode == "model" else tt.compile(step, **MODES[mode])
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(tt.TracingError, match="torch.nn.utils.prune") as info:
        f(torch.randn(8, 4))
    assert "register_parametrization" in str(info.value) and "register_buffer" not in str(info.value)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert isinstance(m[0].weight, torch.Tensor) and not opt.state
    m(torch.randn(8, 4)).sum().backward()  # eager still trains the same objects
    opt.step()
    assert not torch.equal(m[0].weight_orig, before["0.weight_orig"])


class _Mask(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.register_buffer("mask", mask)

    def forward(self, w):
        return w * self.mask


def _mask_pruning(wrap):
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    parametrize.register_parametrization(m[0], "weight", _Mask(torch.ones(8, 4)))
    cm = wrap(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    step = _squared_output_step(cm, opt)

    def between(i):  # iterative magnitude pruning: the mask grows between steps
        with torch.no_grad():
            w = m[0].parametrizations.weight.original
            threshold = w.abs().flatten().kthvalue(8 * (i + 1)).values
            m[0].parametrizations.weight[0].mask.copy_((w.abs() > threshold).float())

    return dict(step=step, calls=[(torch.randn(8, 4),) for _ in range(4)], modules=[m], opts=[opt], between=between,
                extra=lambda: (m[0].weight == 0).sum())


@pytest.mark.parametrize("mode", MODES)
def test_pruning_mask_as_a_parametrization_matches_eager(mode):
    assert_matches_eager(_mask_pruning, mode)
