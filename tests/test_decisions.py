"""Python decisions on input values are specialised by the prologue, not refused (compiler/acquisition/decisions.py).

Every case is compared with eager PyTorch on inputs that decide both ways.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.torchlang.tensor_methods import DataDependentError


def masked_scale(x, mask):
    if (mask == 1).all():  # HF's "is the attention mask all ones?" test
        return x * 2
    return x * mask.unsqueeze(-1) * 3


def any_padding(x, mask):
    out = x.sum(-1)
    if mask.any():
        out = out - mask.sum()
    return out


def item_branch(x, y):
    if (y.sum().item() > 0):
        return x + 1
    return x - 1


def trimmed(x, lengths):
    return x[:, :int(lengths.max())].sum(1)


def masks():
    ones = torch.ones(3, 5, dtype=torch.long)
    padded = ones.clone()
    padded[1, 3:] = 0
    return ones, padded


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_decision_on_an_input_mask_specialises_and_retraces_with_the_decision_as_reason(thin):
    cf = tt.compile(masked_scale, thin=thin)
    x = torch.randn(3, 5, 4)
    ones, padded = masks()
    for mask in (ones, ones, ones, padded, padded, padded, ones, padded):
        torch.testing.assert_close(cf(x, mask), masked_scale(x, mask))
    stats = tt.compile_stats(cf)
    assert stats.entries == 2
    [reason] = stats.retrace_reasons
    assert "bool(tensor) at test_decisions.py" in reason and "if (mask == 1).all()" in reason
    assert "was True, now False" in reason
    if thin:
        # The decision is checked on every thin call; one going the other way switches to the other entry's
        # binding or takes the full path (issue 26), it drops no binding.
        assert stats.thin_calls >= 1 and not stats.thin_invalidations
    # The prologue computes the decision (printed in guard_key).
    assert "decision" in str(tt.last_prologue_traces(cf)[1])


@pytest.mark.parametrize("fn,make", [
    (any_padding, lambda i: (torch.randn(3, 5), masks()[i % 2])),
    (item_branch, lambda i: (torch.randn(4), torch.randn(3) + (2.0 if i % 2 else -2.0))),
    (trimmed, lambda i: (torch.randn(2, 6, 3), torch.tensor([2, 3 + i % 3]))),
], ids=["any", "item", "int_slice"])
@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_decisions_of_every_kind_follow_eager(fn, make, thin):
    cf = tt.compile(fn, thin=thin)
    for i in [0, 0, 0, 1, 1, 1, 2, 2, 0]:
        args = make(i)
        torch.testing.assert_close(cf(*args), fn(*args))


def test_a_decision_on_an_intermediate_value_gets_an_entry_per_value():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def fn(x):
        loss = model(x).mean()
        if loss > 0:
            return loss * 2
        return loss

    cf = tt.compile(fn)  # tests/test_intermediate_decisions.py has the whole class
    for x in (torch.randn(3, 4) + 3, torch.randn(3, 4) - 3, torch.randn(3, 4) + 3):
        torch.testing.assert_close(cf(x), fn(x))
    assert tt.compile_stats(cf).entries == 2


def test_a_decision_on_a_random_value_is_a_clear_error():
    def fn(x):
        if torch.rand(()) > 0.5:
            return x
        return -x

    with pytest.raises(DataDependentError, match="random"):
        tt.compile(fn)(torch.randn(3))


def test_decision_with_an_input_updated_in_place_first_reads_the_updated_value():
    def fn(x, mask):
        mask = mask.clone()
        mask[0] = 1
        if mask.all():
            return x * 2
        return x

    cf = tt.compile(fn)
    x = torch.randn(3)
    for m in (torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]), torch.tensor([1, 1, 1])):
        torch.testing.assert_close(cf(x, m), fn(x, m))


@pytest.fixture
def roberta():
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import RobertaConfig, RobertaForSequenceClassification

    cfg = RobertaConfig(vocab_size=60, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=40, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return RobertaForSequenceClassification(cfg).eval()


def test_roberta_sequence_classification_with_an_all_ones_mask_matches_eager(roberta):
    ids = torch.randint(3, 60, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    cm = tt.compile(roberta)
    with torch.no_grad():
        torch.testing.assert_close(cm(ids, attention_mask=mask, return_dict=False)[0],
                                   roberta(ids, attention_mask=mask, return_dict=False)[0], rtol=1e-5, atol=1e-6)


def test_roberta_sequence_classification_with_a_padding_mask_matches_eager_and_retraces_on_the_decision(roberta):
    ids = torch.randint(3, 60, (2, 7))
    ones = torch.ones(2, 7, dtype=torch.long)
    padded = ones.clone()
    padded[1, 5:] = 0
    cm = tt.compile(roberta)
    with torch.no_grad():
        for mask in (ones, padded, padded, ones):
            torch.testing.assert_close(cm(ids, attention_mask=mask, return_dict=False)[0],
                                       roberta(ids, attention_mask=mask, return_dict=False)[0], rtol=1e-5, atol=1e-6)
    stats = tt.compile_stats(cm)
    assert stats.entries == 2 and "masking_utils.py" in stats.retrace_reasons[0], stats.retrace_reasons
