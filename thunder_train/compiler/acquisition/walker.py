"""Input walking: real inputs become proxied inputs, each part recorded as a ``Leaf``.

Tensors become ``TensorProxy`` objects; modules have their parameters and
buffers swapped for proxies and optimizers their ``param_groups``/``state``
while tracing (``InputWalker.restore`` puts the real ones back, also when
tracing raises).  Python values are specialised on; an optimizer's float
hyper-parameters are runtime numbers.
"""
from __future__ import annotations

import collections
import collections.abc
import dataclasses
import functools
import io
import types
from typing import Any

import torch

from .. import context
from ..errors import TracingError, UninitializedLazyModule
from ..proxies import CheckedFloat, SizeProxy, TensorProxy
from ..trace import Trace
from .class_attrs import ClassWatch, user_class
from .containers import Tracked, attrs_of, slot_descriptors
from .instance_reads import SCALAR_TYPES, InstanceWatch
from .module_writes import ModuleState
from . import fsdp, library_objects, user_generators
from .sparse import sparse_proxy_of
from .provenance import CAPTURED_ROOTS, Leaf, Step, name_from_path, path_str


def module_snapshot(m) -> dict:
    """A module's Python state before tracing runs it: flags, structure, public scalar attributes."""
    d = m.__dict__
    attrs = tuple((k, v) for k, v in d.items() if k[:1] != "_" and k != "training" and type(v) in SCALAR_TYPES)
    # Entries registered as None (``nn.Linear(..., bias=False)``, ``m.bias = None``): no leaf stands for them, and the
    # structure's counts do not change when one becomes a tensor or module again, so the guard names them.
    nones = tuple((table, k) for table in ("_parameters", "_buffers", "_modules")
                  for k, v in d[table].items() if v is None)
    return {"training": m.training, "dict_len": len(d), "attrs": attrs, "nones": nones}


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
        # containers.Tracked: the copies (lists, dicts, dataclasses, plain objects' __dict__) the function works on;
        # what it changes in them is replayed by the epilogue (containers.py).
        self.tracked: list = []
        self.copy_leaf: dict = {}  # id(copy the function sees) -> the leaf of the real object
        self._swapped_objects: set = set()  # ids of plain objects whose __dict__ is a copy while tracing
        self.object_depth = 0  # plain objects being walked (namespace) around the current value
        # (where, container, contents, copy, what): lists/dicts held by modules, or by plain objects but too large
        # to walk; the function must not change them (check_unwalked_unchanged).
        self.unwalked: list = []
        # module_writes.ModuleState of every walked module: what the function assigns on it is settled after it runs.
        self.module_states: list = []
        # Class attributes the function reads (class_attrs.py): inputs under the root ``Cls.name``.
        self.classes = ClassWatch(self)
        self.instances = InstanceWatch(self)  # private scalars and plain containers of modules, guarded where read
        # (path, object, its __dict__ when walked): objects the function runs on as they are (library objects);
        # what library code sets on them while tracing is rolled back or refused (library_objects.py).
        self.library_objects: list = []
        # (path, object, its __dict__ when walked) of every walked module and optimizer: what the function or library
        # code sets on them (``self.calls += 1``, ``_opt_called`` from an LR scheduler's wrapper of ``step``) is put
        # back when tracing fails (library_objects.rollback); on success module writes are settled (module_writes.py).
        self.walked_objects: list = []
        # id -> (where, generator, its state when reached) of the user's random generators (user_generators.py)
        self.generators: dict = {}
        # (id(tensor leaf), name) -> the walked value of a Python attribute of an input tensor the function read
        # (tensor_attributes.py)
        self.tensor_attributes: dict = {}
        # FSDP2 (fsdp.py): id(sharded DTensor parameter) -> its FSDPParam, the units whose hooks are replaced, and
        # id(shard proxy) -> the leaf of the DTensor it is the shard of.
        self.fsdp_params: dict = {}
        self.fsdp_units: list = []
        self.dtensor_of: dict = {}

    def walk_args(self, args, kwargs):
        pargs = tuple(self.walk(a, (Step("arg", i),), self.arg_names[i] if i < len(self.arg_names) else None) for i, a in enumerate(args))
        pkwargs = {k: self.walk(v, (Step("kwarg", k),), k) for k, v in kwargs.items()}
        return pargs, pkwargs

    def walk_captured(self, roots):
        """Globals and closure cells the function reads (``captured.py``): walked like arguments.

        The function reads the proxied value while tracing (the global or the cell is set to it and
        restored afterwards). An object already walked (``model`` passed as an argument and read as
        a global) gets an identity leaf under this path, so rebinding the name is still seen.
        """
        for root in roots:
            path, v = (root.step,), root.value
            if id(v) in self.by_id and not isinstance(v, torch.Tensor):
                self.leaves.append(Leaf(path, "object", v))
                continue
            new = self.walk(v, path, name_from_path(path))
            if new is not v:
                self.swapped.append((root, None, v))
                root.set(new)

    def _track(self, leaf, copy, kind):
        """The function works on ``copy``; what it changes there is replayed on ``leaf``'s real object."""
        if self.static_depth:
            return  # optimizer internals: TracedOptimizer checks them
        initial = list(copy) if kind == "list" else list(copy.items()) if kind == "dict" else list(attrs_of(copy).items())
        self.tracked.append(Tracked(leaf, copy, initial, kind))
        self.copy_leaf.setdefault(id(copy), leaf)

    def tensor(self, t, path, hint, requires_grad=None):
        if fsdp.is_dtensor(t):
            return self.dtensor(t, path, hint)
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            raise UninitializedLazyModule(f"{path_str(path)} is an uninitialized parameter or buffer of a lazy module (nn.LazyLinear, "
                               "nn.LazyConv2d, ...), whose sizes its first forward chooses. Call the model once "
                               "eagerly on an example batch before the first compiled call, or give the module its "
                               "input sizes (nn.Linear(in_features, ...))")
        if overrides_torch(type(t)):
            raise TracingError(
                f"{path_str(path)} is a {type(t).__module__}.{type(t).__qualname__}, a torch.Tensor subclass with its own "
                "__torch_function__ or __torch_dispatch__: the compiled program runs torch's kernels on its data, so what "
                "the subclass does to an op would be applied in part (where a torch call of the program reaches it) or "
                "not at all (fused kernels, out= forms). Pass a plain tensor (x.as_subclass(torch.Tensor)), or call the "
                "uncompiled function.")
        prev = self.by_id.get(id(t))
        if t.layout != torch.strided and prev is None:
            return self.sparse(t, path, hint)
        if prev is not None:
            # The same tensor reached twice (tied weights, one tensor passed twice): one proxy.
            self.leaves.append(Leaf(path, "tensor", t, prev.proxy, alias_of=prev))
            return prev.proxy
        name = self.trc.unique_name(hint or name_from_path(path))
        shape = tuple(t.shape)
        # Captured values (globals, closures) keep constant shapes like module tensors.
        symbolic = self.dynamic and not self.static_depth and path[0].kind != "const" and path[0].kind not in CAPTURED_ROOTS
        if symbolic:
            # dynamic=True: sizes ≥ 2 of per-call inputs are symbols (0 and 1 stay constants:
            # they decide broadcasting and emptiness).  Automatic dynamic shapes (symbolic_dims.py) name the
            # dims that became symbolic: ``dims_at`` (an empty set: this tensor keeps every size).
            dims = None if self.dynamic is True else self.dynamic.dims_at(path)
            shape = tuple(SizeProxy(f"{name}_size{i}", value=s) if s >= 2 and (dims is None or i in dims) else s
                          for i, s in enumerate(shape))
            symbolic = any(type(s) is SizeProxy for s in shape)
        p = TensorProxy(name, shape=shape, dtype=t.dtype, device=t.device,
                        requires_grad=t.requires_grad if requires_grad is None else requires_grad,
                        strides=t.stride(), storage_offset=t.storage_offset())
        if isinstance(t, torch.nn.Parameter):
            p._is_param = True  # isinstance(proxy, nn.Parameter), as eager: ``m.weight -= d`` assigns it back
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

    def sparse(self, t, path, hint):
        """A sparse input: an opaque value (acquisition/sparse.py), guarded by layout, shape, dtype and device."""
        p = sparse_proxy_of(t, path_str(path), self.trc.unique_name(hint or name_from_path(path)))
        leaf = Leaf(path, "tensor", t, p)
        self.leaves.append(leaf)
        self.by_id[id(t)] = leaf
        self.leaf_of_proxy[id(p)] = leaf
        return p

    def dtensor(self, t, path, hint):
        """A DTensor (FSDP2's sharded parameters, their gradients and optimizer state): the program reads its local
        shard (``path._local_tensor``); the DTensor itself is guarded by type, layout and ``requires_grad``."""
        where = path_str(path)
        if not self.static_depth:
            raise TracingError(f"{where} is a DTensor passed to the function directly: a compiled function reads DTensors "
                               "only as the parameters (gradients, optimizer state) of a fully_shard model it is given.")
        fsdp.check_dtensor(t, where)
        leaf = Leaf(path, "dtensor", t, snapshot=(tuple(t.shape), tuple(t.placements), t.requires_grad))
        self.leaves.append(leaf)
        local, lpath = t._local_tensor, path + (Step("attr", "_local_tensor"),)
        prev = self.by_id.get(id(t))
        if prev is not None:
            self.leaves.append(Leaf(lpath, "tensor", local, prev.proxy, alias_of=prev))
            return prev.proxy
        proxy = self.tensor(local, lpath, hint or name_from_path(path), requires_grad=t.requires_grad)
        self.by_id[id(t)] = self.leaf_of(proxy)
        self.dtensor_of[id(proxy)] = leaf
        return proxy

    def target_leaf(self, proxy):
        """The leaf of the object an effect on ``proxy`` is replayed on: the DTensor a shard proxy stands for."""
        return self.dtensor_of.get(id(proxy)) or self.leaf_of(proxy)

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
            return self.number(x, path, name_from_path(path))
        if t in SCALAR_TYPES:
            self.leaves.append(Leaf(path, "constant", x))
            return x
        if t is tuple or t is list or (isinstance(x, tuple) and hasattr(x, "_fields")):
            leaf = Leaf(path, "seq", x)
            self.leaves.append(leaf)
            items = [self.walk(v, path + (Step("item", i),)) for i, v in enumerate(x)]
            new = t(*items) if hasattr(x, "_fields") else t(items)
            if t is list:
                self._track(leaf, new, "list")
            return new
        if t is dict:
            leaf = Leaf(path, "dict", x)
            self.leaves.append(leaf)
            new = {k: self.walk(v, path + (Step("key", k),)) for k, v in x.items()}
            self._track(leaf, new, "dict")
            return new
        if isinstance(x, (torch.nn.Module, torch.optim.Optimizer)) and id(x) in self.by_id:
            # Reached again (an argument also held by a plain object or a class): an identity check at this path, so
            # that replacing it here (trainer.model = other) is seen.
            self.leaves.append(Leaf(path, "object", x))
            return x
        if isinstance(x, torch.nn.Module):
            self.module(x, path)
            return x
        if isinstance(x, torch.optim.Optimizer):
            self.optimizer(x, path)
            return x
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            self.classes.watch(t)
            leaf = Leaf(path, "dataclass", x)
            self.leaves.append(leaf)
            fields = {f.name: self.walk(getattr(x, f.name), path + (Step("attr", f.name),)) for f in dataclasses.fields(x)}
            new = object.__new__(t)
            if hasattr(x, "__dict__"):  # slotted dataclasses have none
                new.__dict__.update(x.__dict__)
            for k, v in fields.items():
                object.__setattr__(new, k, v)
            self._track(leaf, new, "dataclass")
            return new
        if isinstance(x, collections.abc.Iterator) and not isinstance(x, io.IOBase):
            raise TracingError(
                f"{path_str(path)} is an iterator ({t.__name__}): the compiled function runs its Python code once, while "
                "tracing, so a next() inside it would return the same first item on every call. Take the batch outside "
                "and pass it: batch = next(it); step(batch)."
            )
        if user_generators.is_generator(x):  # by identity; a draw while tracing is refused (user_generators.py)
            user_generators.note(self.generators, x, path_str(path))
            self.leaves.append(Leaf(path, "object", x))
            return x
        if t is types.MethodType and _walkable_method(x):
            return self.method(x, path)
        if t is functools.partial:
            return self.partial(x, path)
        if (plain_object(x) or slotted_object(x)) and not self.static_depth and id(x) not in self.by_id \
                and self.object_depth < MAX_OBJECT_DEPTH:
            return self.namespace(x, path)
        # Anything else (callables, classes, objects nested too deep, ...) is specialised on by identity.
        leaf = Leaf(path, "object", x)
        self.leaves.append(leaf)
        if isinstance(x, type) and user_class(x):
            self.classes.watch(x)  # a class the function reads attributes of (Cfg.scale)
        if id(x) not in self.by_id:  # (an object walked as a namespace already runs with its walked __dict__)
            if plain_object(x):
                self._swap_dict(leaf, x, dict(x.__dict__), "object")
            elif not isinstance(x, type) and all(o is not x for _, o, _ in self.library_objects):
                before = library_objects.snapshot(x)
                if before is not None:
                    self.library_objects.append((path, x, before))
                    library_objects.initialise(x)
        return x

    def namespace(self, x, path):
        """A plain object (a config, ``argparse.Namespace``, ``types.SimpleNamespace``, a trainer-like object, an
        object with ``__slots__``): its instance attributes are inputs like a dataclass's fields (``args[1].scale``),
        guarded and bound; it runs with walked values in its ``__dict__`` and slots, so what it writes there is
        replayed by the epilogue (containers.py). Its class's attributes are watched (class_attrs.py)."""
        d = x.__dict__ if type(getattr(x, "__dict__", None)) is dict else None
        slots = slot_descriptors(type(x))
        filled = {}
        for k, desc in slots.items():
            try:
                filled[k] = desc.__get__(x, type(x))
            except AttributeError:
                pass  # an unset slot
        leaf = Leaf(path, "namespace", x, snapshot=None if d is None else tuple(d),
                    slots=(tuple(slots), tuple(filled)) if slots else None)
        self.leaves.append(leaf)
        self.by_id[id(x)] = leaf
        self.classes.watch(type(x))
        new = {}
        self.object_depth += 1
        try:
            for k, v in list((d or {}).items()) + list(filled.items()):
                if type(k) is not str or not k.isidentifier():
                    new[k] = v  # not reachable as obj.<name>: neither guarded nor proxied
                elif isinstance(v, collections.abc.Iterator) and not isinstance(v, io.IOBase):
                    # An iterator the object holds: fine unless the function steps it (once, while tracing).
                    where = path_str(path + (Step("attr", k),))
                    self.leaves.append(Leaf(path + (Step("attr", k),), "object", v))
                    new[k] = _RefusedIterator(v, where)
                elif type(v) in (list, dict) and len(v) > MAX_ITEMS:
                    # Not walked item by item: its identity is guarded; a change the function makes is refused.
                    self.leaves.append(Leaf(path + (Step("attr", k),), "object", v))
                    self.unwalked.append((path_str(path + (Step("attr", k),)), v, _contents(v), v.copy(),
                                          f"a {type(v).__name__} of more than {MAX_ITEMS} items held by a plain object"))
                    new[k] = v
                else:
                    new[k] = self.walk(v, path + (Step("attr", k),), f"{name_from_path(path)}_{k}")
        finally:
            self.object_depth -= 1
        if id(x) in self._swapped_objects:
            return x
        if d is not None:
            self._swap_dict(leaf, x, {k: new[k] for k in d}, "namespace", track=False)
        if filled:
            self.swapped.append((_Slots(x, slots), None, dict(filled)))
            for k in filled:
                slots[k].__set__(x, new[k])
        self._swapped_objects.add(id(x))
        self._track(leaf, x, "namespace")
        return x

    def method(self, m, path):
        """A bound method the function reads (``loss = trainer.loss`` captured, ``partial(trainer.loss, ...)``): the
        object it is bound to is walked under ``.__self__`` (``globals['loss'].__self__.model``)."""
        self.leaves.append(Leaf(path, "method", m))
        new_self = self.walk(m.__self__, path + (Step("attr", "__self__"),), f"{name_from_path(path)}_self")
        return m if new_self is m.__self__ else types.MethodType(m.__func__, new_self)

    def partial(self, p, path):
        """``functools.partial(loss_fn, model, scale=2.0)``: its ``args`` and ``keywords`` are walked like arguments
        (``globals['f'].args[0].fc.weight``); the function runs with a partial whose args are the walked values."""
        state = p.__reduce__()[2]  # (func, args, keywords, __dict__): what __setstate__ takes back
        func, args, kw, extra = state
        self.leaves.append(Leaf(path, "partial", p))
        base = name_from_path(path)
        new_func = self.walk(func, path + (Step("attr", "func"),), f"{base}_func") \
            if type(func) in (types.MethodType, functools.partial) else func
        new_args = self.walk(args, path + (Step("attr", "args"),), f"{base}_args")
        new_kw = self.walk(kw or {}, path + (Step("attr", "keywords"),), f"{base}_keywords")
        self.swapped.append((_PartialState(p), None, state))
        p.__setstate__((new_func, new_args, new_kw, extra))
        return p

    def _swap_dict(self, leaf, x, new, kind, track=True):
        """While tracing, ``x`` has ``new`` as its ``__dict__``: attribute writes land there (restored afterwards).
        Where ``__dict__`` cannot be reassigned (``types.SimpleNamespace``) its contents are swapped in place."""
        if new is None or self.static_depth or id(x) in self._swapped_objects:
            return
        d = x.__dict__
        try:
            object.__setattr__(x, "__dict__", new)
            self.swapped.append((_ObjectDict(x), None, d))
        except (TypeError, AttributeError):
            if type(d) is not dict:
                return
            self.swapped.append((_DictContents(d), None, dict(d)))
            d.clear()
            d.update(new)
        if track:
            self._swapped_objects.add(id(x))
            self._track(leaf, x, kind)

    def check_unwalked_unchanged(self):
        """A list or dict held by a module, or a large one held by a plain object, is not walked: changing it
        inside is an error (its contents are put back), not a change that happens once."""
        for where, v, before, items, what in self.unwalked:
            if _contents(v) != before:
                if type(v) is dict:  # put back what it held: the traced change must not leave proxies in it
                    v.clear()
                    v.update(items)
                else:
                    v[:] = items
                raise TracingError(
                    f"the function changed {where}, {what}: such containers are not walked item by item, so the change "
                    "would happen once, while tracing. Return the values and collect them outside the compiled function."
                )

    def module(self, m, path):
        self.static_depth += 1
        try:
            self._module(m, path)
        finally:
            self.static_depth -= 1

    def _module(self, m, path):
        if id(m) in self.by_id:
            return
        if fsdp.is_fsdp_module(m):  # before its parameters are swapped (FSDP2's lazy init reads them)
            fsdp.prepare_module(self, m, path_str(path))
        self.walked_objects.append((path, m, library_objects.snapshot(m)))
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
        for name, v in list(m.__dict__.items()):
            if name[:1] != "_" and isinstance(v, torch.Tensor) and not isinstance(v, TensorProxy):
                # A plain tensor attribute (``self.mask = torch.ones(4)``): an input like a buffer, read from the module
                # on every call, so a replaced tensor (another value, requires_grad or grad_fn) is seen.
                proxy = self.tensor(v, path + (Step("attr", name),), None)
                self.swapped.append((m.__dict__, name, v))
                m.__dict__[name] = proxy
        for name, v in m.__dict__.items():
            if name[:1] != "_" and type(v) in (list, dict):  # a module's own list or dict (self.history = [])
                self.unwalked.append((path_str(path + (Step("attr", name),)), v, _contents(v), v.copy(),
                                      f"a {type(v).__name__} held by the module {type(m).__name__}"))
        self.module_states.append(ModuleState.of(m, leaf.where))
        self.classes.watch(type(m))
        self.instances.watch(m, leaf.where)
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
        self.walked_objects.append((path, opt, library_objects.snapshot(opt)))
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
                entry = {k: self.walk(v, sp + (Step("key", k),), f"{name_from_path(sp)}_{k}") for k, v in real_state.items()}
                state[proxy] = entry
                initial[id(proxy)] = dict(entry)
        self._refuse_step_hooks(opt, path)
        self.optimizers.append(TracedOptimizer(opt, groups, state, initial, {id(groups[gi]["params"][pi]): param for gi, g in enumerate(opt.param_groups) for pi, param in enumerate(g["params"])},
                                               [dict(g) for g in groups]))
        d = opt.__dict__
        self._swap_params_aliases(opt, groups, path)
        self.swapped.append((d, "param_groups", d["param_groups"]))
        self.swapped.append((d, "state", d["state"]))
        d["param_groups"] = groups
        d["state"] = state
        # An optimizer held by this one (SAM's base optimizer, stepped by SAM's own step) is walked as well, as if
        # passed in: stepping it while tracing was refused as an optimizer the function does not reach.
        for k, v in list(d.items()):
            if isinstance(v, torch.optim.Optimizer):
                self.optimizer(v, path + (Step("attr", k),))
        # Its own attributes (a custom optimizer's counter, a held config): guarded where its step reads them.
        leaf.snapshot = {}
        self.instances.watch(opt, leaf.where)

    def _swap_params_aliases(self, opt, groups, path):
        """An optimizer attribute that is a group's ``params`` list itself (LBFGS's ``self._params``) sees the traced
        list while tracing, as ``param_groups`` does; another attribute holding the parameters would read the real
        ones (their stale ``.grad``), so it is refused."""
        d = opt.__dict__
        params = {id(p) for g in opt.param_groups for p in g["params"]}
        for k, v in list(d.items()):
            if k in ("param_groups", "state", "defaults") or not isinstance(v, (list, tuple)):
                continue
            same = next((gi for gi, g in enumerate(opt.param_groups) if v is g["params"]), None)
            if same is not None:
                self.swapped.append((d, k, v))
                d[k] = groups[same]["params"]
            elif any(id(x) in params for x in v):
                raise TracingError(
                    f"{path_str(path)}.{k} holds the optimizer's parameters apart from param_groups: while tracing its "
                    f"step would read the real parameters, not the traced ones. Keep the parameters in param_groups "
                    f"only (or let {k} be a group's params list itself), or run this optimizer's step outside the "
                    "compiled function.")

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

    def module_tensor(self, proxy):
        """The real parameter or buffer of a walked module that ``proxy`` stands for (None otherwise).

        Those are bound by identity on every call, so a reference to one stays right; a per-call input's would not.
        """
        leaf = self.leaf_of(proxy)
        if leaf is None or not leaf.path or leaf.path[-1].kind not in ("param", "buffer"):
            return None
        return leaf.value

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
        owner = self.dtensor_of.get(id(proxy))
        if owner is not None:  # a shard: the DTensor's .grad (a DTensor, read through its shard)
            leaf = owner
        path = leaf.path + (Step("attr", "grad"),)
        g = leaf.value.grad
        if g is None:
            self.leaves.append(Leaf(path, "absent", None))
            return None
        self.static_depth += 1
        try:
            return self.tensor(g, path, f"{proxy._tt_name}_grad")
        finally:
            self.static_depth -= 1

    def restore(self):
        for d, k, v in reversed(self.swapped):
            if k is None:
                d.set(v)  # a captured root (captured.Root)
            else:
                d[k] = v
        self.swapped.clear()


