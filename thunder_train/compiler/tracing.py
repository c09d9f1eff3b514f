"""Acquisition: run the user's function on proxies and record a trace.

Inputs are walked once; every tensor becomes a ``TensorProxy`` and every
leaf gets an access path (its provenance) such as ``args[0].fc1.weight``.
Module parameters and buffers are swapped for proxies while tracing and
restored afterwards, also when tracing raises.  A ``TorchFunctionMode``
routes every torch call — including factories with no tensor argument — to
the torch language; calls on proxies outside the mode arrive through
``TensorProxy.__torch_function__`` and take the same route.
"""
from __future__ import annotations

import collections
import dataclasses
import inspect
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import context, proxies
from .opaque import call_opaque
from .proxies import CheckedFloat, SizeProxy, TensorProxy
from .torchlang import registry
from .torchlang.optim import optimizers_while_tracing
from .distributed import check_finished as check_ddp_finished, ddp_while_tracing
from .custom_function import custom_functions_while_tracing
from .python_effects import needs_grad, only_walked_optimizers_step, refuse_backward_hooks
from .errors import TracingError
from .trace import Trace
from .functional import Buffers, fresh_results
from .traced_autograd import GradState
from .epilogue import finish


# ---------------------------------------------------------------------------
# Provenance: how the prologue finds a leaf again
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Step:
    kind: str  # "arg", "kwarg", "item", "key", "attr", "param", "buffer", "module"
    key: Any

    def expr(self, base: str) -> str:
        k = self.kind
        if k == "arg":
            return f"args[{self.key}]"
        if k == "kwarg":
            return f"kwargs[{self.key!r}]"
        if k in ("item", "key"):
            return f"{base}[{self.key!r}]"
        if k == "attr":
            return f"{base}.{self.key}"
        if k == "param":
            return f"{base}._parameters[{self.key!r}]"
        if k == "buffer":
            return f"{base}._buffers[{self.key!r}]"
        if k == "module":
            return f"{base}._modules[{self.key!r}]"
        if k == "const":
            return base  # the prologue refers to the captured tensor directly
        if k == "optstate":
            g, i = self.key
            return f"{base}.state.get({base}.param_groups[{g}]['params'][{i}])"
        raise AssertionError(k)

    def pretty(self, base: str) -> str:
        """The path as a user reads it: ``args[0].fc1.weight`` rather than ``._modules[...]``."""
        if self.kind in ("attr", "param", "buffer", "module"):
            return f"{base}.{self.key}"
        if self.kind == "const":
            return f"<tensor captured from the function's closure #{self.key}>"
        if self.kind == "optstate":
            return f"{base}.state[{base}.param_groups[{self.key[0]}]['params'][{self.key[1]}]]"
        return self.expr(base)


def path_expr(path) -> str:
    s = ""
    for st in path:
        s = st.expr(s)
    return s


def path_str(path) -> str:
    s = ""
    for st in path:
        s = st.pretty(s)
    return s


def _name_from_path(path, fallback="t") -> str:
    parts = []
    for st in path:
        if st.kind in ("arg", "kwarg"):
            parts.append(st.key if isinstance(st.key, str) else f"arg{st.key}")
        elif st.kind in ("attr", "param", "buffer", "module", "key"):
            parts.append(str(st.key))
        elif st.kind == "item":
            parts.append(str(st.key))
        elif st.kind == "optstate":
            parts.append(f"state{st.key[0]}_{st.key[1]}")
    name = "_".join(parts).replace(".", "_")
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    if not name or name[0].isdigit():
        name = f"{fallback}_{name}"
    return name


@dataclasses.dataclass
class Leaf:
    """An input the computation reads, or a Python value it specialised on."""

    path: tuple
    kind: str  # "tensor", "number", "absent", "constant", "object", "module", "optimizer", "seq", "dict", "dataclass"
    value: Any
    proxy: Any = None
    alias_of: "Leaf | None" = None
    # For modules: Python state read before tracing ran (guards/prologue.py guards it).
    snapshot: Any = None

    @property
    def where(self) -> str:
        return path_str(self.path)


