"""One object per cache entry owns what a call runs (runtime/slot.py): the full path and the thin binding follow
``Slot.swap`` together, and nothing else changes what runs."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import thunder_train as tt
from thunder_train.runtime.slot import Slot


def _product(program, wrap=lambda p: p, build_steady=None):
    return types.SimpleNamespace(program=program, wrap=wrap, traces=(), backward_traces=None, build_steady=build_steady)


class _Job:
    """Stands in for background.FusionJob: counts calls, and ends the count when told."""

    def __init__(self):
        self.calls = 0

    def counted(self, computation, stop):
        def run(*args):
            self.calls += 1
            return computation(*args)

        run.stop = stop
        return run


def test_run_and_thin_follow_every_change_together():
    def double(x):
        return 2 * x

    def triple(x):
        return 3 * x

    def plus_one(computation):
        return lambda x: computation(x) + 1

    job = _Job()
    slot = Slot(_product(double, wrap=plus_one), job)
    assert slot.run(1) == 3 and slot.thin is slot.run and job.calls == 1  # counted until told otherwise
    slot.bind_thin(lambda computation: (lambda x: computation(x) * 10))
    assert slot.thin(1) == 30 and job.calls == 2  # thin mode's argument order wraps what runs, counted too
    slot.stop_counting()
    assert slot.run(1) == 3 and slot.thin(1) == 30 and job.calls == 2
    slot.swap(triple, [], None)
    assert slot.program is triple and slot.run(1) == 4 and slot.thin(1) == 40
    slot.unbind_thin()
    assert slot.thin is slot.run and slot.thin(1) == 4


def test_a_swap_ends_the_count_and_calls_back_once():
    swaps = []
    job = _Job()
    slot = Slot(_product(lambda x: x), job, on_swap=lambda: swaps.append(1))
    slot.swap(lambda x: -x, [], None)
    assert slot.run(2) == -2 and job.calls == 0 and swaps == [1]


def test_unbinding_releases_the_cuda_graph():
    released = []

    class Graphed:
        def __call__(self, x):
            return ("graph", x)

        def release(self):
            released.append(True)

    slot = Slot(_product(lambda x: ("program", x)))
    slot.bind_thin(None, Graphed())
    assert slot.thin(1) == ("graph", 1) and slot.run(1) == ("program", 1)  # the graph runs on the thin path only
    slot.unbind_thin()
    assert released == [True] and slot.graphed is None and slot.thin(1) == ("program", 1)


def _steady_slot(built):
    """A slot whose steady program is built at the entry's second call (``built`` counts the builds)."""
    def build_steady():
        built.append(1)
        return (lambda x: ("steady", x)), [types.SimpleNamespace(bound_symbols=[])]

    return Slot(_product(lambda x: ("first", x), build_steady=build_steady))


def test_the_steady_program_is_built_at_the_second_call_and_runs_on_both_paths():
    built = []
    slot = _steady_slot(built)
    assert slot.run(1) == ("first", 1) and built == []  # an entry run once never pays for it
    slot.settle()  # thin mode binds at the entry's second call, the steady program built first (binding.py)
    slot.bind_thin()
    assert built == [1] and slot.thin(2) == ("steady", 2) and slot.run(3) == ("steady", 3) and built == [1]


def test_the_second_full_call_builds_the_steady_program_once():
    built = []
    slot = _steady_slot(built)
    assert slot.run(1) == ("first", 1) and slot.run(2) == ("steady", 2) and slot.run(3) == ("steady", 3)
    assert built == [1]


def test_a_fused_program_installed_before_the_second_call_drops_the_steady_build():
    built = []
    slot = Slot(_product(lambda x: ("first", x), build_steady=lambda: built.append(1)), _Job())
    slot.run(1)
    slot.swap(lambda x: ("fused", x), [], None)
    assert slot.run(2) == ("fused", 2) and slot.thin(2) == ("fused", 2) and built == []


def _step(model, opt, x, y):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("thin", [False, True])
def test_a_swapped_program_runs_on_both_paths_and_matches_eager(thin):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    ref.load_state_dict(model.state_dict())
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    step = tt.compile(_step, thin=thin, fusion=None)
    calls = []
    for i in range(6):
        x, y = torch.randn(3, 4), torch.randn(3, 4)
        torch.testing.assert_close(step(model, opt, x, y), _step(ref, ref_opt, x, y))
        if i == 2:
            slot = step._last.slot
            program = slot.program

            def counting(*inputs):  # computes what the program computes: the swap must change no result
                calls.append(1)
                return program(*inputs)

            slot.swap(counting, slot.traces, None)
            assert step.is_thin_bound == thin
    assert len(calls) == 3, "the calls after the swap did not run the swapped program"
    assert tt.compile_stats(step).thin_calls == (4 if thin else 0)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
