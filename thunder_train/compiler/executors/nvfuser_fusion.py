"""Fusion by nvFuser (``fusion="nvfuser"``): CUDA regions, write-backs included, become nvFuser fusions.

Written against nvFuser's ``nvfuser_direct`` API: ``FusionDefinition`` as a context manager,
``fd.define_tensor(sizes=, strides=, dtype=, static_sizes=True)``, ``fd.ops.*``, ``fd.add_output(v)`` and
``fd.add_output(v, alias_input=t)`` (the output is written into the input's buffer and not returned), and
``fd.execute(inputs)``.  nvFuser cannot be installed on the machines this was written on, so only the
translation (which calls are issued) is tested here, with a recording stand-in of the definition
(``tests/test_nvfuser.py``); ``availability()`` says why the executor is off wherever it cannot run.

Regions: fusible lines (the ops tagged ``"fusible"``, as for Inductor) whose op has a translation
(``Symbol.nvfuser_translation``, declared below for the ops of ``_UNARY``/``_BINARY``/...), on CUDA tensors of
static shape, all on one device.  A write-back
(``ttex.copy_(src, dst)``) of a value the region computed joins the region as its last line(s) and is
lowered as ``fd.ops.set(src)`` + ``fd.add_output(..., alias_input=dst)``, so the update lands in ``dst``
inside the fusion with no extra copy.  To keep that safe, a write-back joins only a region without
reductions whose tensors all have ``dst``'s shape (each element is read and written by the same thread).
Every op's result is cast to the dtype eager gives it, so low-precision intermediates round as in eager.

Definitions are cached by structure (ops, constants, input sizes, strides, dtypes, devices, outputs,
write-backs), process-wide.  At run time an input laid out differently from the definition runs the
region's torch lines instead (same values, no speedup).
"""
from __future__ import annotations

import time

import torch

from ..proxies import TensorProxy, is_int, is_proxy
from ..pytree import tree_map
from ..symbols import BoundSymbol
from . import torch_impls
from .regions import MIN_OPS, FusionSymbol, fusible_name, op_names, structure, uses

# ---------------------------------------------------------------------------
# Translations, declared per op (``Symbol.nvfuser_translation``: (kind, nvFuser op)) for the torch-language op and
# the prim of each name below.  A prim's line is translated when it runs the prim's own torch function (or its
# mirror's, with the operands swapped: lt(2, t) runs gt(t, 2)), not a wrapper for a number first.
# ---------------------------------------------------------------------------
_UNARY = ("abs", "neg", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan", "sinh", "cosh",
          "tanh", "asin", "acos", "atan", "sigmoid", "relu", "silu", "sqrt", "rsqrt", "reciprocal", "erf", "erfc",
          "floor", "ceil", "trunc", "sign", "logical_not", "isnan", "isinf", "isfinite")
_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "truediv", "pow": "pow",  # torch div is true division
           "maximum": "maximum", "minimum": "minimum", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt",
           "ge": "ge", "atan2": "atan2", "fmod": "fmod", "remainder": "remainder", "logical_and": "logical_and",
           "logical_or": "logical_or"}
_TERNARY = ("where", "lerp")
_REDUCTION = {"sum": "sum", "amax": "max", "amin": "min"}
_CASTS = ("to", "float", "double", "half", "bfloat16")


def _declare_translations() -> None:
    from .. import prims, torchlang as ltorch

    table = {**{n: ("unary", n) for n in _UNARY}, **{n: ("binary", op) for n, op in _BINARY.items()},
             **{n: ("ternary", n) for n in _TERNARY}, **{n: ("reduction", op) for n, op in _REDUCTION.items()},
             **{n: ("cast", None) for n in _CASTS}}
    for name, translation in table.items():
        getattr(ltorch, name).nvfuser_translation = translation
        prim = prims.convert_element_type if name == "to" else getattr(prims, name, None)
        if prim is not None and prim in _PRIM_TORCH_FN:
            prim.nvfuser_translation = translation


def _prim_torch_fn() -> dict:
    """The torch function the torch executor runs for a prim when its operands come in order (torch_executor.py)."""
    from .. import prims
    from .torch_executor import _ELEMENTWISE_TORCH

    return {**_ELEMENTWISE_TORCH, prims.div: torch.true_divide, prims.convert_element_type: torch.Tensor.to,
            prims.sum: torch.sum, prims.amax: torch.amax, prims.amin: torch.amin, prims.where: torch.where}