SCALAR_TYPES = (int, float, bool, complex, str, type(None), torch.dtype, torch.device, type(Ellipsis))


def module_snapshot(m) -> dict:
    """A module's Python state before tracing runs it: flags, structure, public scalar attributes."""
    d = m.__dict__
    attrs = tuple((k, v) for k, v in d.items() if k[:1] != "_" and k != "training" and type(v) in SCALAR_TYPES)
    return {"training": m.training, "dict_len": len(d), "attrs": attrs}


class InputWalker:
    """Turns real inputs into proxied inputs, recording a Leaf for every part."""

    def __init__(self, trc: Trace, arg_names):
        self.trc = trc
        self.arg_names = arg_names
        self.leaves: list[Leaf] = []
        self.by_id: dict[int, Leaf] = {}  # id(real object) -> its leaf
        self.leaf_of_proxy: dict[int, Leaf] = {}  # id(tensor proxy) -> the (non-alias) leaf it stands for
        self.swapped: list = []  # (dict, key, original value) to restore
        self.optimizers: list = []  # TracedOptimizer
        self.dynamic = False  # symbolic sizes for per-call inputs (tt.compile(..., dynamic=True))
        self.static_depth = 0  # > 0 while walking a module or optimizer: their tensors keep constant shapes
        self.floats_are_inputs = False  # while walking an optimizer's hyper-parameters
        self.symbolic_inputs: list = []  # input proxies with symbolic sizes

    def walk_args(self, args, kwargs):
        pargs = tuple(self.walk(a, (Step("arg", i),), self.arg_names[i] if i < len(self.arg_names) else None) for i, a in enumerate(args))
        pkwargs = {k: self.walk(v, (Step("kwarg", k),), k) for k, v in kwargs.items()}
        return pargs, pkwargs

    def tensor(self, t, path, hint):
        prev = self.by_id.get(id(t))
        if prev is not None:
            # The same tensor reached twice (tied weights, one tensor passed twice): one proxy.
            self.leaves.append(Leaf(path, "tensor", t, prev.proxy, alias_of=prev))
            return prev.proxy
        name = self.trc.unique_name(hint or _name_from_path(path))
        shape = tuple(t.shape)
        symbolic = self.dynamic and not self.static_depth and path[0].kind != "const"
        if symbolic:
            # dynamic=True: sizes ≥ 2 of per-call inputs are symbols (0 and 1 stay constants:
            # they decide broadcasting and emptiness).
            shape = tuple(SizeProxy(f"{name}_size{i}", value=s) if s >= 2 else s for i, s in enumerate(shape))
        p = TensorProxy(name, shape=shape, dtype=t.dtype, device=t.device, requires_grad=t.requires_grad)
        if symbolic:
            for i, s in enumerate(p._tt_shape):
                if type(s) is SizeProxy:
                    s.origin = ("dim", p, i)
            self.symbolic_inputs.append(p)
        leaf = Leaf(path, "tensor", t, p)
        self.leaves.append(leaf)
        self.by_id[id(t)] = leaf
        self.leaf_of_proxy[id(p)] = leaf
        return p

    def captured_tensor(self, t):
        """A real tensor the function reads without receiving it (a closure or global).

        It becomes an input of the computation that the prologue passes by
        reference, so in-place changes to it are seen and nothing is baked in.
        """
        prev = self.by_id.get(id(t))
        if prev is not None:
            return prev.proxy
        n = sum(1 for leaf in self.leaves if leaf.path and leaf.path[0].kind == "const")
        return self.tensor(t, (Step("const", n),), f"captured{n}")

    def walk(self, x, path, hint=None):
        t = type(x)
        if isinstance(x, torch.Tensor):
            if type(x) is TensorProxy:
                raise TracingError(f"{path_str(path)} is already a proxy: nested compiled functions are not supported")
            return self.tensor(x, path, hint)
        if t is float and self.floats_are_inputs:
            return self.number(x, path, _name_from_path(path))
        if t in SCALAR_TYPES:
            self.leaves.append(Leaf(path, "constant", x))
            return x
        if t is tuple or t is list or (isinstance(x, tuple) and hasattr(x, "_fields")):
            self.leaves.append(Leaf(path, "seq", x))
            items = [self.walk(v, path + (Step("item", i),)) for i, v in enumerate(x)]
            return t(*items) if hasattr(x, "_fields") else t(items)
        if t is dict:
            self.leaves.append(Leaf(path, "dict", x))
            return {k: self.walk(v, path + (Step("key", k),)) for k, v in x.items()}
        if isinstance(x, torch.nn.Module):
            self.module(x, path)
            return x
        if isinstance(x, torch.optim.Optimizer):
            self.optimizer(x, path)
            return x
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            self.leaves.append(Leaf(path, "dataclass", x))
            fields = {f.name: self.walk(getattr(x, f.name), path + (Step("attr", f.name),)) for f in dataclasses.fields(x)}
            new = object.__new__(t)
            new.__dict__.update(getattr(x, "__dict__", {}))
            for k, v in fields.items():
                object.__setattr__(new, k, v)
            return new
        # Anything else (configs, callables, ...) is specialised on by identity.
        self.leaves.append(Leaf(path, "object", x))
        return x

    def module(self, m, path):
        self.static_depth += 1
        try:
            self._module(m, path)
        finally:
            self.static_depth -= 1

    def _module(self, m, path):
        if id(m) in self.by_id:
            return
        leaf = Leaf(path, "module", m, snapshot=module_snapshot(m))
        self.by_id[id(m)] = leaf
        self.leaves.append(leaf)
        for name, p in list(m._parameters.items()):
            if p is not None:
                proxy = self.tensor(p, path + (Step("param", name),), None)
                self.swapped.append((m._parameters, name, p))
                m._parameters[name] = proxy
        for name, b in list(m._buffers.items()):
            if b is not None:
                proxy = self.tensor(b, path + (Step("buffer", name),), None)
                self.swapped.append((m._buffers, name, b))
                m._buffers[name] = proxy
        for name, sub in m._modules.items():
            if sub is not None:
                self._module(sub, path + (Step("module", name),))

    # ---- optimizers ----
    def optimizer(self, opt, path):
        self.static_depth += 1
        try:
            self._optimizer(opt, path)
        finally:
            self.static_depth -= 1

    def _optimizer(self, opt, path):
        """Walk ``param_groups`` and ``state``; while tracing the optimizer sees proxies.

        ``lr`` becomes a runtime number (an LR scheduler never causes a retrace);
        other hyper-parameters are constants the trace specialises on.  The
        traced ``param_groups``/``state`` replace the real ones until tracing ends;
        ``TracedOptimizer`` compares them afterwards to find new state entries.
        """
        if id(opt) in self.by_id:
            return
        leaf = Leaf(path, "optimizer", opt)
        self.by_id[id(opt)] = leaf
        self.leaves.append(leaf)
        gpath = path + (Step("attr", "param_groups"),)
        self.leaves.append(Leaf(gpath, "seq", opt.param_groups))
        groups = []
        for gi, group in enumerate(opt.param_groups):
            p = gpath + (Step("item", gi),)
            self.leaves.append(Leaf(p, "dict", group))
            traced = {}
            for k, v in group.items():
                if k == "lr" and type(v) is float:
                    traced[k] = self.number(v, p + (Step("key", k),), "lr" if len(opt.param_groups) == 1 else f"lr{gi}")
                elif k == "params":
                    traced[k] = self.walk(v, p + (Step("key", k),))
                else:
                    # Float hyper-parameters (betas, momentum, weight_decay, eps, ...) are runtime inputs too.
                    self.floats_are_inputs = True
                    try:
                        traced[k] = self.walk(v, p + (Step("key", k),))
                    finally:
                        self.floats_are_inputs = False
            groups.append(traced)
        state = collections.defaultdict(dict)
        initial = {}
        for gi, group in enumerate(opt.param_groups):
            for pi, param in enumerate(group["params"]):
                real_state = opt.state.get(param)
                sp = path + (Step("optstate", (gi, pi)),)
                proxy = groups[gi]["params"][pi]
                if real_state is None:
                    self.leaves.append(Leaf(sp, "absent", None))
                    continue
                if type(real_state) is not dict:
                    raise TracingError(f"{path_str(sp)} is a {type(real_state).__name__}; optimizer state entries must be dicts")
                self.leaves.append(Leaf(sp, "dict", real_state))
                entry = {k: self.walk(v, sp + (Step("key", k),), f"{_name_from_path(sp)}_{k}") for k, v in real_state.items()}
                state[proxy] = entry
                initial[id(proxy)] = dict(entry)
        self._refuse_step_hooks(opt, path)
        self.optimizers.append(TracedOptimizer(opt, groups, state, initial, {id(groups[gi]["params"][pi]): param for gi, g in enumerate(opt.param_groups) for pi, param in enumerate(g["params"])},
                                               [dict(g) for g in groups]))
        d = opt.__dict__
        self.swapped.append((d, "param_groups", d["param_groups"]))
        self.swapped.append((d, "state", d["state"]))
        d["param_groups"] = groups
        d["state"] = state

    def _refuse_step_hooks(self, opt, path):
        """Step hooks are Python code the program cannot replay: stepping with them is an error, not a silent skip."""
        from torch.optim import optimizer as optim_mod

        hooks = [(opt.__dict__, "_optimizer_step_pre_hooks"), (opt.__dict__, "_optimizer_step_post_hooks"),
                 (vars(optim_mod), "_global_optimizer_pre_hooks"), (vars(optim_mod), "_global_optimizer_post_hooks")]
        for d, name in hooks:
            if d.get(name):
                self.swapped.append((d, name, d[name]))
                d[name] = _RefusedHooks(d[name], f"{path_str(path)}.step(): optimizer step hooks ({name.strip('_')})")

    def number(self, v, path, hint):
        """A float that is a runtime input of the computation (not a specialised constant).

        Python decisions on it become checks (``CheckedFloat``): ``if weight_decay != 0`` is
        re-evaluated by the prologue instead of freezing the program to one value.
        """
        name = self.trc.unique_name(hint)
        p = CheckedFloat(name, value=v, python_type=float)
        p.origin = ("input",)
        self.leaves.append(Leaf(path, "number", v, p))
        return p

    # ---- lookups used while tracing ----
    def leaf_of(self, proxy):
        """The input leaf a tensor proxy stands for, or None for a tensor made inside the function."""
        return self.leaf_of_proxy.get(id(proxy))

    def is_input(self, proxy) -> bool:
        return id(proxy) in self.leaf_of_proxy

    def input_proxies(self) -> list:
        return [leaf.proxy for leaf in self.leaf_of_proxy.values()]

    def grad_leaf(self, proxy):
        """The ``.grad`` an input tensor had when the function was called: a new leaf (tensor or ``None``)."""
        leaf = self.leaf_of(proxy)
        if leaf is None or leaf.path[-1].kind == "const":
            if leaf is not None and leaf.value.grad is not None:
                raise TracingError(
                    f"{leaf.where} has a .grad; reading or accumulating .grad of a tensor the function captured "
                    "from its closure is not supported: pass the tensor (or its module) as an argument"
                )
            return None  # created inside the function, or a captured tensor without grad
        path = leaf.path + (Step("attr", "grad"),)
        g = leaf.value.grad
        if g is None:
            self.leaves.append(Leaf(path, "absent", None))
            return None
        self.static_depth += 1
        try:
            return self.tensor(g, path, f"{leaf.proxy._tt_name}_grad")
        finally:
            self.static_depth -= 1

    def restore(self):
        for d, k, v in reversed(self.swapped):
            d[k] = v
        self.swapped.clear()


