"""Sizes that recur get their own program (runtime/recurring_sizes.py): a symbolic entry whose calls come back to a
few sizes (bucketed lengths) runs, for each of them, a program traced with every size fixed (kept buffers for every
value, background fusion), chosen by a size check on the full path and the thin path alike.

Compared with eager (values, parameters) and, bitwise, with the same compiled function without programs per size
(the symbolic program runs every call); the peak memory with the sizes' kept buffers is at most the peak without.
"""
from __future__ import annotations

import copy

import pytest
import torch

import _models
import thunder_train as tt
from thunder_train.compiler.executors import buffers
from thunder_train.runtime import recurring_sizes


@pytest.fixture(autouse=True)
def _traces_pay_at_once(monkeypatch):
    """These steps take microseconds, a trace seconds: taken to save as much as they cost, a size's program is
    traced at its ``MIN_CALLS``-th call (the default rule waits until the calls of that size paid for it)."""
    monkeypatch.setattr(recurring_sizes, "ASSUMED_GAIN", 1e9)


def _mlp(width=64):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 5))


def _batch(B, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 16, generator=g), torch.randint(0, 5, (B,), generator=g)


def _run(batches, thin, cache_limit=8, base=None):
    """Eager, the default and the default without programs per size, side by side on ``batches``."""
    base = base or _mlp()
    models = [copy.deepcopy(base) for _ in range(3)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    cf = tt.compile(_models.train_step, thin=thin, cache_limit=cache_limit)
    ref = tt.compile(_models.train_step, thin=thin, cache_limit=cache_limit)
    ref._specialises_sizes = False
    for i, B in enumerate(batches):
        x, y = _batch(B, i)
        eager = _models.train_step(models[0], opts[0], x, y)
        got, want = cf(models[1], opts[1], x, y), ref(models[2], opts[2], x, y)
        torch.testing.assert_close(got, eager)
        assert torch.equal(got, want), (i, B)
        for a, b, c in zip(*(m.parameters() for m in models)):
            torch.testing.assert_close(b, a)
            assert torch.equal(b, c), (i, B)
    return cf, ref, models, opts


BUCKETS = [8, 12, 8, 12, 8, 12, 8, 12, 8, 12, 8, 12, 20, 8, 12]


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_recurring_sizes_get_their_own_program(thin):
    cf, ref, _, _ = _run(BUCKETS, thin)
    st = tt.compile_stats(cf)
    assert st.cache_misses == tt.compile_stats(ref).cache_misses == 2  # the first size, the symbolic program
    assert [line.split(":")[0] for line in st.recurring_sizes] == ["sizes (12, 16), (12,)", "sizes (8, 16), (8,)"], \
        st.recurring_sizes
    assert all("own program" in line for line in st.recurring_sizes)
    assert not tt.compile_stats(ref).recurring_sizes
    if thin:
        assert st.thin_calls >= 8
    [entry] = [e for probes in cf._cache.values() for p in probes for e in p.entries.values()]
    sizes = entry.slot.sizes
    assert len(sizes.programs) == 2
    # The programs for the sizes keep buffers for every value (the symbolic one only for values of constant size).
    assert all(buffers.kept_bytes(spec.slot.traces[-1]) > buffers.kept_bytes(entry.slot.traces[-1])
               for spec, _ in sizes.programs.values())


def test_sizes_are_specialised_when_their_calls_paid_for_the_trace(monkeypatch):
    """The default rule: with a realistic gain, steps of microseconds never pay for a trace of milliseconds or more.
    The dispatch's clock is a stub that says each call took 50 µs: a loaded machine's stalls cannot decide it."""
    import types

    ticks = iter(range(10**6))
    clock = types.SimpleNamespace(perf_counter=lambda: 50e-6 * next(ticks))  # consecutive reads: 50 µs apart
    monkeypatch.setattr(recurring_sizes, "time", clock)
    monkeypatch.setattr(recurring_sizes, "ASSUMED_GAIN", 0.1)
    cf, *_ = _run(BUCKETS, thin=True)
    assert tt.compile_stats(cf).recurring_sizes == []


def test_cache_limit_bounds_the_programs_per_size():
    """cache_limit=2: a third size that recurs releases the least recently used size's program (with its buffers)."""
    batches = [8, 12, 16] * 6
    cf, *_ = _run(batches, thin=False, cache_limit=2)
    st = tt.compile_stats(cf)
    [entry] = [e for probes in cf._cache.values() for p in probes for e in p.entries.values()]
    assert len(entry.slot.sizes.programs) <= 2
    assert any("released: more than 2 sizes" in line for line in st.recurring_sizes), st.recurring_sizes


def _slot_held(slot) -> int:
    """Bytes of the buffer sets ``slot``'s programs hold between calls."""
    total = 0
    for t in slot.traces + list(slot.backward_traces or ()):
        for b in t.bound_symbols:
            pool = getattr(b.sym, "pool", None)
            if pool is not None and getattr(b.sym, "take", False):
                total += pool.nbytes * len(pool._free)
    return total


def _held_bytes(cf) -> int:
    """Bytes of the buffer sets the function's programs hold between calls."""
    slots = []
    for probes in cf._cache.values():
        for p in probes:
            for e in p.entries.values():
                slots.append(e.slot)
                if e.slot.sizes is not None:
                    slots += [spec.slot for spec, _ in e.slot.sizes.programs.values()]
    return sum(_slot_held(slot) for slot in slots)


def test_peak_with_the_sizes_buffers_is_not_above_the_symbolic_programs():
    """Batches of 512 and 384 rows (MiBs of activations): what the program of a size holds between calls plus what
    its call allocates is at most what the symbolic program's call needs (within PEAK_SLACK), and running one size
    frees the other size's buffers, so their arenas never add up.  (Each size is called once before it is measured:
    the profiler does not see the free of a block allocated before it started, the other size's arena.)"""
    from _peak import peak_call_bytes

    base = torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 5))
    cf, ref, models, opts = _run([512, 384] * 6, thin=True, base=base)
    assert len(tt.compile_stats(cf).recurring_sizes) == 2
    [entry] = [e for probes in cf._cache.values() for p in probes for e in p.entries.values()]
    programs = {k[0][0][0]: spec.slot for k, (spec, _) in entry.slot.sizes.programs.items()}
    for B in (384, 512, 384):
        x, y = _batch(B, 99)
        peaks = []
        for f, m, o in ((cf, models[1], opts[1]), (ref, models[2], opts[2])):
            f(m, o, x, y)
            held = _held_bytes(f)
            peaks.append(held + peak_call_bytes(lambda: f(m, o, x, y)))
        assert 0 < peaks[0] <= peaks[1] + buffers.PEAK_SLACK, (B, peaks)
        # Held now: this size's program's buffers only.
        other = programs[896 - B]
        assert _held_bytes(cf) == _slot_held(programs[B]) > 0
        assert _slot_held(other) == _slot_held(entry.slot) == 0


