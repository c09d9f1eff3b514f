"""Models, batches and comparisons shared by the whole-training-step tests."""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from gpt import GPT, GPTConfig  # noqa: E402
from _models import without_key_bias  # noqa: E402


def squared_output_step(model, opt, x):
    """A whole training step on the mean squared output: forward, backward, update, zero_grad."""
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def cross_entropy_step(model, opt):
    """``step(x, y)``: a whole classification training step of ``model`` and ``opt`` (cross-entropy, backward,
    update, zero_grad), reading both from its closure."""
    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def loss_step(model, opt, *inputs):
    """A whole training step on a model that returns its loss: forward, backward, update, zero_grad."""
    loss = model(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def fusible_mlp():
    """``mlp`` whose activations have fusion forms (tanh-approximated GELU): a step the background fusion takes."""
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 16),
                         nn.GELU(approximate="tanh"), nn.Linear(16, 4))


def gpt():
    return GPT(GPTConfig(vocab_size=13, block_size=8, n_layer=2, n_head=2, n_embd=16))


def mlp_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)]


def gpt_batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 13, (4, 8), generator=g)
        out.append((x, torch.roll(x, -1, 1)))
    return out


def twin(make_model, make_opt, seed=0):
    torch.manual_seed(seed)
    m1 = make_model()
    m2 = copy.deepcopy(m1)
    return (m1, make_opt(m1.parameters())), (m2, make_opt(m2.parameters()))


def assert_same_state(eager, compiled, atol=1e-6, rtol=1e-5):
    (m1, o1), (m2, o2) = eager, compiled
    names = {id(p): n for n, p in m1.named_parameters()}
    for (n, a), b in zip(m1.named_parameters(), m2.parameters()):
        torch.testing.assert_close(without_key_bias(n, b, m1), without_key_bias(n, a, m1), atol=atol, rtol=rtol, msg=lambda m: f"parameter {n}: {m}")
    for (n, a), b in zip(m1.named_buffers(), m2.buffers()):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol, msg=lambda m: f"buffer {n}: {m}")
    s1, s2 = o1.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    params = [p for g in o1.param_groups for p in g["params"]]
    for k in s1["state"]:
        assert s1["state"][k].keys() == s2["state"][k].keys()
        n = names.get(id(params[k]), "")
        for key, v in s1["state"][k].items():
            torch.testing.assert_close(without_key_bias(n, s2["state"][k][key], m1) if v.ndim else s2["state"][k][key],
                                       without_key_bias(n, v, m1) if v.ndim else v, atol=atol, rtol=rtol, msg=lambda m: f"state {k} {key}: {m}")