class _RefusedHooks(collections.OrderedDict):
    """Stands in for an optimizer's step hooks while tracing: stepping raises instead of running them once."""

    def __init__(self, hooks, what):
        super().__init__(hooks)
        self.what = what

    def values(self):
        raise TracingError(
            f"{self.what} would run only while tracing, not on every call. Remove the hooks, or call "
            "optimizer.step() outside the compiled function."
        )


@dataclasses.dataclass
class TracedOptimizer:
    """An optimizer's real object and the traced ``param_groups``/``state`` it saw while tracing."""

    opt: Any
    groups: list
    state: dict  # param proxy -> {key: proxy or value}
    initial: dict  # id(param proxy) -> the state entry as it was when tracing started
    real_param: dict  # id(param proxy) -> the real parameter
    initial_groups: list = dataclasses.field(default_factory=list)  # copies of the traced groups before tracing

    def check_groups_unchanged(self, path):
        """Python writes into ``param_groups`` (an LR scheduler stepping inside the function) would happen
        once, while tracing, and never in the compiled program: an error, not a silently frozen lr."""
        for gi, (group, before) in enumerate(zip(self.groups, self.initial_groups)):
            changed = sorted(k for k in set(group) | set(before) if group.get(k, _MISSING) is not before.get(k, _MISSING))
            if changed:
                raise TracingError(
                    f"{path}.param_groups[{gi}][{changed[0]!r}] was changed inside the compiled function (an LR "
                    "scheduler's step()?). Changes to param_groups are Python side effects the compiled program does "
                    "not repeat; make them outside it: the lr and other hyper-parameters are read on every call."
                )