def test_a_program_no_faster_than_the_symbolic_one_is_released():
    """The first size's program is timed against the symbolic program at that size: measured slower, it is released
    and the entry traces no more programs per size; the calls stay right (here the timing is made up)."""
    cf, ref, models, opts = _run(BUCKETS[:10], thin=False)
    [entry] = [e for probes in cf._cache.values() for p in probes for e in p.entries.values()]
    sizes = entry.slot.sizes
    [k] = list(sizes.trial)  # the first program is on trial
    released = next(spec for spec, _ in sizes.programs.values())
    for _ in range(recurring_sizes.JUDGE_CALLS + 1):
        if k in sizes.trial:
            sizes._judge(k, sizes.trial[k], 1e6)
    assert k not in sizes.programs and not sizes.enabled and released.slot.released
    assert "released; no more programs per size" in tt.compile_stats(cf).recurring_sizes[-1]
    for i, B in enumerate([8, 12] * 5):  # no more programs per size; values as before
        x, y = _batch(B, 100 + i)
        assert torch.equal(cf(models[1], opts[1], x, y), ref(models[2], opts[2], x, y))
    assert not sizes.programs or k not in sizes.programs
    assert len([line for line in tt.compile_stats(cf).recurring_sizes if "own program" in line]) == 1


class _Gated(torch.nn.Module):
    """A gate of elementwise ops between two linears: one fusible region in the forward, one in the backward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 5)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(h) * torch.sigmoid(h) + h / 3.0)


def _fused_kernels(slot) -> list:
    """The Inductor kernels ``slot``'s programs call (what the process-wide kernel cache holds while they live)."""
    from thunder_train.compiler.executors.regions import FusionSymbol

    last = [slot.traces[-1]] + ([slot.backward_traces[-1]] if slot.backward_traces else [])
    return list({id(b.sym.owner): b.sym.owner for t in last for b in t.bound_symbols if isinstance(b.sym, FusionSymbol)}.values())