MAX_OBJECT_DEPTH = 3  # plain objects inside plain objects are walked this deep; deeper ones by identity
MAX_ITEMS = 256  # a list or dict attribute of a plain object larger than this is guarded by identity


def _contents(v) -> list:
    return [(k, id(x)) for k, x in v.items()] if type(v) is dict else [id(x) for x in v]


def _user_module(x) -> bool:
    mod = type(x).__module__ or ""
    return not (mod == "builtins" or mod.startswith(("torch.", "thunder_train.")) or mod == "torch")


def plain_object(x) -> bool:
    """An instance of a user's Python class (not a function, class, module, torch or thunder_train object)."""
    if isinstance(x, _NOT_PLAIN) or type(getattr(x, "__dict__", None)) is not dict:
        return False
    return _user_module(x)


def slotted_object(x) -> bool:
    """An instance of a user's class with ``__slots__`` (and no ``__dict__``): walked through its slots."""
    return not isinstance(x, _NOT_PLAIN + (tuple,)) and _user_module(x) and bool(slot_descriptors(type(x)))


_PLAIN_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def overrides_torch(cls) -> bool:
    """A tensor class whose own ``__torch_function__`` or ``__torch_dispatch__`` changes what ops do (not
    ``nn.Parameter``'s or a subclass that only marks its tensors)."""
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return False
    fn = cls.__torch_function__
    return (getattr(fn, "__func__", fn) not in _PLAIN_TORCH_FUNCTIONS
            or cls.__torch_dispatch__ is not torch._C._disabled_torch_dispatch_impl)