_MISSING = object()


# ---------------------------------------------------------------------------
# Dispatch of torch calls while tracing
# ---------------------------------------------------------------------------
def handle_torch_function(func, types, args, kwargs):
    trc = context.get_trace()
    if trc is None:
        raise TracingError(
            "a thunder_train proxy escaped the compiled function and was used outside tracing; "
            "do not store tensors from inside a compiled function on Python objects"
        )
    top = len(trc._scopes) == 1  # a call of the user's code, not one inside a decomposition
    fname = getattr(func, "__name__", "")
    if fname in ("__get__", "__set__") and type(func).__name__ == "method-wrapper":
        return _property(trc, getattr(func.__self__, "__name__", "?"), fname == "__get__", args, top)
    special = _AUTOGRAD_CALLS.get(func)
    if special is not None:
        if any(isinstance(a, torch.Tensor) and type(a) is not TensorProxy for a in _flat(args, kwargs)):
            args, kwargs = _capture_real_tensors(trc, args, kwargs)
        return special(trc, *args, **kwargs)
    sym = registry.lookup(func)
    if any(isinstance(a, torch.Tensor) and type(a) is not TensorProxy for a in _flat(args, kwargs)):
        args, kwargs = _capture_real_tensors(trc, args, kwargs)
    # Functionalization (compiler/functional.py): read the current value of every buffer.
    orig_args, orig_kwargs = args, kwargs
    if top:
        args, kwargs = _read_current(trc, args, kwargs)
    if sym is not None:
        out_arg = kwargs.get("out")
        if out_arg is not None:
            if not top or type(out_arg) is not TensorProxy:
                raise TracingError(f"{sym.name}(..., out=...) is not supported inside a compiled function; use the returned value")
            # out=: the result becomes the destination's new value (functionalized like an in-place op).
            dst = orig_kwargs["out"]
            kwargs = {k: v for k, v in kwargs.items() if k != "out"}
            _write(trc, sym, dst, _converted_to(sym(*args, **kwargs), dst))
            return dst
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        if top and getattr(sym, "functional", None) is not None:
            return _inplace(trc, sym, orig_args, args, kwargs)
        if top and getattr(sym, "functionalize", None) is not None:
            return _functionalize(trc, sym, orig_args, args, kwargs)
        scope = trc._scopes[-1]
        n = len(scope)
        if top:  # the conversions eager autocast would do, as explicit trace lines (torchlang/autocast.py)
            from .torchlang.autocast import cast_inputs
            args, kwargs = cast_inputs(sym, func, args, kwargs)
        out = sym(*args, **kwargs)
        if len(scope) > n and scope[-1].sym is sym:
            scope[-1].torch_fn = func
        if top:
            out = fresh_results(func, args, kwargs, out)
            out = _back_to_buffers(orig_args, args, out)
            if sym.name in VIEW_SYMBOLS and orig_args and type(orig_args[0]) is TensorProxy:
                _record_views(trc, sym, orig_args[0], args[1:], kwargs, out)
        return _no_grad_region(trc, out, sym)
    if fname in ("register_hook", "register_post_accumulate_grad_hook") and any(type(a) is TensorProxy for a in _flat(args, kwargs)):
        raise TracingError(
            f"Tensor.{fname} inside a compiled function: thunder_train computes gradients with its own backward and "
            "would not call the hook. Apply its change to the gradient explicitly (torch.autograd.grad, then modify), "
            "or register it outside on a parameter and call backward() outside the compiled function."
        )
    if top and getattr(func, "__name__", "").endswith("_") and not getattr(func, "__name__", "").endswith("__"):
        if any(type(a) is TensorProxy for a in _flat(args, kwargs)):
            if getattr(func, "__name__", "").startswith("_fused_"):
                raise TracingError(
                    f"{_callable_name(func)}: this fused=True optimizer is not supported inside a compiled step yet "
                    "(Adam, AdamW, SGD and Adagrad are); use foreach=True or the default implementation"
                )
            if getattr(func, "__name__", "").startswith("_amp_"):
                raise TracingError(
                    f"{_callable_name(func)}: a GradScaler inside a compiled step is not supported yet (its step is "
                    "skipped when gradients overflow, a decision on tensor values). Train with bf16 autocast, which "
                    "needs no scaler, or keep the scaler's unscale_/step/update outside the compiled function."
                )
            raise TracingError(
                f"{_callable_name(func)} updates a tensor in place and thunder_train does not know it yet; "
                "it cannot run opaquely inside a compiled function (the update would be lost). "
                "Use its out-of-place form, or compute this outside the compiled function."
            )
    return _no_grad_region(trc, call_opaque(func, args, kwargs, strict=getattr(trc, "strict", False)))