def test_each_sizes_program_is_fused_in_the_background_and_eviction_frees_its_kernels(monkeypatch):
    """The default fusion (background, Inductor on the CPU): each recurring size's program builds its fused program,
    which runs for that size's calls (sizes alternating) with eager's values within the fused tolerances; a third
    size beyond ``cache_limit=2`` releases the least recently used size's program, and its kernels leave the
    process-wide kernel cache with it.  Each size's program calls four kernels: two regions, and the cross-entropy and
    its gradient compiled whole (executors/small_cross_entropy.py)."""
    import gc
    import weakref

    from _inductor import cxx_available
    from _steps import assert_same_state
    from thunder_train.compiler.executors import inductor_fusion

    if not cxx_available():
        pytest.skip("Inductor's CPU backend needs a C++ compiler (none found)")
    monkeypatch.delenv("THUNDER_TRAIN_FUSION", raising=False)  # tt.compile's default: background fusion
    monkeypatch.setattr(recurring_sizes, "JUDGE_CALLS", 10**9)  # no timing on a loaded machine decides what stays
    torch.manual_seed(0)
    base = _Gated()
    models = [copy.deepcopy(base) for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    cf = tt.compile(_models.train_step, thin=True, cache_limit=2)
    ref = tt.compile(_models.train_step, thin=True, fusion=None)  # the symbolic program runs every call
    ref._specialises_sizes = False
    calls = iter(range(10**6))

    def step(B):
        x, y = _batch(B, next(calls))
        eager = _models.train_step(models[0], opts[0], x, y)
        got, want = cf(models[1], opts[1], x, y), ref(models[2], opts[2], x, y)
        torch.testing.assert_close(got, eager, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        assert_same_state((models[0], opts[0]), (models[1], opts[1]))

    for B in [8, 12] * 6:
        step(B)
    [entry] = [e for probes in cf._cache.values() for p in probes for e in p.entries.values()]
    sizes = entry.slot.sizes
    programs = {k[0][0][0]: spec.slot for k, (spec, _) in sizes.programs.items()}
    assert sorted(programs) == [8, 12] and not any(_fused_kernels(s) for s in programs.values())
    assert not _fused_kernels(entry.slot)  # symbolic sizes: never fused
    assert tt.wait_for_fusion(cf, timeout=600)
    st = tt.compile_stats(cf)
    assert st.fusion_switches == 2, st.fusion_notes
    kernels = {B: _fused_kernels(s) for B, s in programs.items()}
    assert all(len(k) == 4 for k in kernels.values()), {B: [str(t) for t in s.traces[-1:]] for B, s in programs.items()}
    for B in [8, 12, 12, 8, 8, 12]:  # each size runs its own fused program
        step(B)
    assert [spec.slot for spec, _ in sizes.programs.values()] == [programs[8], programs[12]]  # least recent first
    alive = {B: [weakref.ref(k) for k in ks] for B, ks in kernels.items()}
    del kernels
    for _ in range(5):  # a third size recurs: the program of 8 goes, with its kernels
        step(16)
    assert programs[8].released and not programs[12].released
    assert any("released: more than 2 sizes" in line for line in st.recurring_sizes), st.recurring_sizes
    del programs  # the test's own reference to the released program
    gc.collect()
    assert all(r() is None for r in alive[8])
    assert all(r() is not None and r() in inductor_fusion._kernels.values() for r in alive[12])
    for B in [12, 8, 16]:
        step(B)
