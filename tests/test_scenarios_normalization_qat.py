"""Normalisation variants and quantization-aware training in whole training steps, compared with eager after every
step in every mode (tests/_scenario_harness.py): BatchNorm with ``momentum=None`` (a cumulative average read from
``num_batches_tracked``), without running statistics, without affine; InstanceNorm with running statistics;
GroupNorm with LayerNorm without affine; ``torch.ao.quantization.FakeQuantize`` with a moving-average observer
updating its buffers in forward, and a model prepared with ``prepare_qat``.

FakeQuantize's ``torch.fake_quantize_per_tensor_affine`` has no meta kernel: it was refused as unsupported.
``torchlang/opaque_rules.py`` gives it (and the per-channel form) an output rule; torch computes it and its
straight-through gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.ao.quantization as q
import torch.nn as nn

from _scenario_harness import MODES, assert_matches_eager


def _train(make_model, x_shape, opt_cls=torch.optim.SGD, **opt_kw):
    def setup(wrap):
        m = make_model()
        cm = wrap(m)
        opt = opt_cls(m.parameters(), **(opt_kw or dict(lr=0.1, momentum=0.9)))

        def step(x):
            loss = cm(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return dict(step=step, calls=[(torch.randn(*x_shape) * (i + 1) + i,) for i in range(4)], modules=[m], opts=[opt])

    return setup


def _bn(**kw):
    return lambda: nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, **kw), nn.ReLU(), nn.Linear(6, 2))


class _FakeQuantNet(nn.Module):
    """Activations fake-quantized per tensor, weights per channel.  The per-channel observer grows its ``scale``
    buffer from one element to one per channel with ``resize_`` on its first call, refused inside a compiled
    function (only shrinking resizes are): a first eager forward makes it (``_warm``)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 8), nn.Linear(8, 2)
        self.fq = q.FakeQuantize(observer=q.MovingAverageMinMaxObserver, quant_min=0, quant_max=255)
        self.wq = q.FakeQuantize(observer=q.MovingAveragePerChannelMinMaxObserver, quant_min=-128, quant_max=127,
                                 dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0)

    def forward(self, x):
        return nn.functional.linear(self.fq(torch.relu(self.l1(x))), self.wq(self.l2.weight), self.l2.bias)


def _warm(make_model):
    def make():
        m = make_model()
        m(torch.randn(8, 4))
        return m

    return make


def _prepared_qat():
    m = nn.Sequential(q.QuantStub(), nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), q.DeQuantStub())
    m.qconfig = q.get_default_qat_qconfig("fbgemm")
    return q.prepare_qat(m.train(), inplace=True)


SCENARIOS = {
    "bn_cumulative": _train(_bn(momentum=None), (8, 4)),
    "bn_no_running_stats": _train(_bn(track_running_stats=False), (8, 4)),
    "bn_no_affine": _train(_bn(affine=False, momentum=0.3), (8, 4)),
    # no conv bias: InstanceNorm removes it, and Adam would turn its rounding-noise gradient into full steps
    "instance_norm_running": _train(lambda: nn.Sequential(
        nn.Conv1d(3, 4, 3, bias=False), nn.InstanceNorm1d(4, track_running_stats=True, affine=True), nn.ReLU()),
        (2, 3, 10), torch.optim.Adam, lr=0.01),
    "group_norm_layer_norm": _train(lambda: nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.LayerNorm(64, elementwise_affine=False),
        nn.Linear(64, 3)), (3, 2, 6, 6), torch.optim.AdamW, lr=0.01),
    "fake_quantize": _train(_warm(_FakeQuantNet), (8, 4)),
    "prepare_qat": _train(_prepared_qat, (8, 4)),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", SCENARIOS)
def test_normalization_and_qat_step_matches_eager(name, mode):
    assert_matches_eager(SCENARIOS[name], mode)