def _callable_name(func) -> str:
    from .opaque import callable_name

    return callable_name(func)


# Symbols whose result shares storage with their first argument in eager PyTorch: writing into
# the result writes into the argument, and the result follows later writes to the argument.
VIEW_SYMBOLS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "permute",
    "transpose", "t", "movedim", "expand", "expand_as", "broadcast_to", "split", "chunk", "tensor_split",
    "unbind", "narrow", "select", "getitem", "detach", "diagonal", "view_as_real", "alias",
}


def _read_current(trc, args, kwargs):
    from .pytree import tree_map

    read = trc.buffers.read
    return tree_map(lambda x: read(x) if type(x) is TensorProxy else x, (args, kwargs))


def _back_to_buffers(orig_args, args, out):
    """A symbol that returned its (current-valued) input returns the user's object, as eager does (``x.contiguous() is x``)."""
    if type(out) is TensorProxy:
        for o, a in zip(orig_args, args):
            if out is a and o is not a:
                return o
    return out


def _record_views(trc, sym, source, rest, kwargs, out):
    from .pytree import tree_flatten

    if sym.name == "getitem" and any(isinstance(k, torch.Tensor) for k in tree_flatten(rest)[0]):
        return  # advanced indexing copies
    if type(out) is TensorProxy:
        trc.buffers.add_view(out, source, lambda v: sym(v, *rest, **kwargs))
    elif isinstance(out, (tuple, list)):
        for i, o in enumerate(out):
            trc.buffers.add_view(o, source, lambda v, i=i: sym(v, *rest, **kwargs)[i])


