"""Output rules (``opaque.meta_rule``) for torch ops that run opaquely and have no meta kernel, of families without a
module of their own: torch.distributions' Dirichlet sampler and its gradient, and fake quantization; the clear
refusal of packed sequences (``pack_padded_sequence`` / ``pad_packed_sequence``), whose sizes ``lengths`` decides;
and the scratch memory of ``torch.histc``'s CPU kernel (``opaque.scratch_rule``).

Each output is shaped like the op's first input and requires grad as eager's does.  At run time torch computes it
(and, on the gradient path, differentiates it: ``transforms/opaque_grad.py``); torch tags the sampler random, so it
draws from the generator in the program's order.
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedOpError
from ..opaque import meta_rule, scratch_rule


def _like(input, *others):
    return torch.empty_like(input, device="meta").requires_grad_(any(t.requires_grad for t in (input, *others)))


# Beta(a, b).sample() and Dirichlet(c).sample()/rsample(): torch defines no derivative for them (a backward through
# the sampler itself is eager's error; Dirichlet.rsample's gradient is _dirichlet_grad, called by its Function).
@meta_rule(torch._sample_dirichlet)
def _sample_dirichlet_meta(input, generator=None):
    return _like(input)


@meta_rule(torch._dirichlet_grad)
def _dirichlet_grad_meta(x, alpha, total):
    return _like(x, alpha, total)


# Quantization-aware training: torch.ao.quantization.FakeQuantize calls these (the straight-through gradient is
# torch's).  The output requires grad like the input (scale and zero point carry none).
@meta_rule(torch.fake_quantize_per_tensor_affine)
def _fake_quantize_per_tensor_meta(input, scale, zero_point, quant_min, quant_max):
    return _like(input)


@meta_rule(torch.fake_quantize_per_channel_affine)
def _fake_quantize_per_channel_meta(input, scale, zero_point, axis, quant_min, quant_max):
    return _like(input)


# Packed sequences: the packed data has sum(lengths) rows and ``batch_sizes`` (a CPU tensor) counts the sequences still
# running at each step, so every size depends on the values of ``lengths``; torch's kernels take them as CPU tensors
# and have no meta form.  Refused with what to do (not the generic "run on meta tensors failed" advice).
_PACKED = ("{what} inside a compiled function is not supported: the packed sequence's sizes (sum(lengths) rows, "
           "batch_sizes) depend on the values of `lengths`, which torch's kernels read on the CPU. Call "
           "pack_padded_sequence, the RNN and pad_packed_sequence outside the compiled function (compile the layers "
           "before and after them), or run a unidirectional RNN on the padded batch and pick each sequence's last valid "
           "step (`out[torch.arange(len(lengths)), lengths - 1]`; its outputs at valid steps are the packed run's). "
           "Nothing was changed.")


@meta_rule(torch._pack_padded_sequence)
def _pack_padded_sequence_refused(input, lengths, batch_first):
    raise UnsupportedOpError(_PACKED.format(what="torch.nn.utils.rnn.pack_padded_sequence"))


@meta_rule(torch._pad_packed_sequence)
def _pad_packed_sequence_refused(data, batch_sizes, batch_first, padding_value, total_length):
    raise UnsupportedOpError(_PACKED.format(what="torch.nn.utils.rnn.pad_packed_sequence"))


# histc (mixture-of-experts routers count their tokens per expert with it): the CPU kernel allocates the bins' edges
# and one histogram per thread of torch's pool, and frees them inside the call (measured with 1 and 2 threads and with
# the range given or found, where it finds the range its two bounds too).  A strided input is copied first and its
# range found by a reduction: unknown.  The pool's size is read when the program is planned.
@scratch_rule(torch.histc)
def _histc_scratch(input, bins=100, min=0, max=0, *, out=None):
    if out is not None or type(bins) is not int or input._tt_device.type != "cpu" or not input._tt_rowmajor:
        return None
    size = input._tt_dtype.torch.itemsize
    found = not (type(min) in (int, float) and type(max) in (int, float) and min != max)  # the range from the values
    return (bins + 1 + torch.get_num_threads() * bins + (2 if found else 0)) * size
