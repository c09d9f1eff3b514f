"""A whole step under an outer torch.autocast: eager's weight-cast cache across calls (runtime/autocast_region.py).

Eager reuses a parameter's low-precision copy until the outermost autocast region exits, so a step that
updates parameters and is called twice in one region runs on stale weights from the second call.  The
compiled step matches eager where eager is well defined (one call per region, or cache_enabled=False) and
refuses, before touching anything, the second call inside one cached region.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import thunder_train as tt
from _thin_twin import train_step as step  # mse loss, backward, step, zero_grad


def _pair(opt_cls):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))
    me, mc = m, copy.deepcopy(m)
    return me, opt_cls(me.parameters(), lr=0.05), mc, opt_cls(mc.parameters(), lr=0.05)


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


def _assert_same(me, mc):
    for (n, p), q in zip(me.named_parameters(), mc.parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-4, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
def test_one_region_per_step_matches_eager(thin, opt_cls):
    me, oe, mc, oc = _pair(opt_cls)
    cs = tt.compile(step, thin=thin)
    for x, y in _batches(5):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            le = step(me, oe, x, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lc = cs(mc, oc, x, y)
        torch.testing.assert_close(lc, le)
    _assert_same(me, mc)
    assert cs.is_thin_bound == thin


@pytest.mark.parametrize("thin", [False, True])
def test_cache_disabled_region_matches_eager(thin):
    me, oe, mc, oc = _pair(torch.optim.AdamW)
    cs = tt.compile(step, thin=thin)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        for x, y in _batches(5):
            torch.testing.assert_close(cs(mc, oc, x, y), step(me, oe, x, y))
    _assert_same(me, mc)


@pytest.mark.parametrize("thin", [False, True])
def test_second_call_in_one_cached_region_is_refused_untouched(thin):
    _, _, mc, oc = _pair(torch.optim.AdamW)
    cs = tt.compile(step, thin=thin)
    batches = _batches(6)
    for x, y in batches[:3]:  # bind (thin) with one region per call
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cs(mc, oc, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cs(mc, oc, *batches[3])
        before = [p.detach().clone() for p in mc.parameters()], copy.deepcopy(oc.state_dict())
        with pytest.raises(tt.AutocastCacheError, match="second time inside one torch.autocast region"):
            cs(mc, oc, *batches[4])
    for p, q in zip(before[0], mc.parameters()):
        torch.testing.assert_close(q, p, atol=0, rtol=0)
    assert all(torch.equal(a, b) for i in before[1]["state"] for a, b in
               zip(before[1]["state"][i].values(), oc.state_dict()["state"][i].values()))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a new region works again
        cs(mc, oc, *batches[5])


def test_eager_really_reuses_stale_casts_in_one_region():
    """The premise: in eager, the second step inside one cached region sees the old weights."""
    me, oe, mc, oc = _pair(torch.optim.SGD)
    (x0, y0), (x1, y1) = _batches(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        step(me, oe, x0, y0)
        stale = step(me, oe, x1, y1)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        step(mc, oc, x0, y0)
        fresh = step(mc, oc, x1, y1)
    assert not torch.allclose(stale, fresh, atol=1e-3)


def test_forward_only_programs_are_not_probed():
    m = nn.Linear(4, 3)
    cm = tt.compile(m)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for x, _ in _batches(3):
            torch.testing.assert_close(cm(x), m(x))