def _translation(bsym):
    """(kind, nvFuser op) for a fusible line whose op nvFuser translates, else None."""
    src, fn = bsym.source, bsym.sym.fn
    if not src.is_prim:
        return src.nvfuser_translation
    runs = _PRIM_TORCH_FN
    for prim in (src, src.mirrored):
        if prim is not None and prim.nvfuser_translation is not None and runs.get(prim) is fn:
            return prim.nvfuser_translation
    return None


# ---------------------------------------------------------------------------
# Is nvFuser usable here?
# ---------------------------------------------------------------------------
_status: list = []  # cached (module or None, reason)


def availability():
    """``(nvfuser_direct, None)`` when nvFuser can run here, else ``(None, why)`` (one line)."""
    if not _status:
        _status.append(_probe())
    return _status[0]


def _probe():
    try:
        import nvfuser_direct as nvf
    except ImportError as e:
        if getattr(e, "name", None) == "nvfuser_direct":
            return None, "nvfuser_direct is not installed (pip package nvfuser; wheels exist only for some torch versions)"
        return None, f"nvfuser_direct failed to import with torch {torch.__version__} (built for another torch?): {str(e)[:160]}"
    except Exception as e:  # noqa: BLE001 - an ABI mismatch shows as OSError/RuntimeError
        return None, f"nvfuser_direct failed to import with torch {torch.__version__} (built for another torch?): {type(e).__name__}: {str(e)[:160]}"
    built = getattr(nvf, "_torch_version", None) or getattr(getattr(nvf, "version", None), "_torch_version", None)
    if built and not torch.__version__.startswith(str(built).split("+")[0]):
        return None, f"nvfuser_direct was built for torch {built}, running torch {torch.__version__}"
    if not torch.cuda.is_available():
        return None, "no CUDA device (torch.cuda.is_available() is False)"
    return nvf, None


# ---------------------------------------------------------------------------
# What nvFuser claims
# ---------------------------------------------------------------------------
def _translatable(bsym, device_type: str):
    """(kind, nvFuser op) when nvFuser takes the line, else None."""
    if fusible_name(bsym) is None or bsym.has_side_effect or type(bsym.output) is not TensorProxy:
        return None
    translation = _translation(bsym)
    if translation is None:
        return None
    kind = translation[0]
    if kind == "binary" and (bsym.kwargs.get("alpha", 1) != 1 or bsym.kwargs.get("rounding_mode") is not None):
        return None  # add/sub with a scale, div with rounding: not the plain op
    if kind == "cast" and (set(bsym.kwargs) - {"dtype"} or any(not isinstance(a, torch.dtype) for a in bsym.args[1:])):
        return None
    if kind == "reduction" and bsym.kwargs.get("dtype") is not None:
        return None
    devs = set()
    for x in list(bsym.flat_args()) + [bsym.output]:
        if is_proxy(x) and type(x) is not TensorProxy:
            return None  # a runtime number: not a constant of the definition
        if type(x) is TensorProxy:
            # Row-major tensors only: nvFuser's outputs are contiguous, as eager's are for such inputs.
            if any(type(d) is not int for d in x._tt_shape) or x._tt_device.type != device_type or not x._tt_rowmajor:
                return None
            devs.add(x._tt_device)
    return translation if len(devs) == 1 else None


def _is_write_back(bsym) -> bool:
    return getattr(bsym.sym, "fn", None) is torch_impls.copy_