def _walkable_method(m) -> bool:
    """A bound method of a user object (walked), not of a class or of thunder_train's own objects."""
    owner = m.__self__
    return not isinstance(owner, type) and not (type(owner).__module__ or "").startswith("thunder_train.")


_NOT_PLAIN = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, functools.partial,
              torch.Tensor, torch.nn.Module, torch.optim.Optimizer)


class _RefusedIterator:
    """Stands in for an iterator held by a plain object while tracing: ``next()`` on it is an error."""

    def __init__(self, it, where):
        self._it, self._where = it, where

    def __iter__(self):
        return self

    def __next__(self):
        raise TracingError(
            f"{self._where} is an iterator: the compiled function runs its Python code once, while tracing, so a "
            "next() inside it would return the same first item on every call. Take the batch outside and pass it: "
            "batch = next(it); step(batch)."
        )

    def __getattr__(self, name):
        return getattr(self._it, name)


class _ObjectDict:
    """``restore`` target for a plain object's swapped ``__dict__``."""

    def __init__(self, obj):
        self.obj = obj

    def set(self, d):
        object.__setattr__(self.obj, "__dict__", d)


class _DictContents:
    """``restore`` target for a ``__dict__`` whose contents were swapped in place (``types.SimpleNamespace``)."""

    def __init__(self, d):
        self.d = d

    def set(self, items):
        self.d.clear()
        self.d.update(items)


class _Slots:
    """``restore`` target for an object's slots: the slots filled before tracing get their values back, others
    are emptied."""

    def __init__(self, obj, descriptors):
        self.obj, self.descriptors = obj, descriptors

    def set(self, filled):
        for k, desc in self.descriptors.items():
            if k in filled:
                desc.__set__(self.obj, filled[k])
            else:
                try:
                    desc.__delete__(self.obj)
                except AttributeError:
                    pass


class _PartialState:
    """``restore`` target for a ``functools.partial`` whose args and keywords were walked."""

    def __init__(self, p):
        self.p = p

    def set(self, state):
        self.p.__setstate__(state)


class _RefusedHooks(collections.OrderedDict):
    """Stands in for an optimizer's step hooks while tracing: stepping raises instead of running them once."""

    def __init__(self, hooks, what):
        super().__init__(hooks)
        self.what = what
        self.tracer = context.tracer_state()

    def values(self):
        if context.tracer_state() is not self.tracer:  # an eager step in another thread (the global dicts)
            return super().values()
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


