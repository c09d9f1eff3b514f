"""A torch call repeated on the same arguments while its first result is alive reads that result
(executors/duplicates.py): values bitwise eager's, returned and written results never shared."""
from __future__ import annotations

import torch

import thunder_train as tt


def lines(cf, call) -> int:
    return sum(1 for line in tt.last_traces(cf)[-1].python_source().splitlines()
               if call in line and not line.lstrip().startswith("#"))


def test_a_repeated_product_is_computed_once():
    def fn(a, b):
        x = a * b
        y = torch.sin(a)
        z = a * b
        return (x + y) * z + x

    cf = tt.compile(fn, fusion=None)
    a, b = torch.randn(4, 5), torch.randn(4, 5)
    for _ in range(2):
        assert torch.equal(cf(a, b), fn(a, b))
    assert lines(cf, "mul(") == 2  # a * b once, and (x + y) * z (torch.mul or Tensor.mul: kept buffers choose)


def test_returned_and_written_results_are_not_shared():
    def fn(a, b):
        x = a * b
        z = a * b
        w = a * b
        w.add_(1)
        return x, z, w + x

    cf = tt.compile(fn, fusion=None)
    a, b = torch.randn(3), torch.randn(3)
    got, want = cf(a, b), fn(a, b)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[0].data_ptr() != got[1].data_ptr()
    got[0].add_(5)
    assert torch.equal(got[1], a * b)


def test_random_calls_are_not_merged():
    def fn(x):
        return x + torch.rand(3), x + torch.rand(3)

    cf = tt.compile(fn, fusion=None)
    torch.manual_seed(0)
    got = cf(torch.zeros(3))
    torch.manual_seed(0)
    want = fn(torch.zeros(3))
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert not torch.equal(got[0], got[1])


def test_rms_norm_backward_in_a_training_step_equals_the_program_without_merging(monkeypatch):
    """HF-style RMSNorm (pow, mean, rsqrt): its backward multiplies the same tensors twice; the whole thin step with
    the product computed once equals the same program computing it twice, bitwise, and eager's step closely."""
    import copy

    from thunder_train.compiler import pipeline

    class RMSNorm(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(d))

        def forward(self, x):
            v = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(v + 1e-6))

    def step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), RMSNorm(8), torch.nn.Linear(8, 4))
    runs = {}
    for merge in (True, False, "eager"):
        if merge is False:
            monkeypatch.setattr(pipeline, "merge_duplicates", lambda trc: trc)
        m = copy.deepcopy(model)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        fn = step if merge == "eager" else tt.compile(step, thin=True, fusion=None)
        g = torch.Generator().manual_seed(1)
        losses = [fn(m, opt, torch.randn(6, 8, generator=g)) for _ in range(4)]
        src = "" if merge == "eager" else tt.last_traces(fn)[-1].python_source()
        runs[merge] = (m, losses, src.count("torch.mul("))
    (m1, l1, n1), (m2, l2, n2), (m3, l3, _) = runs[True], runs[False], runs["eager"]
    assert n1 < n2
    assert all(torch.equal(a, b) for a, b in zip(l1, l2))
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    for a, b in zip(l1, l3):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_repeated_view_is_made_once_also_where_the_first_is_dead():
    """Two backward rules reshape the same value: the second reads the first view even though that one is dead by
    then (a view is its argument's memory: holding it longer holds nothing more).  A reshape that copies is not
    merged once its first result is dead (that would hold a copy longer).  Values bitwise eager's."""
    def fn(h, w):
        a = h.reshape(12, 4) @ w  # first view, dead after this line
        s = a.sin()
        b = h.reshape(12, 4) * s.sum()  # the same view again
        t = h.transpose(1, 2)
        c = t.reshape(12, 4).exp()  # copies (t is not contiguous)
        d = t.reshape(12, 4).cos()  # the same copy again, after c's copy is dead
        return b, c, d

    h, w = torch.randn(3, 4, 4), torch.randn(4, 4)
    cf = tt.compile(fn, fusion=None, keep_buffers=False)
    for _ in range(2):
        assert all(torch.equal(g, e) for g, e in zip(cf(h, w), fn(h, w)))
    src = tt.last_traces(cf)[-1].python_source()
    views = [line for line in src.splitlines() if "reshape(" in line and not line.lstrip().startswith("#")]
    assert len(views) == 3, src  # h's view once, t's copy twice
