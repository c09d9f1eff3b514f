"""Scenarios tried in session 19 that matched eager, kept as cheap guards (full and thin, compared with eager
after every step by tests/_scenario_harness.py): a spatial transformer (``affine_grid``, ``grid_sample``,
``interpolate``), ``unfold``/``fold``/``pixel_shuffle`` with reflect and circular padding, an ``stft`` front
end, message passing with ``index_add_``/``scatter_reduce`` over a new number of edges each step,
``EmbeddingBag`` with offsets and per-sample weights, timm-style EMA with ``torch._foreach_lerp_``, adversarial
weight perturbation through ``p.data`` (perturb, backward, restore), BERT-style masking with ``bernoulli``, a
Gaussian-process marginal likelihood (``cholesky``, ``cholesky_solve``, ``slogdet``, nuclear norm), an
orthogonal parametrization, and hyper-parameters changed between steps in a config dict, a dataclass and a
class attribute.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _scenario_harness import assert_matches_eager


def _mlp():
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3))


def _batches(n=3, b=8):
    return [(torch.randn(b, 4), torch.randint(0, 3, (b,))) for _ in range(n)]


def _train(make, calls, body=None, opt=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
           between=None, more=()):
    def setup(wrap):
        m = make()
        cm = wrap(m)
        o = opt(m)
        others = [mk() for mk in more]

        def default(*args):
            *inputs, y = args
            loss = F.cross_entropy(cm(*inputs), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss

        step = default if body is None else (lambda *a: body(cm, m, o, others, *a))
        s = dict(step=step, calls=calls(), modules=[m, *others], opts=[o])
        if between is not None:
            hook = between(m)
            s["between"] = hook
        return s

    return setup


class STN(nn.Module):
    def __init__(self):
        super().__init__()
        self.loc = nn.Linear(64, 6)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 16, 3)
        with torch.no_grad():
            self.loc.weight.mul_(0.01)
            self.loc.bias.copy_(torch.tensor([1.0, 0, 0, 0, 1, 0]))

    def forward(self, x):
        theta = self.loc(x.flatten(1)).view(-1, 2, 3)
        x = F.grid_sample(x, F.affine_grid(theta, x.size(), align_corners=False), align_corners=False)
        x = F.interpolate(F.relu(self.conv(x)), scale_factor=0.5, mode="bilinear", align_corners=False)
        return self.head(x.flatten(1))


class Patches(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.conv = nn.Conv2d(2, 4, 1)
        self.head = nn.Linear(256, 3)

    def forward(self, x):
        p = self.lin(F.unfold(x, 2, stride=2).transpose(1, 2)).transpose(1, 2)
        y = F.fold(p, (8, 8), 2, stride=2)
        y = F.pixel_shuffle(self.conv(F.pad(y, (1, 1, 1, 1), mode="reflect"))[..., :8, :8], 2)
        y = F.pad(y, (1, 1, 1, 1), mode="circular")[..., 1:-1, 1:-1]
        return self.head(F.pixel_unshuffle(y, 2).flatten(1))


class Audio(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("window", torch.hann_window(32))
        self.head = nn.Linear(17, 3)

    def forward(self, wave):
        spec = torch.stft(wave, 32, hop_length=8, window=self.window, return_complex=True).abs().pow(2)
        return self.head(torch.log1p(spec).mean(-1))


class GNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x, edges):
        h = self.l1(x)
        src, dst = edges
        msg = h[src]
        agg = torch.zeros_like(h).index_add_(0, dst, msg)
        deg = torch.zeros(x.shape[0]).scatter_add_(0, dst, torch.ones_like(dst, dtype=torch.float)).clamp(min=1)
        mx = torch.zeros_like(h).scatter_reduce(0, dst[:, None].expand_as(msg), msg, reduce="amax", include_self=False)
        return self.l2(torch.relu(agg / deg[:, None] + mx))


class Bags(nn.Module):
    def __init__(self):
        super().__init__()
        self.sum = nn.EmbeddingBag(20, 4, mode="sum")
        self.mean = nn.EmbeddingBag(20, 4, mode="mean")
        self.head = nn.Linear(8, 3)

    def forward(self, ids, offsets, weights):
        return self.head(torch.cat([self.sum(ids, offsets, per_sample_weights=weights), self.mean(ids, offsets)], 1))


class GP(nn.Module):
    def __init__(self):
        super().__init__()
        self.log_ls = nn.Parameter(torch.zeros(()))
        self.log_noise = nn.Parameter(torch.tensor(-1.0))
        self.feat = nn.Linear(4, 2)

    def forward(self, x, y):
        z = self.feat(x)
        k = torch.exp(-0.5 * torch.cdist(z, z).pow(2) / self.log_ls.exp() ** 2)
        k = k + (self.log_noise.exp() + 1e-3) * torch.eye(x.shape[0])
        chol = torch.linalg.cholesky(k)
        alpha = torch.cholesky_solve(y[:, None], chol)
        return (0.5 * (y[:, None] * alpha).sum() + chol.diagonal().log().sum()
                + 0.01 * torch.linalg.slogdet(k)[1] + 0.001 * torch.linalg.matrix_norm(k, "nuc"))


def _gp(cm, m, o, others, x, y):
    loss = cm(x, y)
    loss.backward()
    o.step()
    o.zero_grad()
    return loss


def _orthogonal():
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 3))
    nn.utils.parametrizations.orthogonal(m[0], orthogonal_map="householder")
    return m


def _ema(cm, m, o, others, x, y):
    (ema,) = others
    loss = F.cross_entropy(cm(x), y)
    loss.backward()
    o.step()
    o.zero_grad()
    with torch.no_grad():
        torch._foreach_lerp_(list(ema.parameters()), list(m.parameters()), 0.1)
    return loss, torch.stack(torch._foreach_norm([p.detach() for p in m.parameters()]))


def _awp(cm, m, o, others, x, y):
    loss = F.cross_entropy(cm(x), y)
    loss.backward()
    backup = {}
    for n, p in m.named_parameters():
        if p.ndim > 1:
            backup[n] = p.data.clone()
            p.data.add_(0.01 * p.grad / (p.grad.norm() + 1e-12) * p.data.norm())
    o.zero_grad()
    adv = F.cross_entropy(cm(x), y)
    adv.backward()
    for n, p in m.named_parameters():
        if n in backup:
            p.data.copy_(backup[n])
    o.step()
    o.zero_grad()
    return loss, adv


class MLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 8, padding_idx=0)
        self.head = nn.Linear(8, 12)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def _mlm(cm, m, o, others, ids):
    labels = ids.clone()
    mask = torch.bernoulli(torch.full(ids.shape, 0.3)).bool() & (ids != 0)
    labels[~mask] = -100
    ids = ids.clone()
    ids[mask] = 11
    loss = F.cross_entropy(cm(ids).reshape(-1, 12), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    o.step()
    o.zero_grad()
    return loss


class Tempered(nn.Module):
    temperature = 1.0

    def __init__(self):
        super().__init__()
        type(self).temperature = 1.0
        self.lin = nn.Linear(4, 3)
        self.cfg = {"alpha": 1.0, "reg": False}
        self.extra = _Extra()

    def forward(self, x):
        out = self.lin(x) / type(self).temperature * self.cfg["alpha"]
        return out + self.extra.beta * self.lin.weight.sum() if self.cfg["reg"] else out


@dataclasses.dataclass
class _Extra:
    beta: float = 0.0


def _hyper_between(m):
    def between(i):
        Tempered.temperature = 0.5 + i
        m.cfg["alpha"] = 0.5 + 0.25 * i
        m.cfg["reg"] = i % 2 == 0
        m.extra.beta = 0.01 * (i + 1)

    return between


SCENARIOS = {
    "spatial_transformer": _train(STN, lambda: [(torch.randn(2, 1, 8, 8), torch.randint(0, 3, (2,))) for _ in range(3)]),
    "unfold_fold_pixel_shuffle_pad": _train(Patches, lambda: [(torch.randn(2, 1, 8, 8), torch.randint(0, 3, (2,)))
                                                              for _ in range(3)]),
    "stft_front_end": _train(Audio, lambda: [(torch.randn(2, 256), torch.randint(0, 3, (2,))) for _ in range(3)]),
    "message_passing_new_edge_count": _train(GNN, lambda: [(torch.randn(6, 4), torch.randint(0, 6, (2, e)),
                                                            torch.randint(0, 3, (6,))) for e in (10, 13, 10, 7)]),
    "embedding_bag_offsets": _train(Bags, lambda: [(torch.randint(0, 20, (9,)), torch.tensor([0, 3, 4, 7]), torch.rand(9),
                                                    torch.randint(0, 3, (4,))) for _ in range(3)]),
    "gp_marginal_likelihood": _train(GP, lambda: [(torch.randn(6, 4), torch.randn(6)) for _ in range(3)], body=_gp),
    "orthogonal_parametrization": _train(_orthogonal, _batches),
    "foreach_ema": _train(_mlp, _batches, body=_ema, more=(_mlp,),
                          opt=lambda m: torch.optim.AdamW(m.parameters(), lr=0.01)),
    "adversarial_weight_perturbation": _train(_mlp, _batches, body=_awp),
    "bert_masking": _train(MLM, lambda: [(torch.randint(0, 11, (4, 6)),) for _ in range(3)], body=_mlm),
    "hyper_parameters_between_steps": _train(Tempered, lambda: _batches(4), between=_hyper_between),
}


@pytest.mark.parametrize("mode", ["full", "thin"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_layer_or_habit_matches_eager(name, mode):
    assert_matches_eager(SCENARIOS[name], mode)
