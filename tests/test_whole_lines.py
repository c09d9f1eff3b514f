"""Lines a fused program compiles whole (executors/whole_lines.py): eager's math attention with a learned mask (T5's
position bias) and its backward, each one Inductor kernel.  Compared with eager: losses, parameters and gradients
within the fused programs' tolerance, gradients laid out as eager's; the kernels run (no fallback call); and where
Inductor cannot compile such a line it stays on torch (op by op, as the torch program runs it), with a note saying why."""
from __future__ import annotations

import copy
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _inductor import cxx_available  # noqa: E402
from test_eager_kernel_choice import LearnedBiasAttention, _step, masked_attention_step  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train.compiler.executors import attention_math, inductor_fusion  # noqa: E402

pytestmark = pytest.mark.skipif(not cxx_available(), reason="Inductor's CPU backend needs a C++ compiler (none found)")
TOL = dict(rtol=1e-5, atol=1e-6)


def _compiled_lines(cf) -> list:
    return re.findall(r"^\s*# (inductor_line_\d+): \w+ compiled whole by Inductor$", str(tt.last_traces(cf)[-1]), re.M)


def _why(cf) -> str:
    """What a failed assertion shows: the fusion notes and the attention lines of the last trace."""
    lines = [ln for ln in str(tt.last_traces(cf)[-1]).splitlines() if "sdpa" in ln or "inductor_line" in ln]
    return "\n".join(tt.compile_stats(cf).fusion_notes + lines + [tt.last_traces(cf)[-1].header])


def _train_both(bias_shape, thin, steps=3):
    """The fused step against eager's, ``steps`` steps: losses and parameters after each; the compiled function."""
    torch.manual_seed(0)
    me = LearnedBiasAttention(bias_shape)
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))
    cf = tt.compile(_step, thin=thin, fusion="inductor")
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(2, 12, 32, generator=g), torch.randn(2, 12, 32, generator=g)
        torch.testing.assert_close(cf(mc, oc, x, y), _step(me, oe, x, y), **TOL, msg=lambda m: f"loss {i}: {m}")
        for (name, pe), pc in zip(me.named_parameters(), mc.parameters()):
            torch.testing.assert_close(pc, pe, **TOL, msg=lambda m: f"step {i} {name}: {m}")
    return cf


@pytest.mark.parametrize("thin", [True, False])
@pytest.mark.parametrize("bias_shape", [(1, 4, 12, 12), (2, 4, 12, 12), (12, 12), (4, 1, 12)])
def test_learned_mask_attention_steps_as_eager(bias_shape, thin):
    cf = _train_both(bias_shape, thin)
    text = str(tt.last_traces(cf)[-1])
    assert "sdpa_math_with_probs compiled whole" in text and "sdpa_math_backward compiled whole" in text, text
    assert not [ln for ln in text.splitlines() if "= ttex.sdpa_math" in ln and not ln.lstrip().startswith("#")]
    assert tt.compile_stats(cf).fusion_fallback_calls == 0


@pytest.mark.parametrize("wanted", [(0, 1, 2, 3), (2, 3), (0,), (3,)])
def test_gradients_of_the_compiled_lines_are_eagers(wanted):
    # Some of the four differentiated: each set of gradients is its own kernel.
    f = masked_attention_step
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(*s, generator=gen) for s in ((2, 5, 3, 4), (2, 7, 3, 4), (2, 7, 3, 6), (1, 3, 5, 7), (2, 3, 5, 6))]
    eager, compiled = ([t.clone().requires_grad_(i in wanted or i == 3) for i, t in enumerate(inputs)] for _ in range(2))
    want = f(*eager)
    cf = tt.compile(f, fusion="inductor")
    got = cf(*compiled)
    torch.testing.assert_close(got, want, **TOL)
    assert got[1].stride() == want[1].stride()
    for i, (a, b) in enumerate(zip(eager[:4], compiled[:4])):
        assert (a.grad is None) == (b.grad is None), i
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, **TOL, msg=lambda m: f"gradient {i}: {m}")
            assert b.grad.stride() == a.grad.stride(), i
    assert len(_compiled_lines(cf)) == 2, _why(cf)
    assert tt.compile_stats(cf).fusion_fallback_calls == 0


def test_a_line_inductor_cannot_compile_stays_on_torch(monkeypatch):
    compile_region = inductor_fusion._compile_region

    def refuse_attention(bsyms, inputs, outputs):
        if getattr(bsyms[0].sym, "fn", None) in (attention_math.sdpa_math_with_probs, attention_math.sdpa_math_backward):
            raise RuntimeError("this attention is not compiled here")
        return compile_region(bsyms, inputs, outputs)

    monkeypatch.setattr(inductor_fusion, "_compile_region", refuse_attention)
    monkeypatch.setattr(inductor_fusion, "_kernels", type(inductor_fusion._kernels)())  # no kernel compiled before
    monkeypatch.setattr(inductor_fusion, "_failed", {})
    cf = _train_both((1, 4, 12, 12), thin=True, steps=2)
    text = str(tt.last_traces(cf)[-1])
    assert "compiled whole" not in text
    assert "= ttex.sdpa_math_with_probs(" in text and "= ttex.sdpa_math_backward(" in text
    notes = tt.compile_stats(cf).fusion_notes
    assert any("sdpa_math_with_probs left to torch: Inductor failed: RuntimeError: this attention" in n for n in notes), notes


def test_switching_the_math_kernel_off_raises_eagers_error():
    # Eager's only kernel for a mask requiring grad is the math one: switched off after compiling, eager raises, and
    # so does the fused step: the compiled kernel asks the switch before each call (``whole_guard``; no check of the
    # program's sees it) and leaves the call to the line's own function, which raises eager's error.
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    me = LearnedBiasAttention((1, 4, 12, 12))
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))
    cf = tt.compile(_step, thin=True, fusion="inductor")
    x, y = torch.randn(2, 12, 32), torch.randn(2, 12, 32)
    for _ in range(2):
        cf(mc, oc, x, y)
    assert _compiled_lines(cf), _why(cf)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        with pytest.raises(RuntimeError, match="No available kernel"):
            _step(me, oe, x, y)
        with pytest.raises(RuntimeError, match="No available kernel"):
            cf(mc, oc, x, y)
