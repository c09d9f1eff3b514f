"""Automatic dynamic shapes (symbolic_dims.py, the default ``dynamic=None``) and thin mode across sizes (issue 26)."""
import warnings

import pytest
import torch

import thunder_train as tt


def matsum(x, w):
    return (x @ w).sum(1)


def test_a_size_becomes_symbolic_when_it_changes_and_later_sizes_reuse_it():
    cf = tt.compile(matsum)
    w = torch.randn(4, 3)
    for B, T in [(2, 5), (2, 5), (2, 7), (2, 9), (3, 9), (4, 6), (5, 11)]:
        x = torch.randn(B, T, 4)
        torch.testing.assert_close(cf(x, w), matsum(x, w))
    st = tt.compile_stats(cf)
    # The first call specialises; the first new length makes dim 1 symbolic, the first new batch size dim 0 too.
    assert st.cache_misses == 3 and st.retrace_reasons == [
        "args[0].shape: (2, 5, 4) → (2, 7, 4); symbolic from now on: args[0] (x) dim 1",
        "args[0].shape: (2, -1, 4) → (3, -1, 4); symbolic from now on: args[0] (x) dim 0, args[0] (x) dim 1"]
    assert len(cf._lru) == 1  # the entries specialised on a size that became symbolic are gone
    src = tt.last_traces(cf)[-1].python_source()
    assert "x_size0, x_size1, 4" in src and "w: \"cpu f32[4, 3]\"" in src  # only the sizes that changed


def test_dynamic_false_specialises_and_dynamic_true_is_symbolic_from_the_first_call():
    w = torch.randn(4, 3)
    shapes = [(2, 5), (2, 7), (3, 7)]
    for dynamic, traces in ((False, 3), (True, 1)):
        cf = tt.compile(matsum, dynamic=dynamic)
        for B, T in shapes:
            x = torch.randn(B, T, 4)
            torch.testing.assert_close(cf(x, w), matsum(x, w))
        assert tt.compile_stats(cf).cache_misses == traces


def test_decisions_on_a_size_become_checks_and_thin_mode_switches_between_their_programs():
    def f(x, w):
        if x.shape[1] > 6:
            return (x @ w).sum(1) * 2
        return (x @ w).sum(1)

    cf = tt.compile(f, thin=True)
    w = torch.randn(4, 3)
    for T in [5, 5, 7, 8, 8, 3, 4, 9, 10, 2, 11, 3, 5, 12]:
        x = torch.randn(2, T, 4)
        torch.testing.assert_close(cf(x, w), f(x, w))
    st = tt.compile_stats(cf)
    # Traces: length 5; lengths > 6 (symbolic); lengths ≤ 6. Once both are bound, the per-call check switches.
    assert st.cache_misses == 3 and st.retrace_reasons[1] == "x.shape[1] > 6 was True, now False"
    assert st.thin_calls == 8 and st.thin_fallbacks == 2 and st.thin_binds == 3 and not st.thin_invalidations


def test_check_every_does_not_turn_a_new_size_into_an_error():
    cf = tt.compile(matsum, thin=True, check_every=2)
    w = torch.randn(4, 3)
    for T in (5, 5, 6, 7, 8, 9, 10, 11):
        x = torch.randn(2, T, 4)
        torch.testing.assert_close(cf(x, w), matsum(x, w))
    assert tt.compile_stats(cf).cache_misses == 2


def test_tracing_with_symbolic_sizes_failing_specialises_again():
    def f(x):
        y = x.clone()
        y.resize_(x.shape[0] * x.shape[1])  # in-place metadata change: refused with symbolic sizes
        return y * 2

    cf = tt.compile(f)
    for T in (4, 5, 6, 5):
        x = torch.randn(3, T)
        torch.testing.assert_close(cf(x), f(x))
    st = tt.compile_stats(cf)
    assert st.cache_misses == 3 and st.retrace_reasons[1].startswith("sizes specialised again: tracing with symbolic sizes failed (TracingError: Tensor.resize_")


def test_a_batch_inside_a_tuple_and_a_kwarg_dict():
    def f(batch, *, extra):
        x, y = batch
        return (x * y).sum() + extra["z"].sum()

    cf = tt.compile(f)
    for T in (3, 4, 5):
        args = ((torch.randn(2, T), torch.randn(2, T)),)
        kw = {"extra": {"z": torch.randn(T)}}
        torch.testing.assert_close(cf(*args, **kw), f(*args, **kw))
    st = tt.compile_stats(cf)
    assert st.cache_misses == 2 and st.retrace_reasons[0].endswith(
        "symbolic from now on: args[0] (batch)[0] dim 1, args[0] (batch)[1] dim 1, kwargs['extra']['z'] dim 0")


def test_dynamic_padding_thin_step_never_raises_and_stays_thin():
    torch.manual_seed(0)
    m1 = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))
    m2 = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))
    m2.load_state_dict(m1.state_dict())
    o1, o2 = torch.optim.AdamW(m1.parameters(), lr=1e-3), torch.optim.AdamW(m2.parameters(), lr=1e-3)

    def step(model, opt, ids):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cf = tt.compile(step, thin=True)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no cache-limit warning: the length became symbolic
        for i in range(40):
            ids = torch.randint(0, 20, (4, int(torch.randint(16, 97, (1,), generator=g))), generator=g)
            torch.testing.assert_close(cf(m2, o2, ids), step(m1, o1, ids))
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b, a)
    st = tt.compile_stats(cf)
    assert st.cache_misses <= 3 and st.thin_calls >= 35 and st.evictions >= 1


