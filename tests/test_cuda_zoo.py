"""The model zoo's CUDA subset against eager PyTorch on CUDA: the whole training step in thin mode with the torch
executor, with Inductor fusion, and captured as a CUDA graph.  Skipped where no GPU is present.

Each case: the same model and batches on CUDA, AdamW(fused=True) (its step counters live on the device, which
a CUDA graph needs), 5 steps, losses, final ``state_dict`` and optimizer state compared with eager's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import _zoo
from _zoo import train_step
import thunder_train as tt

pytest.importorskip("transformers")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")]

# Looser than the CPU zoo's 1e-4/1e-5: CUDA kernels (atomics in embedding backward, cuBLAS split-K) are not
# bitwise reproducible even between two eager runs.
RTOL, ATOL = 1e-3, 1e-4
STEPS = 5
MODES = {  # name -> compile options
    "torch": dict(thin=True, fusion=None),
    "inductor": dict(thin=True, fusion="inductor"),
    "graphs": dict(thin=True, fusion=None, cuda_graphs=True),
}
# Fusion compiles Triton kernels per region structure (seconds each): a smaller subset keeps the run short.
CASES = {"torch": ("gpt2", "llama", "bert_cls", "t5", "resnet"), "inductor": ("gpt2", "resnet"),
         "graphs": ("gpt2", "llama", "resnet")}


def to_cuda(batch):
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@pytest.mark.parametrize("mode,name", [(m, n) for m, names in CASES.items() for n in names])
def test_zoo_step_on_cuda(mode, name):
    eager = _zoo.build(name).cuda()
    model = copy.deepcopy(eager)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3, eps=1e-6, fused=True)
    opt_c = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, fused=True)
    data = [to_cuda(b) for b in _zoo.batches(name, STEPS)]
    step = tt.compile(train_step, **MODES[mode])
    for i, b in enumerate(data):
        want = train_step(eager, opt_e, b).detach()
        got = step(model, opt_c, b)
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=lambda m: f"loss of step {i}: {m}")
    g, w = model.state_dict(), eager.state_dict()
    for k in w:
        torch.testing.assert_close(g[k], w[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")
    st = tt.compile_stats(step)
    assert st.thin_calls > 0, st.thin_bind_failures
    if mode == "inductor":
        assert any("Inductor kernel" in n or "reused a kernel" in n for n in st.fusion_notes), st.fusion_notes
    if mode == "graphs":
        assert st.cuda_graph_captures == 1 and st.cuda_graph_replays > 0, st.cuda_graph_notes
