"""``pack_padded_sequence`` / ``pad_packed_sequence`` inside a compiled function: a clear refusal saying what to do
(the packed sizes depend on the values of ``lengths``), nothing changed; and the advice it gives (a unidirectional
RNN on the padded batch, each sequence's last valid step) trains as eager's packed run.

Before, the refusal was the generic "running it on meta tensors failed ... pass arguments of the result's shape",
which does not help (compiler/torchlang/opaque_rules.py)."""
import copy

import pytest
import torch
import torch.nn as nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import thunder_train as tt
from thunder_train.compiler.errors import UnsupportedOpError


class Packed(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, _) = self.rnn(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)
        return self.head(h[-1]).sum() + out.sum()


class Padded(Packed):
    """The advice: the RNN on the padded batch, each sequence's last valid step (equal to the packed run's ``h``)."""

    def forward(self, x, lengths):
        out, _ = self.rnn(x)
        rows = torch.arange(x.shape[0])
        last = out[rows, lengths - 1]
        valid = (torch.arange(x.shape[1])[None, :] < lengths[:, None]).unsqueeze(-1)
        return self.head(last).sum() + (out * valid).sum()


def step(model, opt, x, lengths):
    loss = model(x, lengths)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _inputs():
    torch.manual_seed(0)
    return torch.randn(3, 6, 4), torch.tensor([6, 3, 4])


@pytest.mark.parametrize("mode", ["full", "thin", "module"])
def test_pack_padded_sequence_is_refused_with_what_to_do(mode):
    x, lengths = _inputs()
    m = Packed()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(UnsupportedOpError, match=r"pack_padded_sequence inside a compiled function is not supported.*"
                                                 r"values of `lengths`.*outside the compiled function"):
        if mode == "module":
            step(tt.compile(m), opt, x, lengths)
        else:
            tt.compile(step, thin=mode == "thin")(m, opt, x, lengths)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in m.parameters())
    assert torch.equal(lengths, torch.tensor([6, 3, 4]))


def test_pad_packed_sequence_of_a_sequence_packed_outside_is_refused():
    x, lengths = _inputs()
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    f = tt.compile(lambda data, sizes: pad_packed_sequence(
        torch.nn.utils.rnn.PackedSequence(data * 2, sizes), batch_first=True)[0].sum())
    with pytest.raises(UnsupportedOpError, match=r"pad_packed_sequence inside a compiled function is not supported"):
        f(packed.data, packed.batch_sizes)


@pytest.mark.parametrize("mode", ["full", "thin", "module"])
def test_the_advised_padded_run_trains_as_eagers_packed_run(mode):
    x, lengths = _inputs()
    torch.manual_seed(1)
    base = Packed()
    packed, padded = copy.deepcopy(base), Padded()
    padded.load_state_dict(base.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (packed, padded)]
    cstep = (lambda m, o, a, b: step(cm, o, a, b)) if mode == "module" else tt.compile(step, thin=mode == "thin")
    cm = tt.compile(padded) if mode == "module" else None
    for _ in range(3):
        want = step(packed, opts[0], x, lengths)
        got = cstep(padded, opts[1], x, lengths)
        torch.testing.assert_close(got, want)
        for p, q in zip(packed.parameters(), padded.parameters()):
            torch.testing.assert_close(q, p)
