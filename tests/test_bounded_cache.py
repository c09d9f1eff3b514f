"""The bounded cache (bounded_cache.py): at most ``cache_limit`` programs per leaf structure, LRU eviction."""
import gc
import weakref

import pytest
import torch
from torch import nn

import thunder_train as tt
from _steps import squared_output_step
from thunder_train.compiler.executors.buffers import BufferPool, _PoolLine


def pools(entry):
    return [b.sym.pool for t in entry.traces for b in t.bound_symbols if isinstance(b.sym, _PoolLine) and b.sym.take]


step = squared_output_step


def test_specialising_on_every_length_keeps_at_most_the_limit_and_warns_once():
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
    m2 = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 4))
    m2.load_state_dict(m1.state_dict())
    o1, o2 = torch.optim.SGD(m1.parameters(), lr=0.1), torch.optim.SGD(m2.parameters(), lr=0.1)
    cf = tt.compile(step, dynamic=False, cache_limit=3, fusion=None)
    first = None
    with pytest.warns(UserWarning, match=r"more than 3 programs.*What varies.*args\[2\]\.shape.*cache_limit") as rec:
        for T in (5, 6, 7, 8, 9, 10, 5):
            x = torch.randn(T, 4)
            torch.testing.assert_close(cf(m2, o2, x), step(m1, o1, x))
            if first is None:
                first = cf._last
                first_pools = pools(first)
    assert len([w for w in rec if "programs" in str(w.message)]) == 1  # warned once
    st = tt.compile_stats(cf)
    # 7 traces (5 came back after it was evicted), at most 3 kept; the evicted programs' kept buffers are freed.
    assert st.cache_misses == 7 and st.evictions == 4 and len(cf._lru) == 3
    assert sum(len(probe.entries) for probes in cf._cache.values() for probe in probes) == 3
    assert first_pools and all(p.released for p in first_pools)
    ref = weakref.ref(first)
    del first
    gc.collect()
    assert ref() is None  # nothing keeps the evicted entry (its programs) alive
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(b, a)


def test_the_limit_is_per_leaf_structure_and_none_is_unbounded():
    cf = tt.compile(lambda x, n: x * n, dynamic=False, cache_limit=None)
    for n in range(12):
        cf(torch.ones(2), n)
    assert len(cf._lru) == 12 and tt.compile_stats(cf).evictions == 0
    with pytest.raises(ValueError, match="cache_limit"):
        tt.compile(lambda x: x, cache_limit=0)
    with pytest.raises(ValueError, match="dynamic"):
        tt.compile(lambda x: x, dynamic="auto")


def test_default_limit_is_documented_and_a_thin_binding_of_an_evicted_entry_goes():
    assert tt.compile.__kwdefaults__["cache_limit"] == 8
    cf = tt.compile(lambda x, n: x * n, thin=True, cache_limit=2)
    x = torch.ones(3)
    for n in (1, 1, 2, 2, 3, 3, 1, 1):
        torch.testing.assert_close(cf(x, n), x * n)
    st = tt.compile_stats(cf)
    # 1 and 2 bound; 3 evicts 1 (and its binding); 1 again is traced anew and binds again.
    assert st.cache_misses == 4 and st.evictions == 2 and len(cf._bindings) <= 2 and cf.is_thin_bound
