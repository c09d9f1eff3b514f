"""Concurrent first calls from several threads are correct (issue 25 item 6, "What must hold" 5).

Tracing patches process-wide names and registers a global optimizer step hook while it runs; one acquisition runs
at a time (``acquisition/acquire.py``: ``TRACING_LOCK``) and each patch acts only in the tracing thread, so other
threads' eager code (optimizer steps, random draws) runs unchanged meanwhile. Each case compares with eager.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler import context


def _in_threads(fns, names=None):
    """Run each callable in its own thread, all released at once; the exceptions they raised."""
    barrier = threading.Barrier(len(fns))
    errors = []

    def run(fn):
        try:
            barrier.wait()
            fn()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(fn,), name=None if names is None else names[i]) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    return errors


def _step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_models_through_one_compiled_step(thin):
    cf = tt.compile(_step, thin=thin)
    models = [_mlp(i) for i in range(3)]
    eager = [copy.deepcopy(m) for m in models]
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g)) for _ in models]
    got = {}

    def train(i):
        opt = torch.optim.Adam(models[i].parameters(), lr=1e-2)
        got[i] = torch.stack([cf(models[i], opt, *data[i]) for _ in range(3)])

    assert _in_threads([lambda i=i: train(i) for i in range(len(models))]) == []
    for i, m in enumerate(eager):
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        want = torch.stack([_step(m, opt, *data[i]) for _ in range(3)])
        torch.testing.assert_close(got[i], want)
        for a, b in zip(models[i].parameters(), m.parameters()):
            torch.testing.assert_close(a, b)
    # Nothing of the traces stayed installed: eager optimizer steps run as before.
    from torch.optim import optimizer as optim_mod
    assert not optim_mod._global_optimizer_pre_hooks and type(optim_mod._global_optimizer_pre_hooks) is type(
        optim_mod._global_optimizer_post_hooks)


def test_pure_function_with_different_shapes():
    def f(x):
        return torch.softmax(x @ x.T, dim=-1).sum(0) * 2 + x.mean()

    cf = tt.compile(f)
    xs = [torch.randn(n, 3) for n in (2, 3, 4, 5)]
    got = {}

    def run(i):
        got[i] = [cf(xs[i]) for _ in range(2)]

    assert _in_threads([lambda i=i: run(i) for i in range(len(xs))]) == []
    for i, x in enumerate(xs):
        for r in got[i]:
            torch.testing.assert_close(r, f(x))


class _Gate(nn.Module):
    """Identity; while the calling thread traces, it signals and waits: the trace's patches and hooks are installed
    then, and another thread runs eager code meanwhile."""

    def __init__(self):
        super().__init__()
        self.tracing, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        if context.tracer_state() is not None:
            self.tracing.set()
            self.release.wait(timeout=60)
        return x


# the optimizers whose eager implementations tracing routes to their fused kernels (torchlang/optim.py)
OPTIMIZERS = [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad]


def test_eager_code_in_another_thread_while_one_traces():
    """While a thread traces, another steps optimizers eagerly and draws random numbers: its results are eager's,
    and the trace is not refused for the generator the other thread moved."""
    gate = _Gate()
    model, other = nn.Sequential(gate, _mlp(0)), _mlp(1)
    reference, twin = nn.Sequential(_Gate(), copy.deepcopy(model[1])), copy.deepcopy(other)
    x, y = torch.randn(5, 6), torch.randn(5, 2)
    cf = tt.compile(_step)
    got = {}

    def compiled():
        got["compiled"] = cf(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)

    def eager():
        gate.tracing.wait(timeout=60)
        try:
            torch.manual_seed(3)
            got["eager"] = [_step(other, opt(other.parameters(), lr=0.1), x + torch.randn(5, 6), y) for opt in OPTIMIZERS]
        finally:
            gate.release.set()

    assert _in_threads([compiled, eager]) == []
    torch.manual_seed(3)
    want = [_step(twin, opt(twin.parameters(), lr=0.1), x + torch.randn(5, 6), y) for opt in OPTIMIZERS]
    torch.testing.assert_close(torch.stack(got["eager"]), torch.stack(want))
    torch.testing.assert_close(got["compiled"], _step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y))
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def _parametrized_linear(seed):
    from torch.nn.utils import parametrize

    torch.manual_seed(seed)
    lin = nn.Linear(4, 4)
    parametrize.register_parametrization(lin, "weight", nn.Tanh())
    return lin


@pytest.mark.parametrize("cached_inside", [False, True], ids=["plain", "cached_inside_the_step"])
def test_parametrize_cached_in_another_thread_while_one_traces(cached_inside):
    """Thread B enters ``parametrize.cached()`` while A traces a parametrized model and leaves it after A's trace ends:
    B's cache works throughout, torch's count ends at 0 and later eager reads see updated weights (before, setting the
    process-wide cache aside left the count at -1: cached forever, stale weights after an update)."""
    from torch.nn.utils import parametrize

    gate = _Gate()
    model, other = nn.Sequential(gate, _parametrized_linear(0)), _parametrized_linear(1)
    reference = copy.deepcopy(model[1])
    x = torch.randn(3, 4)

    def forward(x):
        if cached_inside:
            with parametrize.cached():
                return model(x) + model(x)
        return model(x) + model(x)

    cf, traced, got = tt.compile(forward), threading.Event(), {}

    def compiled():
        try:
            got["compiled"] = cf(x)
        finally:
            traced.set()

    def eager():
        gate.tracing.wait(timeout=60)
        try:
            with parametrize.cached():
                first = other.weight
                gate.release.set()
                traced.wait(timeout=60)
                got["cached"] = other.weight is first and type(first) is torch.Tensor
        finally:
            gate.release.set()

    assert _in_threads([compiled, eager]) == []
    torch.testing.assert_close(got["compiled"], reference(x) + reference(x))
    assert got["cached"] and parametrize._cache_enabled == 0 and parametrize._cache == {}
    with torch.no_grad():
        other.parametrizations.weight.original.add_(1.0)
    torch.testing.assert_close(other.weight, torch.tanh(other.parametrizations.weight.original))


_paused_fake_run = {}  # "tracing", "release": the events of the next fake run of tt_threads::doubled while tracing


@torch.library.custom_op("tt_threads::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_doubled.register_fake
def _(x):
    if context.tracer_state() is not None and _paused_fake_run:
        events = _paused_fake_run.copy()
        _paused_fake_run.clear()
        events["tracing"].set()
        events["release"].wait(timeout=60)
    return torch.empty_like(x)


def _draws_while_the_compiler_probes(draw, fn):
    """Thread A makes a first call of ``fn`` (opaque ``doubled``: the compiler asks torch's fake kernel about it);
    thread B draws once while A is inside that run and once after A returned. B's numbers and A's error, if any."""
    tracing, release = threading.Event(), threading.Event()
    _paused_fake_run.update(tracing=tracing, release=release)
    done, got = threading.Event(), {}

    def compiled():
        try:
            got["compiled"] = tt.compile(fn)(torch.ones(3))
        except tt.TracingError as e:
            got["error"] = e
        finally:
            release.set()
            done.set()

    def eager():
        try:
            tracing.wait(timeout=60)
            got["drawn"] = [draw()]
        finally:
            release.set()
        done.wait(timeout=60)
        got["drawn"].append(draw())

    try:
        assert _in_threads([compiled, eager]) == []
    finally:
        _paused_fake_run.clear()
    return got


def test_torch_draws_of_another_thread_are_not_undone_by_the_compilers_runs():
    """The compiler's meta and fake runs keep the generators by drawing nothing, never by putting a saved state back:
    that undid another thread's draws made meanwhile (B saw the same numbers again)."""
    torch.manual_seed(5)
    got = _draws_while_the_compiler_probes(lambda: torch.rand(4), lambda x: _doubled(x) + 1)
    torch.manual_seed(5)
    want = [torch.rand(4), torch.rand(4)]
    torch.testing.assert_close(got["compiled"], torch.full((3,), 3.0))
    torch.testing.assert_close(torch.stack(got["drawn"]), torch.stack(want))


def test_python_draws_of_another_thread_are_refused_and_not_undone():
    """Another thread drawing from Python's random while one traces is refused (a draw there may be the traced
    function's constant), and the generator is not put back (the trace notes the other thread's calls of the module's
    functions): B's later numbers continue its stream."""
    import random

    random.seed(3)
    got = _draws_while_the_compiler_probes(lambda: random.random(), lambda x: _doubled(x) + 1)
    random.seed(3)
    assert got["drawn"] == [random.random(), random.random()]
    assert "not put back" in str(got["error"])


def test_collective_meta_kernels_draw_from_a_private_generator_in_the_compilers_runs():
    """torch's meta kernels of collectives number their fake work with Python's random: inside the compiler's runs
    from a private generator, elsewhere (another thread meanwhile) from the global one as without thunder_train."""
    import random

    pytest.importorskip("torch.distributed._meta_registrations")
    from torch.distributed import _meta_registrations

    from thunder_train.compiler.generators_kept import generators_untouched

    random.seed(7)
    inside, release, got = threading.Event(), threading.Event(), {}

    def compiler_run():
        with generators_untouched():
            _meta_registrations.generate_unique_id()
            inside.set()
            release.wait(timeout=60)
            _meta_registrations.generate_unique_id()

    def eager():
        inside.wait(timeout=60)
        got["drawn"] = [random.random()]
        _meta_registrations.generate_unique_id()
        release.set()

    assert _in_threads([compiler_run, eager]) == []
    got["drawn"].append(random.random())
    random.seed(7)
    first = random.random()
    random.randint(1, 10**9)
    assert got["drawn"] == [first, random.random()]


def test_a_module_used_by_another_thread_while_one_traces_it_is_refused_clearly():
    """Tracing swaps a module's parameters for proxies in its own dicts: eager code in another thread using that
    module meanwhile raises, naming the tracing thread and what to do, and works again once the first call returned."""
    gate = _Gate()
    model = nn.Sequential(gate, _mlp(0))
    reference = copy.deepcopy(model[1])
    x = torch.randn(5, 6)
    cf, got = tt.compile(model), {}

    def compiled():
        got["compiled"] = cf(x)

    def eager():
        gate.tracing.wait(timeout=60)
        try:
            with pytest.raises(tt.TracingError, match="thread 'tracer' is tracing right now.*copy.deepcopy"):
                model[1](x)
            with pytest.raises(tt.TracingError, match="is tracing right now"):
                sum(p.numel() for p in model.parameters())
        finally:
            gate.release.set()

    assert _in_threads([compiled, eager], names=["tracer", "eager"]) == []
    torch.testing.assert_close(got["compiled"], reference(x))
    torch.testing.assert_close(model[1](x), reference(x))



def test_process_wide_state_another_thread_sets_while_one_traces_is_not_undone():
    """Another thread sets the default dtype (process-wide) while one traces: the trace is refused (the change may be
    the function's) without undoing it; before, the trace put the old dtype back over the other thread's change."""
    gate = _Gate()
    model = nn.Sequential(gate, _mlp(0))
    cf, got = tt.compile(model), {}

    def compiled():
        with pytest.raises(tt.TracingError, match="default_dtype.*not put back"):
            cf(torch.randn(5, 6))

    def eager():
        gate.tracing.wait(timeout=60)
        try:
            torch.set_default_dtype(torch.float64)
        finally:
            gate.release.set()

    try:
        assert _in_threads([compiled, eager]) == []
        assert torch.get_default_dtype() is torch.float64
    finally:
        torch.set_default_dtype(torch.float32)


def _conv_step(m, x):
    return F.max_pool2d(m(x).relu(), 2).flatten(1).log_softmax(-1).sum()


def test_concurrent_traces_answer_layout_questions_each_in_its_own_fake_mode():
    """Layout questions run the op on fake tensors (executors/layout_rules.py); a fake mode is not safe to use from
    two threads at once.  Shared, concurrent first calls failed some of them (torch logged "failed while
    attempting to run meta", and the op's layout came from plain meta tensors instead of the device's rule)."""
    import logging

    failures = []

    class Failures(logging.Handler):
        def emit(self, record):
            failures.append(record.getMessage()[:120])

    log = logging.getLogger("torch._subclasses.fake_tensor")
    handler = Failures()
    log.addHandler(handler)

    def run(k):
        for n in range(4):  # new sizes every call: no cached layout answers
            m = nn.Conv2d(3, 4 + k, 3).to(memory_format=torch.channels_last)
            x = torch.randn(2, 3, 8 + n, 8 + 2 * k).to(memory_format=torch.channels_last)
            torch.testing.assert_close(tt.compile(_conv_step)(m, x), _conv_step(m, x))

    try:
        assert _in_threads([lambda k=k: run(k) for k in range(3)]) == []
    finally:
        log.removeHandler(handler)
    assert failures == [], failures