def fuse_regions(trc, notes: list, *, prefix: str = "nvfuser_fusion", header: str = "Fused by nvFuser", device_type: str = "cuda",
                 nvf=None):
    """A new trace with each region of ≥ MIN_OPS ops nvFuser takes replaced by one fusion call.

    ``nvf`` (tests only) stands in for the ``nvfuser_direct`` module, ``device_type`` for "cuda"."""
    why = None
    if nvf is None:
        nvf, why = availability() if device_type == "cuda" else (None, "nvFuser fuses CUDA tensors only")
    if nvf is None:
        notes.append(f"{prefix}: nvFuser not used: {why}; the torch executor runs these ops")
        return trc
    regions = plan_regions(trc, device_type)
    out, count, failed, reused = [], 0, 0, []
    done = {i for r in regions for i, _ in r.lines}
    first = {r.lines[0][0]: r for r in regions}
    for i, b in enumerate(trc.bound_symbols):
        r = first.get(i)
        if r is not None:
            name = f"{prefix}_{count + failed}"
            fusion = _definition_for(nvf, r)
            if isinstance(fusion, str):
                failed += 1
                notes.append(f"{name}: {len(r.lines)} ops left to torch: nvFuser failed: {fusion}")
                out.extend(b for _, b in r.lines)
            else:
                count += 1
                if fusion.uses:
                    reused.append(name)
                else:
                    notes.append(f"{name}: fused {len(r.lines)} ops ({op_names(r.compute)}"
                                 f"{', %d write-back(s)' % len(r.writes) if r.writes else ''}) into one nvFuser fusion, "
                                 f"defined in {fusion.seconds:.2f} s")
                fusion.uses += 1
                outs = r.outputs[0] if len(r.outputs) == 1 else tuple(r.outputs)
                out.append(BoundSymbol(FusionSymbol(name, fusion.runner), tuple(r.inputs), {}, outs,
                                       tuple(b for _, b in r.lines), f"{name}: {len(r.lines)} ops fused by nvFuser"))
            continue
        if i not in done:
            out.append(b)
    if reused:
        notes.append(f"{prefix}: {len(reused)} region(s) reused a fusion defined for the same structure ({', '.join(reused[:6])})")
    if not regions:
        notes.append(f"{prefix}: nothing fused: no region of ≥ {MIN_OPS} ops nvFuser translates on {device_type} tensors")
    new = trc.derive(f"{header}: {count} region(s)")
    new.bound_symbols = out
    return new


class Region:
    """Consecutive lines nvFuser takes: ``compute`` lines, then ``writes`` (write-backs)."""

    def __init__(self, lines, compute, writes, inputs, outputs):
        self.lines, self.compute, self.writes, self.inputs, self.outputs = lines, compute, writes, inputs, outputs


def plan_regions(trc, device_type: str = "cuda") -> list:
    """The regions of ``trc`` nvFuser would take (consecutive lines; a write-back ends its region)."""
    readers, returned = uses(trc)
    regions, cur, device = [], [], None

    def close():
        if cur:
            r = _region(list(cur), readers, returned)
            if r is not None:
                regions.append(r)
        cur.clear()

    for i, b in enumerate(trc.bound_symbols):
        translation = _translatable(b, device_type)
        in_writes = bool(cur) and _is_write_back(cur[-1][1])
        if translation is not None and not in_writes:
            dev = b.output._tt_device
            if cur and dev != device:
                close()
            device = dev
            cur.append((i, b))
            continue
        if cur and _is_write_back(b) and _may_alias(b, cur):
            cur.append((i, b))
            continue
        close()
    close()
    return regions


def _may_alias(wb, cur) -> bool:
    """A write-back of a region value into a buffer of the same shape as every region tensor, no reductions."""
    src, dst = wb.args[0], wb.args[1]
    compute = [b for _, b in cur if not _is_write_back(b)]
    if not any(b.output is src for b in compute) or any(_is_write_back(b) and b.args[1] is dst for _, b in cur):
        return False
    if type(dst) is not TensorProxy or dst._tt_dtype != src._tt_dtype or dst._tt_device != src._tt_device:
        return False
    for b in compute:
        if _translation(b)[0] == "reduction":
            return False
        for x in list(b.flat_args()) + [b.output]:
            if type(x) is TensorProxy and x._tt_shape != dst._tt_shape:
                return False
    return True


def _region(lines, readers, returned):
    compute = [b for _, b in lines if not _is_write_back(b)]
    writes = [b for _, b in lines if _is_write_back(b)]
    if len(compute) < MIN_OPS:
        return None
    inside = {i for i, _ in lines}
    produced = {id(b.output) for b in compute}
    # Values read after the region or returned (one only read by the write-backs leaves through the alias).
    outputs = [b.output for i, b in lines if id(b.output) in returned or readers.get(id(b.output), set()) - inside]
    if not outputs and not writes:
        return None
    inputs, seen = [], set()
    for _, b in lines:
        for a in b.flat_args():
            if type(a) is TensorProxy and id(a) not in produced and id(a) not in seen and not any(w.output is a for w in writes):
                seen.add(id(a))
                inputs.append(a)
    return Region(lines, compute, writes, inputs, outputs)


# ---------------------------------------------------------------------------
# The definition: one translation per op (define_region), cached by structure
# ---------------------------------------------------------------------------
_DTYPES = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
           torch.int64: "Int", torch.int32: "Int32", torch.bool: "Bool"}


