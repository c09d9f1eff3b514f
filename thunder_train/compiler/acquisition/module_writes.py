"""Attributes a compiled function assigns on the modules it was given, settled once it has run.

While tracing, a module's parameters and buffers are proxies (walker.py), so an assignment made by the
function's Python code would store a proxy on the real module and happen once, at trace time:

- ``self.ema = self.ema * 0.9 + x.detach()`` on a *buffer* is an update eager makes on every call.  It becomes
  a write into the buffer (``ema.copy_(new)``) recorded in the program, so every call — full or thin —
  gives the buffer eager's values.  The buffer stays the same tensor object (eager binds a new one); a new
  value with another shape, dtype or device, or one that requires grad, is refused.
- An attribute given references to the modules' own parameters and buffers (nn.RNN rebuilds its
  ``_flat_weights`` list in forward) gets the real tensors, which is what eager stores.
- Any other attribute given a traced tensor (``self.last = loss.detach()``), a parameter rebound, or a
  buffer added or removed would leave a proxy on the module or happen only once: an error that names it, with
  the module put back as it was.

Python scalars assigned on a module (``self.calls += 1``) are not settled here: the prologue specialises on a
module's public scalar attributes, so the next call sees the change and retraces.
"""
from __future__ import annotations

import dataclasses

import torch

from ..errors import TracingError
from ..proxies import is_proxy
from ..pytree import holds

_MISSING = object()


@dataclasses.dataclass
class ModuleState:
    module: torch.nn.Module
    where: str
    params: dict  # name -> the proxy the walker put in _parameters
    buffers: dict  # name -> the proxy (or None) in _buffers
    attrs: dict  # __dict__ entries other than the module's own registries

    @classmethod
    def of(cls, m, where):
        return cls(m, where, dict(m._parameters), dict(m._buffers), _plain_attrs(m))


def _plain_attrs(m) -> dict:
    return {k: v for k, v in m.__dict__.items() if k not in ("_parameters", "_buffers", "_modules")}


def settle(states, needs_grad, module_tensor) -> None:
    """Record buffer reassignments as writes into the buffers; refuse the other assignments (see module doc).

    ``needs_grad(proxy)``: whether a traced value has autograd history (python_effects.needs_grad).
    ``module_tensor(proxy)``: the real parameter or buffer a proxy stands for, or None.
    """
    for st in states:
        _settle_attrs(st, module_tensor)
        _settle_params(st)
        _settle_buffers(st, needs_grad)


def _settle_attrs(st, module_tensor):
    m, now = st.module, _plain_attrs(st.module)
    for k, v in now.items():
        if st.attrs.get(k, _MISSING) is not v and holds(v, is_proxy):
            real = _as_module_tensors(v, module_tensor)
            if real is not _MISSING:  # references to parameters/buffers (nn.RNN's _flat_weights): eager's value
                m.__dict__[k] = real
                continue
            _put_back(st)
            old = _old_reparametrization(m, k)
            if old is not None:
                raise TracingError(
                    f"{st.where} uses the deprecated torch.nn.utils.{old}, whose forward pre-hook assigns "
                    f"{st.where}.{k} a tensor computed on every call: a compiled program cannot replay that assignment. "
                    f"Use torch.nn.utils.parametrizations.{old} instead (torch's replacement; compiled functions support "
                    f"it): remove the old one with torch.nn.utils.remove_{old}(module) first.")
            if _pruned(m, k):
                raise TracingError(
                    f"{st.where} is pruned with torch.nn.utils.prune, whose forward pre-hook assigns {st.where}.{k} = "
                    f"{k}_orig * {k}_mask as a plain attribute on every call: a compiled program cannot replay that "
                    f"assignment. Apply the mask with a parametrization instead (compiled functions support it): "
                    f"torch.nn.utils.prune.remove(module, {k!r}), then torch.nn.utils.parametrize.register_parametrization("
                    f"module, {k!r}, M) with an nn.Module M holding the mask as a buffer and returning `w * self.mask` "
                    "(update the mask in place between steps to prune further).")
            raise TracingError(
                f"the function sets {st.where}.{k} to a value computed inside the compiled function (a tensor, or "
                "a number from .item()): a module "
                "attribute assigned while tracing would hold a placeholder and change only once. Register it as a "
                f"buffer (self.register_buffer({k!r}, ...)) so the program updates it on every call, or return the "
                "value and set it outside the compiled function."
            )