def test_stride_answers_follow_the_symbolic_sizes():
    # A trace with symbolic sizes once answered x.stride(0) with the traced length's stride: wrong for every other
    # length.  Dense inputs (contiguous, transposed) now get strides computed from their sizes; a slice's strides
    # are not a function of its sizes, so its trace refuses and the function specialises sizes again.
    def f(x):
        if x.dim() == 4:
            x = x[:, 0]  # constant sizes [2, 3, 4], stride 12 * T: not a function of its own sizes
            return x * x.stride(0)
        return x.sum(1) * x.stride(0) + x.stride(1)

    makers = {"contiguous": lambda T: torch.randn(2, T, 4),
              "transposed": lambda T: torch.randn(2, 4, T).transpose(1, 2),
              "slice": lambda T: torch.randn(2, T + 3, 4)[:, :T],
              "constant-size view": lambda T: torch.randn(2, T, 3, 4)}  # f reads the strides of its view x[:, 0]
    for name, make in makers.items():
        for dynamic in (None, True):
            cf = tt.compile(f, thin=True, dynamic=dynamic)
            if name in ("slice", "constant-size view") and dynamic:  # every size symbolic from the first call: nothing to fall back to
                with pytest.raises(tt.TracingError, match="not laid out densely"):
                    cf(make(5))
                continue
            for T in (5, 7, 9, 12, 7):
                x = make(T)
                torch.testing.assert_close(cf(x), f(x), msg=f"{name} dynamic={dynamic} T={T}")
            reasons = tt.compile_stats(cf).retrace_reasons
            assert (name in ("slice", "constant-size view")) == any("not laid out densely" in r for r in reasons), (name, reasons)


def test_inputs_sliced_from_a_padded_batch_do_not_retrace_per_length():
    # Dynamic padding with the causal shift done outside the step: ids[:, :-1] and ids[:, 1:] are slices whose
    # strides (T, 1) change with every length.  Their layout's form (a row with room after it) does not, so one
    # symbolic program serves every length; a contiguous batch has another form and gets its own program.
    torch.manual_seed(0)
    m1 = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))
    m2 = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))
    m2.load_state_dict(m1.state_dict())
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)

    def step(model, opt, inputs, targets):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cf = tt.compile(step, thin=True)
    g = torch.Generator().manual_seed(0)
    for i in range(16):
        ids = torch.randint(0, 20, (4, int(torch.randint(8, 40, (1,), generator=g))), generator=g)
        inputs, targets = ids[:, :-1], ids[:, 1:]
        if i in (9, 10, 13):
            inputs, targets = inputs.contiguous(), targets.contiguous()
        torch.testing.assert_close(cf(m2, o2, inputs, targets), step(m1, o1, inputs, targets))
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b, a)
    st = tt.compile_stats(cf)
    assert st.cache_misses == 3, st.retrace_reasons  # first length; lengths symbolic; the contiguous form
    assert "layout" in st.retrace_reasons[-1] and st.thin_calls >= 10


def test_a_reshape_whose_minus_one_is_a_constant_keeps_it_constant():
    # ``view(B, T, -1, 8)`` of a [B, T, 32] tensor has 4 heads whatever B and T are: (B*T*32) // (B*T*8) is 4.  A trace
    # with symbolic sizes once kept the heads symbolic, which stopped the attention rewrite (saved_statistics.py)
    # from taking the flash kernel pair: the backward ran the forward again.
    def step(x, w, mask):
        q, k, v = ((x @ w[i]).view(x.shape[0], x.shape[1], -1, 8).transpose(1, 2) for i in range(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        flat = out.reshape(x.shape[0], -1)  # (B*4*T*8) // B: symbolic (T), stays so
        loss = flat.sum()
        loss.backward()
        return loss.detach(), flat.shape[1]

    w1 = torch.randn(3, 16, 32, requires_grad=True)
    w2 = w1.detach().clone().requires_grad_()
    cf = tt.compile(step)  # w's sizes stay constants, B and T become symbolic at the second call
    for B, T in [(2, 5), (3, 7), (2, 9), (4, 6)]:
        x = torch.randn(B, T, 16)
        mask = torch.rand(B, 1, T, T) > 0.3
        mask[..., 0] = True
        (got, n), (want, m) = cf(x, w2, mask), step(x, w1, mask)
        assert n == m
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(w2.grad, w1.grad)
        w1.grad = w2.grad = None
    assert tt.compile_stats(cf).cache_misses == 2
    src = tt.last_traces(cf)[-1].python_source()
    assert "f32[x_size0, 4, x_size1, 8]" in src  # the heads: a constant
    assert "sdpa_flash_cpu_bool_masked" in src and "sdpa_flash_cpu_backward" in src


def test_a_quotient_of_different_sizes_stays_symbolic():
    def f(x, y):
        return x.reshape(-1, y.shape[1]).sum(0)  # (A*B) // C: no simplification, computed on every call

    cf = tt.compile(f, dynamic=True)
    for (a, b), c in [((4, 6), 3), ((6, 4), 8), ((5, 6), 10)]:
        x, y = torch.randn(a, b), torch.randn(2, c)
        torch.testing.assert_close(cf(x, y), f(x, y))
    assert tt.compile_stats(cf).cache_misses == 1
