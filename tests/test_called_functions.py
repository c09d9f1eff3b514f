"""A library's module-level function replaced after the first call: eager runs the new one, so must the program.

transformers' Llama calls ``modeling_llama.apply_rotary_pos_emb`` (through a hub-kernel wrapper it keeps under that
name), which calls ``rotate_half``; its loss calls ``loss_utils.fixed_cross_entropy``.  A kernel-patching library
applied after the first call, or a notebook's monkeypatch, rebinds such a name.  Library code is not scanned for
the names it reads (acquisition/captured.py), so every mode ran the traced function, silently; now the functions that
ran torch ops while tracing are guarded by name in their module (acquisition/called_functions.py).
"""
from __future__ import annotations

import copy

import pytest
import torch

import _zoo
import thunder_train as tt

modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")
loss_utils = pytest.importorskip("transformers.loss.loss_utils")


def _no_rotation(q, k, cos, sin, *args, **kwargs):
    return q, k


def _half_rotation(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1) * 0.5


def _scaled_loss(*args, **kwargs):
    return _original_loss(*args, **kwargs) * 3


_original_loss = loss_utils.fixed_cross_entropy


@pytest.mark.parametrize("thin", [True, False], ids=["thin", "full"])
@pytest.mark.parametrize("patch", ["apply_rotary_pos_emb", "rotate_half", "fixed_cross_entropy"])
def test_a_library_function_replaced_after_the_first_call(thin, patch, monkeypatch):
    eager = _zoo.build("llama")
    compiled = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-3)
    step = tt.compile(_zoo.train_step, thin=thin)
    for i, batch in enumerate(_zoo.batches("llama", 5)):
        if i == 2:
            module, new = {"apply_rotary_pos_emb": (modeling_llama, _no_rotation),
                           "rotate_half": (modeling_llama, _half_rotation),
                           "fixed_cross_entropy": (loss_utils, _scaled_loss)}[patch]
            monkeypatch.setattr(module, patch, new)
        torch.testing.assert_close(step(compiled, opt_c, batch), _zoo.train_step(eager, opt_e, batch).detach())
        for p, q in zip(eager.parameters(), compiled.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)  # (the zoo's tolerance: AdamW's order of ops)
    reasons = " ".join(map(str, tt.compile_stats(step).retrace_reasons))
    assert f"{patch} was replaced after compiling" in reasons, reasons
