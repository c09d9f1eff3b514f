"""``F.pad``: the constant mode is a symbol (one ``prims.pad``); reflect, replicate and circular are an
``index_select`` of computed source positions per padded dimension, written as torch calls."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import prims
from .helpers import as_eager_allocates
from .registry import composed, direct, torchsymbol


@torchsymbol(F.pad, name="pad")
def constant_pad(input, pad, mode="constant", value=None):
    if mode != "constant":
        raise NotImplementedError(f"F.pad(mode={mode!r}) is not supported; only 'constant'")
    pad = tuple(pad)
    cfg = [(0, 0, 0)] * input.ndim_
    for i in range(len(pad) // 2):
        d = input.ndim_ - 1 - i
        cfg[d] = (pad[2 * i], pad[2 * i + 1], 0)
    return prims.pad(input, 0 if value is None else value, tuple(cfg))


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def _pad_index(n, left, right, mode, device):
    """Source positions of the padded dimension (a few index lines, whatever its length)."""
    if mode == "circular":
        # Eager first crops by the negative pads, then wraps around what is left (the core), not the input.
        lo, core = max(-left, 0), n - max(-left, 0) - max(-right, 0)
        i = torch.arange(-max(left, 0), core + max(right, 0), device=device)
        return torch.remainder(i, core) + lo
    i = torch.arange(-left, n + right, device=device)
    if mode == "reflect":
        return (n - 1) - torch.abs((n - 1) - torch.abs(i)) if n > 1 else torch.zeros_like(i)
    return torch.clamp(i, 0, n - 1)  # replicate


def pad(input, pad, mode="constant", value=None):
    if mode == "constant":
        return direct(constant_pad, input, pad, mode, value)
    if mode not in ("reflect", "replicate", "circular"):
        raise NotImplementedError(f"F.pad(mode={mode!r}) is run by torch")
    pad = tuple(pad)
    k = len(pad) // 2
    if len(pad) % 2 or k not in (1, 2, 3) or input.ndim not in (k + 1, k + 2):
        raise NotImplementedError("this padding form is run by torch (eager checks it)")  # eager's combinations
    out = input
    for i in range(len(pad) // 2):
        d = input.ndim - 1 - i
        left, right = pad[2 * i], pad[2 * i + 1]
        n = input.shape[d]
        if mode == "reflect" and (left >= n or right >= n):
            raise NotImplementedError("reflect padding as large as the input is run by torch (eager raises)")
        core = n - max(-left, 0) - max(-right, 0)
        if mode == "circular" and (core <= 0 or left > core or right > core):
            raise NotImplementedError("circular padding larger than the cropped input is run by torch (eager raises)")
        if n == 0:
            raise NotImplementedError("padding an empty dimension is run by torch")
        if left or right:
            out = torch.index_select(out, d, _pad_index(n, left, right, mode, input.device))
    # eager's reflect and replicate kernels write a channels_last batch's result channels_last; circular padding's
    # (a composite of copies) is row-major, as the selections give it
    return out if mode == "circular" or out is input or input.ndim != k + 2 else as_eager_allocates(out, input)


composed("pad", pad, (F.pad, torch._C._nn.pad), (), sym=constant_pad)


def constant_pad_nd(input, pad, value=0):
    return direct(constant_pad, input, pad, "constant", value)


composed("constant_pad_nd", constant_pad_nd, (torch.constant_pad_nd,))