def _inplace(trc, sym, orig_args, args, kwargs):
    """An in-place op: record its out-of-place form; the result becomes the destination's value."""
    dst = orig_args[0]
    new = sym.functional(*args, **kwargs)
    if isinstance(dst, (list, tuple)):
        for d, v in zip(dst, new):
            _write(trc, sym, d, v)
    else:
        _write(trc, sym, dst, new)
    return dst


def _write(trc, sym, dst, value):
    if torch.is_grad_enabled() and dst._tt_requires_grad and trc.walker.is_input(dst):
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    last = trc.bound_symbols[-1] if trc.bound_symbols else None
    if last is not None and any(o is value for o in last.flat_outputs()) and last.comment is None:
        last.comment = f"{sym.name}: the new value of {dst._tt_name}"
    if not torch.is_grad_enabled() and getattr(trc, "grad_enabled", False):
        value = _no_grad_region(trc, value)
    trc.buffers.write(dst, value)


def _converted_to(value, dst):
    if type(value) is not TensorProxy or value._tt_shape != dst._tt_shape:
        raise TracingError(f"out=: the result ({getattr(value, 'type_string', lambda: value)()}) does not match the out tensor ({dst.type_string()})")
    from .clang import maybe_convert

    return maybe_convert(value, dst._tt_dtype)


