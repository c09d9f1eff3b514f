"""Issue 26: zoo models' whole training steps with a new sequence length or batch size on later calls.

The default (automatic dynamic shapes) makes the sizes that changed symbolic at the first change and reuses that
program for every later size; thin mode keeps running thin across them.  Each step is compared with eager
(loss, parameters after the optimizer step), and the number of traces is asserted.  A few zoo models only (the
decoders people fine-tune with dynamic padding, an encoder with a padding mask and a torch.nn RNN), to keep the
file fast; tests/test_zoo.py runs every zoo model at one size.

``test_every_zoo_model_across_lengths_and_batch_sizes`` runs every zoo model (tests/_zoo.py) the same way, full and
thin, with its batch maker at each size.  Slow (minutes on 2 cores): everything but GPT-2's thin run runs only with
THUNDER_TRAIN_SLOW_TESTS=1 set, e.g.
``THUNDER_TRAIN_SLOW_TESTS=1 PYTHONPATH=$PWD python -m pytest -q tests/test_dynamic_zoo.py``.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import thunder_train as tt
import _zoo
from _zoo import VOCAB, build, train_step

slow = pytest.mark.skipif(not os.environ.get("THUNDER_TRAIN_SLOW_TESTS"),
                          reason="slow zoo test: set THUNDER_TRAIN_SLOW_TESTS=1 to run it")

# (batch, sequence length): 3 lengths and 2 batch sizes, the first size repeated (optimizer state created).
SHAPES = [(2, 12), (2, 12), (2, 9), (2, 15), (3, 15), (3, 9), (3, 12), (2, 9)]


def lm(g, B, T):
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def padded_lm(g, B, T):
    batch = lm(g, B, T)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :3] = 0
    batch["labels"][mask == 0] = -100
    return {**batch, "attention_mask": mask}


def cls(g, B, T):
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T - 4:] = 0
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (B,), generator=g)}


# model -> (batch maker, traces, thin calls of the thin run, whether its sizes stay symbolic).
# Traces: the first size; the optimizer state created; the length made symbolic; the batch size made symbolic.
# Llama's mask code decides on the batch size (``shape[0] == 3``): a fifth program for the other answer.  The LSTM
# cannot be traced with a symbolic length (its op needs concrete sizes): the function specialises again, one
# program per shape, and still equals eager.
# Llama's count varied between runs (4 or 5 traces, 1 or 2 thin calls): which decision its mask code records
# differed; the values equal eager's either way.
# BERT on the runtime layout (after the ops and memory merges) also records a size check on a slice length over
# the batch (``((B - 0) + 1 - 1) // 1 == 3``): a fifth program; where it comes from is not pinned down yet.
CASES = {"gpt2": (lm, (4,), (2,), True), "llama_padded": (padded_lm, (4, 5), (1, 2), True), "bert_cls": (cls, (4, 5), (1, 2), True),
         "lstm": (lm, (7,), None, False)}
# Full and thin for GPT-2, one mode for the others (each case traces 4-7 programs: seconds each).
# GPT-2's thin run, the dynamic-padding case of issue 26, runs in CI (~5 s); the others with THUNDER_TRAIN_SLOW_TESTS=1.
RUNS = [pytest.param("gpt2", False, marks=slow), ("gpt2", True), pytest.param("llama_padded", True, marks=slow),
        pytest.param("bert_cls", True, marks=slow), pytest.param("lstm", False, marks=slow)]


@pytest.mark.parametrize("name, thin", RUNS, ids=["gpt2-full", "gpt2-thin", "llama_padded-thin", "bert_cls-thin", "lstm-full"])
def test_zoo_step_across_lengths_and_batch_sizes(name, thin):
    make, traces, thin_calls, symbolic = CASES[name]
    m1 = build(name)
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (m1, m2))
    step = tt.compile(train_step, thin=thin)
    g = torch.Generator().manual_seed(0)
    for B, T in SHAPES:
        batch = make(g, B, T)
        torch.testing.assert_close(step(m2, o2, batch), train_step(m1, o1, batch).detach(), atol=1e-5, rtol=1e-4)
        for a, b in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    st = tt.compile_stats(step)
    assert st.cache_misses in traces, st.retrace_reasons
    assert "symbolic from now on" in st.retrace_reasons[1]
    if symbolic:
        assert "dim 0" in st.retrace_reasons[2]
    else:
        assert st.retrace_reasons[2].startswith("sizes specialised again: tracing with symbolic sizes failed")
    if thin:
        assert st.thin_calls in thin_calls


def zoo_batch(name, g, B, T):
    """The zoo case's own batch (tests/_zoo.py) with ``B`` rows of ``T`` tokens: its makers read ``BATCH`` and ``SEQ``
    (audio and images keep their lengths: only the batch size changes)."""
    saved = _zoo.BATCH, _zoo.SEQ
    _zoo.BATCH, _zoo.SEQ = B, T
    try:
        return _zoo.CASES[name].batch(g)
    finally:
        _zoo.BATCH, _zoo.SEQ = saved


# Traces of every zoo model over SHAPES (full and thin alike, each count seen on this branch): the first size, the
# optimizer state, the length made symbolic, the batch size made symbolic.  ViT, ResNet and wav2vec2 keep their image
# or audio sizes (only the batch size changes: 3).  TransformerEncoder's mask code decides on the batch size (a
# fourth program).  GRU and LSTM cannot be traced with symbolic sizes (their op needs concrete sizes): one program per
# shape (7) and one for the optimizer state.  Where a decision on a mask or on the experts hit can go either way
# (as in test_zoo_step_across_lengths_and_batch_sizes), one or two more programs are allowed.
ZOO_TRACES = {"bert_cls": (4, 5), "bloom": (4,), "falcon": (4,), "gpt2": (4,), "gru": (8,), "llama": (4,),
              "llama_padded": (4, 5), "lstm": (8,), "mistral": (4,), "mixtral": (4, 5, 6), "qwen2": (4,), "resnet": (3,),
              "roberta_cls": (4, 5), "t5": (4,), "transformer_encoder": (4,), "vit": (3,), "wav2vec2_ctc": (4,)}
FIXED_LENGTH = {"transformer_encoder": 12}  # learned positions of exactly SEQ tokens (eager refuses other lengths)


@slow
@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("name", sorted(_zoo.CASES))
def test_every_zoo_model_across_lengths_and_batch_sizes(name, thin):
    m1 = build(name)
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-6) for m in (m1, m2))
    step = tt.compile(train_step, thin=thin)
    g = torch.Generator().manual_seed(0)
    for B, T in SHAPES:
        batch = zoo_batch(name, g, B, FIXED_LENGTH.get(name, T))
        torch.testing.assert_close(step(m2, o2, batch), train_step(m1, o1, batch).detach(), atol=1e-5, rtol=1e-4)
        for a, b in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
        for a, b in zip(m1.buffers(), m2.buffers()):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    st = tt.compile_stats(step)
    assert st.cache_misses in ZOO_TRACES[name], (st.cache_misses, st.retrace_reasons)
