"""Run torch.nn modules from PyTorch's ModuleInfo database through compiled training and compare with eager
(used by test_moduleinfo.py and ``benchmarks/moduleinfo_report.py``; docs/opinfo.md).

For each ModuleInfo in ``torch.testing._internal.common_modules.module_db`` (CPU, float32), in train and eval mode,
on its first sample inputs (``ModuleInput``: constructor arguments and forward arguments), two identical copies
of the module (built from one seed) run the same training step twice, once eagerly and once compiled:

* **step**: ``tt.compile(step, thin=True)`` of a whole step: ``zero_grad``, forward, a loss (the sum of the float
  outputs times fixed random weights), ``backward``, ``SGD.step``;
* **module**: ``tt.compile(module)``; the loss, backward and SGD step run eagerly around it.

After each call the outputs, the forward inputs and their gradients, the parameters and their gradients, the
buffers (BatchNorm's running statistics) and the global random state are compared with eager's, with the OpInfo
checks' tolerances (``opinfo_check``); bitwise equality is recorded too.  A case ends as

* ``match``: eager's result (``bitwise`` when every value is bit-for-bit eager's);
* ``refusal``: the compiled call raised one of thunder_train's errors or ``NotImplementedError`` and left the
  module and the inputs as they were;
* ``crash``: it raised anything else (an unclear error), or a refusal that changed the module or the inputs;
* ``wrong``: it ran and gave something different from eager (silently wrong).

A sample eager itself rejects is skipped.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import opinfo_check as oc  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train.compiler import errors as tt_errors  # noqa: E402

SAMPLES = 2  # sample inputs per ModuleInfo and mode (the first ones)
CALLS = 2  # training steps per case: the first traces, the second runs the bound (thin) program
VARIANTS = ("step", "module")
LR = 0.1
BITWISE = dict(rtol=0, atol=0)
CLEAR_ERRORS = (NotImplementedError,) + tuple(
    v for v in vars(tt_errors).values() if isinstance(v, type) and issubclass(v, Exception))


@dataclasses.dataclass
class Case:
    module: str  # ModuleInfo name, e.g. "nn.Linear"
    training: bool
    index: int  # sample index
    variant: str  # "step" | "module"
    status: str = "skip"  # "match" | "refusal" | "crash" | "wrong" | "skip"
    bitwise: bool = False
    reason: str = ""
    desc: str = ""
    seconds: float = 0.0

    @property
    def id(self) -> str:
        return case_id(self.module, self.training, self.index, self.variant)


def case_id(module: str, training: bool, index: int, variant: str) -> str:
    return f"{module}-{'train' if training else 'eval'}-{index}-{variant}"


def all_moduleinfos() -> list:
    from torch.testing._internal.common_modules import module_db

    return list(module_db)


def samples(info, training: bool, n: int = None) -> list:
    """The first ``n`` ModuleInputs, made from a fixed seed (``make_tensor`` draws from the global generator)."""
    n = SAMPLES if n is None else n
    with torch.random.fork_rng():
        torch.manual_seed(0)
        try:
            made = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                           training=training)
        except Exception:  # noqa: BLE001 - the ModuleInfo cannot make inputs here
            return []
        return [m for m in list(made)[:n] if m.forward_input is not None]


def _weighted_loss(out, weights):
    parts = [o for o in tree_flatten(out)[0] if _differentiable(o)]
    if not parts:
        return None
    return sum((p * w).sum() for p, w in zip(parts, weights))


def _differentiable(o):
    return isinstance(o, torch.Tensor) and o.requires_grad and o.dtype.is_floating_point


def _detached(out):
    return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _make_step(module, opt, weights):
    def step(args, kwargs):
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        out = module(*args, **kwargs)
        loss = _weighted_loss(out, weights)
        if loss is not None:
            loss.backward()
        if opt is not None:
            opt.step()
        return _detached(out)

    return step


class _Replica:
    """One copy of the module with its optimizer and its own copy of the forward inputs."""

    def __init__(self, module, args, kwargs, weights, variant):
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(params, lr=LR) if params else None
        self.args, self.kwargs = oc._clone((args, kwargs))
        if variant == "step":
            self.call = tt.compile(_make_step(module, self.opt, weights), thin=True)
        elif variant == "module":
            self.call = _make_step(tt.compile(module), self.opt, weights)
        else:
            self.call = _make_step(module, self.opt, weights)

    def run(self, seed):
        for t in tree_flatten((self.args, self.kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.is_leaf:
                t.grad = None
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.call(self.args, self.kwargs)
        return out, torch.get_rng_state()

    def state(self):
        """Everything the step may change: inputs and their gradients, parameters, gradients, buffers."""
        inputs = [t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, torch.Tensor)]
        return {
            "inputs": [t.detach() for t in inputs],
            "input grads": [t.grad for t in inputs],
            "parameters": {n: _value(p) for n, p in self.module.named_parameters()},
            "parameter grads": {n: p.grad for n, p in self.module.named_parameters()},
            "buffers": {n: _value(b) for n, b in self.module.named_buffers()},
        }


def _value(t):
    # A lazy module's parameters are uninitialised until its first forward (torch refuses to read them).
    return "uninitialised" if isinstance(t, torch.nn.parameter.UninitializedTensorMixin) else t.detach()


def _snapshot(state):
    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, state)


def _build(info, sample, training, seed=0):
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Float tensors the constructor takes follow the sweep's dtype (FractionalMaxPool's ``_random_samples``
        # are float64 in the ModuleInfo whatever the dtype, and its forward requires its input's dtype).
        cargs, ckwargs = tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                                  (sample.constructor_input.args, sample.constructor_input.kwargs))
        m = info.module_cls(*cargs, **ckwargs)
    m.train(training)
    return m


def _compare(actual, expected, tol):
    """Raises oc._Mismatch naming what differs; returns whether it is bit-for-bit eager's."""
    for what, a, kind in actual:
        oc._compare_structure(a, expected[what], what, True, tol[kind])
    try:
        for what, a, kind in actual:
            oc._compare_structure(a, expected[what], what, True, BITWISE)
        return True
    except oc._Mismatch:
        return False


