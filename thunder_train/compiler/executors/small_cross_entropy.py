"""Cross-entropy of small logits compiled whole in a fused program: the loss and its gradient as one kernel each.

A whole step's cross-entropy runs eager's kernels (saved_statistics.py: ``_log_softmax`` written over the logits, then
``nll_loss_forward``; ``nll_loss_backward`` then ``_log_softmax_backward_data``).  On a classifier's logits (an MLP's
64 x 10) the four calls cost ~20 us a step on their own and several times that inside the step, for a few thousand
flops (each a kernel launch with its checks).  For logits of at most ``SMALL_LOGITS`` elements the fused program
compiles the two lines whole (executors/whole_lines.py) by the functions here: the same arguments and results (the
loss, the log-probabilities, the number of targets counted; the gradient), computed as eager's formulas
(``log_softmax``; the mean of the targets' negative log-probabilities; ``(softmax - one_hot) * g / total``).

A target is matched by comparing it with every class index, never used as an index: a kernel indexing with a target
out of range fails inside Inductor's loops, which ends the process where the loop runs on several threads.  The
forward's count of targets is NaN where a counted target matched no class; its line's ``whole_check`` reads that
count after each kernel call (one number) and, where it is NaN, the line's own function runs, whose kernel raises
eager's ``IndexError``.  The backward line is there only with its forward line in the same program (whole steps,
saved_statistics.py), whose kernel or check has seen the same targets earlier in the call.  Values round as
Inductor's loops round: within the fused programs' tolerances; the torch program keeps eager's kernels.
"""
from __future__ import annotations

import math

import torch

from .. import dtypes
from ..proxies import TensorProxy
from . import saved_statistics

# The largest logits (rows x classes) compiled whole: each kernel compares every target with every class, so its
# work grows with the logits; eager's kernels cost ~20 us on 640 elements, the two compiled ones ~9 us.
SMALL_LOGITS = 16384
_MEAN, _SUM = 1, 2  # aten's reduction codes


def _one_hot(target, classes: int, dtype):
    return (target.unsqueeze(1) == torch.arange(classes, device=target.device)).to(dtype)


def cross_entropy_small(input, target, ignore_index, reduction):
    """``(loss, log-probabilities, number of targets counted)`` as ``cross_entropy_into_logits`` returns them; the
    number is NaN where a counted target is no class index (``classes_matched``)."""
    logp = torch.log_softmax(input, 1)
    counted = target != ignore_index
    hits = _one_hot(target, input.shape[1], input.dtype)
    picked = (logp * hits).sum(1)
    total = counted.sum().to(input.dtype)
    matched = torch.where(counted, hits.sum(1), 0).sum()
    summed = -torch.where(counted, picked, 0).sum()
    return (summed / total if reduction == _MEAN else summed), logp, torch.where(matched == total, total, math.nan)


def cross_entropy_backward_small(g, logp, target, total_weight, ignore_index, reduction):
    """The logits' gradient as ``cross_entropy_backward_into_logp`` returns it (a 1-tuple)."""
    scale = g / total_weight if reduction == _MEAN else g
    grad = (torch.exp(logp) - _one_hot(target, logp.shape[1], logp.dtype)) * scale
    return (torch.where((target != ignore_index).unsqueeze(1), grad, 0),)


def classes_matched(loss, logp, total) -> bool:
    """Whether every counted target of the call was a class index (the count is a number, not NaN)."""
    return not math.isnan(total.item())


def _small(logits, target, reduction) -> bool:
    # CPU only: on a GPU the check's read of the count would wait for the device every step
    return (type(logits) is TensorProxy and type(target) is TensorProxy and logits._tt_device.type == "cpu"
            and len(logits._tt_shape) == 2
            and len(target._tt_shape) == 1 and logits._tt_dtype in (dtypes.float32, dtypes.float64)
            and all(type(s) is int for s in logits._tt_shape) and math.prod(logits._tt_shape) <= SMALL_LOGITS
            and reduction in (_MEAN, _SUM))


def _forward_form(input, target, ignore_index, reduction):
    return cross_entropy_small if _small(input, target, reduction) else None


def _backward_form(g, logp, target, total_weight, ignore_index, reduction):
    return cross_entropy_backward_small if _small(logp, target, reduction) else None


saved_statistics.cross_entropy_into_logits.whole_form = _forward_form
saved_statistics.cross_entropy_backward_into_logp.whole_form = _backward_form
saved_statistics.cross_entropy_into_logits.whole_check = classes_matched
