"""Dropout: ``F.dropout`` (a symbol); channel dropout (dropout2d/3d), alpha dropout outside training and
``native_dropout_backward``, written as torch calls."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import clang, prims
from .registry import composed, torchsymbol


@torchsymbol(F.dropout, torch.dropout)
def dropout(input, p=0.5, training=True, inplace=False):
    """Dropout with a fresh mask each call; identity when not training or p == 0."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return clang.mul(input, 0.0)
    # As eager computes it on CPU: noise = bernoulli(1 - p) / (1 - p); input * noise (the same random draws).
    noise = prims.div(prims.bernoulli(input, 1.0 - p), 1.0 - p)
    return prims.mul(input, noise)


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def _feature_dropout(batched_ndim, name):
    def fn(input, p=0.5, training=True, inplace=False):
        if p < 0 or p > 1:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0:
            return input
        if input.ndim not in (batched_ndim - 1, batched_ndim):
            raise NotImplementedError(f"{name} of a {input.ndim}-d input is run by torch")
        lead = 2 if input.ndim == batched_ndim else 1
        mask_shape = tuple(input.shape[:lead]) + (1,) * (input.ndim - lead)
        # made from input: a factory without a tensor argument would run eagerly here (inside the dispatcher no
        # torch-function mode is active), and a random mask drawn once would be a constant of the program
        mask = F.dropout(input.new_ones(mask_shape), p, True)
        out = input * mask
        return input.copy_(out) if inplace else out

    return fn


composed("dropout2d", _feature_dropout(4, "dropout2d"), (F.dropout2d,))
composed("dropout3d", _feature_dropout(5, "dropout3d"), (F.dropout3d,))


def feature_alpha_dropout(input, p=0.5, training=False, inplace=False):
    if training and p != 0:
        raise NotImplementedError("feature_alpha_dropout in training is run by torch")
    return input


composed("feature_alpha_dropout", feature_alpha_dropout, (F.feature_alpha_dropout,))


def alpha_dropout(input, p=0.5, training=False, inplace=False):
    if training and p != 0:
        raise NotImplementedError("alpha_dropout in training is run by torch")
    return input


composed("alpha_dropout", alpha_dropout, (F.alpha_dropout,))


def native_dropout_backward(grad_output, mask, scale):
    return grad_output * mask.to(grad_output.dtype) * scale


composed("native_dropout_backward", native_dropout_backward, (torch.ops.aten.native_dropout_backward.default,
                                                          torch.ops.aten.native_dropout_backward))