def define_region(fd, region, DataType) -> list:
    """Issue the calls that define ``region`` on ``fd``; returns how to assemble the region's outputs:
    per output ``("fd", k)`` (the k-th returned tensor) or ``("input", i)`` (a write-back's destination)."""
    env = {}
    for p in region.inputs:
        env[id(p)] = fd.define_tensor(sizes=list(p._tt_shape), strides=list(p._tt_strides),
                                      dtype=getattr(DataType, _DTYPES[p._tt_dtype.torch]), static_sizes=True)

    def val(x, shape=None):
        if type(x) is not TensorProxy:
            return x
        v = env[id(x)]
        if shape is not None and tuple(x._tt_shape) != tuple(shape):
            nd, od = len(x._tt_shape), len(shape)
            v = fd.ops.broadcast_in_dim(v, shape=list(shape), broadcast_dims=list(range(od - nd, od)))
        return v

    for b in region.compute:
        (kind, op), out = _translation(b), b.output
        shape = out._tt_shape
        args = b.args
        if kind == "unary":
            v = getattr(fd.ops, op)(val(args[0]))
        elif kind == "binary":
            v = getattr(fd.ops, op)(val(args[0], shape), val(args[1], shape))
        elif kind == "ternary":
            v = getattr(fd.ops, op)(*(val(a, shape) for a in args[:3]))
        elif kind == "reduction":
            x = args[0]
            dims = args[1] if len(args) > 1 else b.kwargs.get("dim", None)
            dims = list(range(len(x._tt_shape))) if dims is None else [dims] if is_int(dims) else list(dims)
            dims = [d % max(len(x._tt_shape), 1) for d in dims]
            keepdim = args[2] if len(args) > 2 else b.kwargs.get("keepdim", False)
            v = getattr(fd.ops, op)(val(x), dims, keepdim)
        else:  # a dtype conversion; the cast below does it
            v = val(args[0])
        env[id(out)] = fd.ops.cast(v, dtype=getattr(DataType, _DTYPES[out._tt_dtype.torch]))
    for w in region.writes:
        fd.add_output(fd.ops.set(env[id(w.args[0])]), alias_input=env[id(w.args[1])])
    plan, k = [], 0
    for o in region.outputs:
        w = next((w for w in region.writes if w.output is o), None)
        if w is not None:
            plan.append(("input", region.inputs.index(w.args[1])))
            continue
        fd.add_output(env[id(o)])
        plan.append(("fd", k))
        k += 1
    return plan


class _Fusion:
    def __init__(self, runner, seconds):
        self.runner, self.seconds, self.uses = runner, seconds, 0


_fusions: dict = {}  # structural key -> _Fusion, or why defining failed (str)


def _definition_for(nvf, region):
    key, _ = structure(region.compute + region.writes, region.outputs)
    key = (key, tuple(p._tt_strides for p in region.inputs))
    fusion = _fusions.get(key)
    if fusion is None:
        t0 = time.perf_counter()
        try:
            with nvf.FusionDefinition() as fd:
                plan = define_region(fd, region, nvf.DataType)
            fusion = _Fusion(_runner(fd, plan, region), time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - any failure: the region runs on torch
            fusion = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
        _fusions[key] = fusion
    return fusion


def _runner(fd, plan, region):
    """The function the trace calls: checks the inputs' layout against the definition, then executes."""
    strides = [tuple(p._tt_strides) for p in region.inputs]
    lines = [b for _, b in region.lines]
    single = len(region.outputs) == 1

    def torch_fallback(*args):
        env = {id(p): a for p, a in zip(region.inputs, args)}
        for b in lines:
            real = lambda a: env[id(a)] if is_proxy(a) else a  # noqa: E731
            env[id(b.output)] = b.sym.fn(*tree_map(real, b.args), **tree_map(real, b.kwargs))
        outs = [env[id(o)] for o in region.outputs]
        return outs[0] if single else tuple(outs)

    def run(*args):
        if [a.stride() for a in args] != strides:
            return torch_fallback(*args)
        if region.writes:  # a failure after a write-back landed must not run the region a second time
            res = fd.execute(list(args))
        else:
            try:
                res = fd.execute(list(args))
            except Exception:  # noqa: BLE001 - nothing was written: the region's torch lines give the values
                return torch_fallback(*args)
        outs = [res[k] if kind == "fd" else args[k] for kind, k in plan]
        return outs[0] if single else tuple(outs)

    return run


_PRIM_TORCH_FN = _prim_torch_fn()
_declare_translations()