def _results(out, rng, state):
    """(what, value, tolerance kind) rows of one call's results."""
    rows = [("output", out, "fwd"), ("random state", rng, "exact")]
    for k, v in state.items():
        rows.append((k, v, "grad" if "grad" in k else "fwd"))
    return rows


TOL = {"fwd": oc.FWD_TOL, "grad": oc.GRAD_TOL, "exact": BITWISE}


def run_case(info, training, index, variant, sample=None) -> Case:
    c = Case(info.name, training, index, variant)
    if sample is None:
        got = samples(info, training, index + 1)
        if len(got) <= index:
            return c
        sample = got[index]
    c.desc = sample.desc
    t0 = time.perf_counter()
    try:
        _run(c, info, training, sample, variant)
    finally:
        c.seconds = time.perf_counter() - t0
    return c


def _run(c, info, training, sample, variant):
    args, kwargs = sample.forward_input.args, sample.forward_input.kwargs
    try:
        base = _build(info, sample, training)
        probe = _Replica(copy.deepcopy(base), args, kwargs, None, "eager")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = probe.module(*probe.args, **probe.kwargs)
        g = torch.Generator().manual_seed(7)
        weights = [torch.rand(o.shape, generator=g) for o in tree_flatten(out)[0] if _differentiable(o)]
        eager = _Replica(copy.deepcopy(base), args, kwargs, weights, "eager")
        expected = [eager.run(seed) + (_snapshot(eager.state()),) for seed in range(CALLS)]
    except Exception:  # noqa: BLE001 - eager rejects the sample
        return
    compiled = _Replica(copy.deepcopy(base), args, kwargs, weights, variant)
    c.bitwise = True
    for call, (e_out, e_rng, e_state) in enumerate(expected):
        before = _snapshot(compiled.state())
        try:
            out, rng = compiled.run(call)
        except Exception as e:  # noqa: BLE001 - the compiled call's error is the result
            c.bitwise = False
            c.status = "refusal" if isinstance(e, CLEAR_ERRORS) else "crash"
            c.reason = f"call {call}: {oc._short(e)}"
            try:
                _compare(_results(None, None, compiled.state())[2:], before, TOL)
            except oc._Mismatch as m:
                c.status, c.reason = "crash", f"{c.reason}; the failed call changed {m}"
            return
        expected_rows = {"output": e_out, "random state": e_rng, **e_state}
        try:
            c.bitwise &= _compare(_results(out, rng, compiled.state()), expected_rows, TOL)
        except oc._Mismatch as m:
            c.status, c.reason, c.bitwise = "wrong", f"call {call}: {m}", False
            return
    c.status = "match"


def run_all(infos, training_modes=(True, False), n=None, variants=VARIANTS, progress=None) -> list:
    cases = []
    for info in infos:
        for training in training_modes:
            for i, s in enumerate(samples(info, training, n)):
                for v in variants:
                    r = run_case(info, training, i, v, s)
                    cases.append(r)
                    if progress:
                        progress(r)
    return cases


def table_line(c: Case) -> str:
    flag = " bitwise" if c.bitwise else ""
    return f"{c.status:8}{flag:8} {c.id:55} {c.seconds:6.1f}s  {c.desc[:40]!r:42} {c.reason}"
