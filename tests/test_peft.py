"""peft's adapters on a tiny Llama (tests/_zoo.py), the whole training step compiled (thin, the torch program)
against eager: AdamW over the adapters' parameters only, a few steps; losses equal eager's, the trained parameters
to AdamW's rounding (the fused update kernel), the frozen weights untouched, the global random stream where
eager's is.  An adapter whose forward branches on a random draw (LoHa's and LoKr's module dropout,
``torch.rand(1) > module_dropout``) is refused while tracing, naming the line.  The adapters' merges and switches
between calls: tests/test_module_reads.py."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import DataDependentError

peft = pytest.importorskip("peft")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _zoo  # noqa: E402

TARGETS = ["q_proj", "v_proj"]
ADAPTERS = {
    "lora": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS),
    "lora with dropout": lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.1),
    "dora": lambda: peft.LoraConfig(r=4, target_modules=TARGETS, use_dora=True),
    "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "prefix tuning": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    "vera": lambda: peft.VeraConfig(r=4, target_modules=TARGETS),
}


def _train(config, compiled: bool, steps=3):
    torch.manual_seed(0)
    model = peft.get_peft_model(_zoo.build("llama"), config)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    step = tt.compile(_zoo.train_step, thin=True, fusion=None) if compiled else _zoo.train_step
    torch.manual_seed(1)
    losses = [step(model, opt, b).detach() for b in _zoo.batches("llama", steps)]
    return losses, dict(model.named_parameters()), frozen, torch.get_rng_state()


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapter_training_step_equals_eager(name):
    (el, ep, _, er), (tl, tp, frozen, tr) = _train(ADAPTERS[name](), False), _train(ADAPTERS[name](), True)
    torch.testing.assert_close(tl, el, rtol=0, atol=0)
    # AdamW divides each update by the gradient's running scale, so where a gradient is near zero a last-bit
    # difference of it (1.5e-8 here: the program's matrix products round as eager's do not always, e.g. with
    # AVX-512 kernels) moves the parameter by up to ~1e-4 of the learning rate: 1.4e-6 at lr 1e-2 on an AVX-512 CPU.
    torch.testing.assert_close({n: p.detach() for n, p in tp.items()}, {n: p.detach() for n, p in ep.items()},
                               rtol=1e-5, atol=1e-5)
    assert frozen and all(torch.equal(tp[n], v) for n, v in frozen.items())
    trained = [n for n, p in tp.items() if p.requires_grad]
    assert trained and len(trained) < len(tp)
    assert torch.equal(tr, er)


@pytest.mark.parametrize("config", [lambda: peft.LoHaConfig(r=4, target_modules=TARGETS),
                                    lambda: peft.LoKrConfig(r=4, target_modules=TARGETS)], ids=["loha", "lokr"])
def test_adapter_branching_on_a_random_draw_is_refused_naming_the_line(config):
    torch.manual_seed(0)
    model = peft.get_peft_model(_zoo.build("llama"), config())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    before, rng = copy.deepcopy(model.state_dict()), torch.get_rng_state()
    with pytest.raises(DataDependentError, match=r"torch\.rand\(1\) > module_dropout"):
        tt.compile(_zoo.train_step, thin=True, fusion=None)(model, opt, _zoo.batches("llama", 1)[0])
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing trained, nothing left behind
    assert torch.equal(torch.get_rng_state(), rng) and not opt.state