def _functionalize(trc, sym, orig_args, args, kwargs):
    """A symbol that returns a result and also updates some arguments (``batch_norm``'s running stats)."""
    from .pytree import tree_flatten

    out, writes = sym.functionalize(*args, **kwargs)
    # Writes name the current values they were given; write to the user's objects (also inside lists).
    back = {id(a): o for o, a in zip(tree_flatten(orig_args)[0], tree_flatten(args)[0]) if type(o) is TensorProxy}
    last = trc.bound_symbols[-1] if trc.bound_symbols else None
    if len(writes) > 1 and last is not None and last.comment is None and any(o is writes[0][1] for o in last.flat_outputs()):
        last.comment = f"{sym.name}: the new values of {len(writes)} tensors"
    for dst, value in writes:
        _write(trc, sym, back.get(id(dst), dst), value)
    return _no_grad_region(trc, out, sym)


def _property(trc, prop, get, args, top):
    a = args[0]
    if prop == "grad":
        if get:
            return trc.grads.get(a)
        return trc.grads.set(a, args[1])
    if not get:
        setter = registry.property_setters.get(prop)
        if setter is None:
            raise TracingError(f"setting Tensor.{prop} is not supported while tracing with thunder_train")
        return setter(a, args[1])
    getter = registry.property_getters.get(prop)
    if getter is None:
        raise TracingError(f"Tensor.{prop} is not supported while tracing with thunder_train")
    if not top or type(a) is not TensorProxy:
        return getter(a)
    out = getter(trc.buffers.read(a))
    if prop in ("data", "T", "mT", "H", "mH"):
        trc.buffers.add_view(out, a, getter)
    return out


def _autograd_backward(trc, tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None):
    from . import traced_autograd

    return traced_autograd.backward(trc, tensors, grad_tensors, retain_graph, create_graph, inputs)


