"""CUDA graphs per size (guards/graphs_per_size.py): the dispatch and eviction logic, on the CPU.

A fake per-size program stands in for ``GraphedProgram`` (which needs a CUDA device to capture): it records
the shapes it ran and whether it was released.  The GPU path is tests/test_cuda_graphs.py (skipped here).
"""
import torch

from thunder_train.runtime.graphs_per_size import GraphsPerSize


class Fake:
    made = []

    def __init__(self):
        self.calls, self.released, self.graph = [], False, object()
        Fake.made.append(self)

    def __call__(self, *inputs):
        assert not self.released
        self.calls.append(tuple(tuple(v.shape) for v in inputs))
        return inputs[1] * 2

    def release(self):
        self.released, self.graph = True, None


def test_one_program_per_per_call_size_and_lru_release():
    Fake.made = []
    notes = []
    w = torch.randn(3)  # position 0: bound by thin mode (same for every size), not part of the key
    g = GraphsPerSize(Fake, lambda: [0], limit=2, note=notes.append)
    for T in (4, 4, 5, 4, 6, 5):
        x = torch.randn(2, T)
        torch.testing.assert_close(g(w, x), x * 2)
    # Limit 2, least recently used first: 6 evicts 5's program (4 ran after it), the second 5 evicts 4's.
    a, b, c, d = Fake.made
    assert [len(p.calls) for p in Fake.made] == [3, 1, 1, 1]
    assert a.calls[0] == ((3,), (2, 4)) and d.calls == [((3,), (2, 5))]
    assert a.released and b.released and not c.released and not d.released
    assert len(notes) == 2 and "(2, 5)" in notes[0] and "(2, 4)" in notes[1] and "cache_limit" in notes[0]
    assert g.graph is not None
    g.release()
    assert all(p.released for p in Fake.made) and g.graph is None
