"""Spectral ops (``torch.fft.*``, ``stft``, ``istft``) run through torch (opaquely; their gradients, complex ones
included, by torch's autograd: ``transforms/opaque_grad.py``).  What is declared here: output rules for those torch
cannot run on meta tensors."""
from __future__ import annotations

import torch

from ..opaque import meta_rule


# ``istft`` checks its window's overlap with ``aten::equal``, which has no meta kernel: the output's metadata from
# the arguments (ATen's SpectralOps.cpp: frames overlap-added, then the centre padding trimmed or ``length`` kept).
@meta_rule(torch.istft, torch.Tensor.istft)
def _istft_meta(input, n_fft, hop_length=None, win_length=None, window=None, center=True, normalized=False,
                onesided=None, length=None, return_complex=False):
    if not input.dtype.is_complex or input.ndim not in (2, 3):
        raise RuntimeError(f"istft: expected a 2-d or 3-d complex input, got a {input.ndim}-d {input.dtype} tensor")
    hop = n_fft // 4 if hop_length is None else hop_length
    n_frames = input.shape[-1]
    if length is None:
        length = n_fft + hop * (n_frames - 1) - (2 * (n_fft // 2) if center else 0)
    dtype = input.dtype if return_complex else input.real.dtype
    out = torch.empty(input.shape[:-2] + (length,), dtype=dtype, device="meta")
    grad = input.requires_grad or (window is not None and window.requires_grad)
    return out.requires_grad_() if grad else out