def _old_reparametrization(m, name):
    """``"weight_norm"``/``"spectral_norm"`` when ``name`` is computed by that deprecated hook on ``m`` (else None)."""
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for h in m._forward_pre_hooks.values():
        if getattr(h, "name", None) == name:
            if isinstance(h, WeightNorm):
                return "weight_norm"
            if isinstance(h, SpectralNorm):
                return "spectral_norm"
    return None


def _pruned(m, name) -> bool:
    """Whether a torch.nn.utils.prune forward pre-hook on ``m`` computes the attribute ``name``."""
    from torch.nn.utils.prune import BasePruningMethod

    return any(isinstance(h, BasePruningMethod) and getattr(h, "_tensor_name", None) == name
               for h in m._forward_pre_hooks.values())


def _as_module_tensors(v, module_tensor):
    """``v`` with each proxy replaced by the module tensor it stands for; _MISSING if one is computed."""
    if is_proxy(v):
        t = module_tensor(v)
        return _MISSING if t is None else t
    if type(v) in (list, tuple):
        items = [_as_module_tensors(x, module_tensor) for x in v]
        return _MISSING if any(x is _MISSING for x in items) else type(v)(items)
    if type(v) is dict:
        items = {k: _as_module_tensors(x, module_tensor) for k, x in v.items()}
        return _MISSING if any(x is _MISSING for x in items.values()) else items
    return _MISSING if holds(v, is_proxy) else v


def _settle_params(st):
    m = st.module
    if m._parameters.keys() != st.params.keys() or any(m._parameters[k] is not v for k, v in st.params.items()):
        name = next((k for k in m._parameters.keys() | st.params.keys()
                     if m._parameters.get(k, _MISSING) is not st.params.get(k, _MISSING)), "?")
        _put_back(st)
        raise TracingError(
            f"the function replaces, adds or removes the parameter {st.where}.{name}: that would happen once, while "
            "tracing. Change parameters in place (with torch.no_grad(): p.copy_(...)) or outside the compiled function."
        )


def _settle_buffers(st, needs_grad):
    m = st.module
    for name in m._buffers.keys() | st.buffers.keys():
        old, new = st.buffers.get(name, _MISSING), m._buffers.get(name, _MISSING)
        if new is old:
            continue
        problem = None
        if old is _MISSING or old is None or new is _MISSING or new is None:
            problem = "registers, removes or sets to None the buffer"
        elif not is_proxy(new):
            problem = "sets to a tensor that is not computed from the function's inputs the buffer"
        elif (tuple(new.shape), new.dtype, new.device) != (tuple(old.shape), old.dtype, old.device):
            problem = (f"gives a {new.dtype} {tuple(new.shape)} value on {new.device} (it holds "
                       f"{old.dtype} {tuple(old.shape)} on {old.device}) to the buffer")
        elif torch.is_grad_enabled() and needs_grad(new):
            problem = "assigns a value that requires grad (detach it, as eager would keep its graph alive) to the buffer"
        if problem:
            _put_back(st)
            raise TracingError(
                f"the function {problem} {st.where}.{name}: thunder_train updates a reassigned buffer in place on "
                "every call, which needs the same shape, dtype and device and no autograd history. Do this outside "
                "the compiled function, or keep the buffer's shape."
            )
        m._buffers[name] = old
        with torch.no_grad():
            old.copy_(new)  # recorded in the program: a write-back into the real buffer on every call


def _put_back(st):
    """Leave no proxy behind on a module the function changed (the walker restores parameters and buffers)."""
    m = st.module
    for k in [k for k in _plain_attrs(m) if k not in st.attrs]:
        del m.__dict__[k]
    m.__dict__.update(st.attrs)
    for reg, before in ((m._parameters, st.params), (m._buffers, st.buffers)):
        reg.clear()
        reg.update(before)
