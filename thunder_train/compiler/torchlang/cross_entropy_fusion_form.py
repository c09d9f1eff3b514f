"""What a fused CUDA program compiles for cross-entropy over class indices (``Symbol.fusion_form``, executors/regions.py).

A language model's loss reads logits of ``rows x vocabulary`` floats.  The torch program runs eager's kernels:
the logits cast to float32, ``log_softmax`` writing a float32 copy, ``nll_loss``; in the backward the softmax
gradient writes another, cast back to the logits' dtype.  On an H200, GPT-2's step (8 x 1024 rows, 50,304 classes,
bf16 autocast) spent ~5 ms of its ~26 ms of device time there.  Written as a log-sum-exp and a gather, the loss is
one row reduction that Inductor fuses with the cast before it; the gradient ``(softmax(x) - onehot) * g / n`` is
one pass that writes its result in the dtype the next line casts it to.  The same function, rounded differently
(within the fused programs' tolerances: tests/test_cross_entropy_fusion_form.py).

Only for what eager's kernels compute the same way: 2-d float32/float64 logits, class-index targets, no class
weights, no label smoothing, ``mean`` or ``sum``.  Only on CUDA: on the CPU the torch program's kernels, by blocks of
rows written over the logits (executors/saved_statistics.py), are already one pass each and bitwise eager's (the
GPT benchmark's fused step, one thread: 507.9 ms with them, 506.4 ms with the forms; paired, session 27).
``DEVICES`` names where the forms apply (tests add ``"cpu"`` to check the forms through Inductor's C++ kernels).

A target outside the classes (not ``ignore_index``): eager's CUDA kernel stops on a device-side assert, and so does
the fused region, whose gather Inductor compiles with its bounds assert (``assert_indirect_indexing``, on by default,
compiles Triton kernels in debug mode).  On the CPU eager raises ``IndexError``; there Inductor's bounds check,
thrown inside its parallel loop, ends the process (seen with the forms switched on for the CPU): one more reason they
stay off there.
"""
from __future__ import annotations

import torch

from .. import dtypes
from ..proxies import TensorProxy

DEVICES = {"cuda"}


def _plain(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing) -> bool:
    return (type(input) is TensorProxy and type(target) is TensorProxy and input._tt_device.type in DEVICES
            and input.ndim_ == 2 and target.ndim_ == 1 and input._tt_dtype in (dtypes.float32, dtypes.float64)
            and target._tt_dtype is dtypes.int64 and weight is None and size_average is None
            and type(ignore_index) is int and reduce is None and reduction in ("mean", "sum")
            and label_smoothing == 0.0)


def cross_entropy_by_logsumexp(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                               reduction="mean", label_smoothing=0.0):
    """Per row ``logsumexp(x) - x[target]`` (0 for ignored rows), summed; ``mean`` divides by the rows not ignored
    (eager's total weight: 0/0 = nan when every row is ignored)."""
    valid = target != ignore_index
    picked = input.gather(1, torch.where(valid, target, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(valid, torch.logsumexp(input, 1) - picked, 0).sum()
    return loss / valid.sum().to(input.dtype) if reduction == "mean" else loss


def cross_entropy_grad_by_softmax(g, reads, input, target, weight=None, size_average=None, ignore_index=-100,
                                  reduce=None, reduction="mean", label_smoothing=0.0):
    """``(softmax(x) - onehot(target)) * g`` (divided by the rows not ignored for ``mean``); 0 on ignored rows."""
    valid = (target != ignore_index).unsqueeze(1)
    p = torch.exp(input - torch.logsumexp(input, 1, keepdim=True))
    onehot = torch.arange(input.shape[1], device=input.device) == target.unsqueeze(1)
    scale = g / valid.sum().to(input.dtype) if reduction == "mean" else g
    return torch.where(valid, (p - onehot.to(input.dtype)) * scale, 0),


def fusion_form(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
                label_smoothing=0.0):
    plain = _plain(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    return cross_entropy_by_logsumexp if plain else None


def fusion_vjp_form(g, reads, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                    reduction="mean", label_smoothing=0.0):
    plain = _plain(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    return cross_entropy_grad_by_softmax if plain and reads == () else None