def _tensor_backward(trc, self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    from . import traced_autograd

    return traced_autograd.backward(trc, self, gradient, retain_graph, create_graph, inputs)


def _autograd_grad(trc, *args, **kwargs):
    from . import traced_autograd

    return traced_autograd.grad(trc, *args, **kwargs)


_AUTOGRAD_CALLS = {
    torch.Tensor.backward: _tensor_backward,
    torch.autograd.backward: _autograd_backward,
    torch.autograd.grad: _autograd_grad,
}


def _flat(args, kwargs):
    from .pytree import tree_flatten

    return tree_flatten((args, kwargs))[0]


def _capture_real_tensors(trc, args, kwargs):
    from .pytree import tree_map

    walker = trc.walker

    def swap(a):
        if isinstance(a, torch.Tensor) and type(a) is not TensorProxy:
            return walker.captured_tensor(a)
        return a

    return tree_map(swap, (args, kwargs))


def _no_grad_region(trc, out, sym=None):
    """Results computed under ``torch.no_grad()`` inside the function carry no gradient (``prims.stop_gradient``)."""
    if torch.is_grad_enabled() or not getattr(trc, "grad_enabled", False) or len(trc._scopes) != 1:
        return out
    if sym is not None and "inplace" in sym.tags:
        return out
    from .transforms.autograd import detach_float_tensors

    return detach_float_tensors(out)


proxies._torch_function_handler = handle_torch_function


class ProxyMode(TorchFunctionMode):
    """Routes every torch call made while tracing to the torch language."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return handle_torch_function(func, types, args, kwargs or {})


# ---------------------------------------------------------------------------
# Acquisition
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Acquired:
    trace: Trace
    leaves: list
    opaque_ops: list
    written: set = dataclasses.field(default_factory=set)  # ids of input proxies updated in place
    size_checks: list = dataclasses.field(default_factory=list)  # (op, size, other, result) decided while tracing


def _arg_names(fn) -> list:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def check_call_signature(fn, args, kwargs):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", "the function"))
        raise TypeError(f"{name}{sig}: {e}") from None


def acquire(fn, args, kwargs, *, strict: bool = False, dynamic: bool = False, fused_optimizers: bool = True) -> Acquired:
    """Run ``fn`` on proxies of ``args``/``kwargs``; return its computation trace and input leaves.

    ``fused_optimizers``: optimizer updates take torch's fused kernels where they compute the
    same thing (``torchlang/optim.py``); False traces the optimizers' own per-op code.
    """
    check_call_signature(fn, args, kwargs)
    trc = Trace("computation", header="Constructed by acquisition (tracing fn on proxies)")
    trc.strict = strict
    trc.opaque_ops = []
    trc.grad_enabled = torch.is_grad_enabled()  # torch.no_grad() regions inside fn: see _no_grad_region
    walker = InputWalker(trc, _arg_names(fn))
    walker.dynamic = dynamic
    trc.walker = walker
    trc.size_checks = []  # decisions on symbolic sizes and checked hyper-parameters
    trc.buffers = Buffers()
    trc.grads = GradState(trc)
    trc.requires_grad_changes = {}  # id(proxy) -> (proxy, flag before the function set it)
    with context.tracing(trc):
        try:
            pargs, pkwargs = walker.walk_args(args, kwargs)
            with ProxyMode(), optimizers_while_tracing(fused_kernels=fused_optimizers), ddp_while_tracing(), \
                    only_walked_optimizers_step(walker), custom_functions_while_tracing(needs_grad):
                out = fn(*pargs, **pkwargs)
            check_ddp_finished(trc)
            refuse_backward_hooks(trc, walker)
            for traced in walker.optimizers:
                traced.check_groups_unchanged(path_str(walker.by_id[id(traced.opt)].path))
            out = _check_output(out)
            inputs = []
            seen = set()
            for leaf in walker.leaves:
                if leaf.kind in ("tensor", "number") and leaf.alias_of is None and id(leaf.proxy) not in seen:
                    seen.add(id(leaf.proxy))
                    inputs.append(leaf.proxy)
            trc.args = inputs
            trc.output, trc.epilogue = finish(trc, out)
            _insert_shape_queries(trc, walker.symbolic_inputs)
        finally:
            walker.restore()
    written = {id(dst) for dst in trc.written_inputs}
    return Acquired(trc, walker.leaves, trc.opaque_ops, written, list(getattr(trc, "size_checks", ())))


def _insert_shape_queries(trc, symbolic_inputs):
    """``(x_size0, _) = prims.shape(x)`` at the top of the program for every input with symbolic sizes.

    DCE removes the queries nothing reads; everything else reads sizes through these names.
    """
    from . import prims
    from .symbols import BoundSymbol

    queries = [BoundSymbol(prims.shape, (p,), {}, tuple(p._tt_shape)) for p in symbolic_inputs]
    trc.bound_symbols[:0] = queries


def _check_output(out):
    from .pytree import tree_flatten

    for v in tree_flatten(out)[0]:
        if isinstance(v, torch.nn.Module):
            raise TracingError("a compiled function cannot return an nn.Module; return tensors and Python values")
    return out
