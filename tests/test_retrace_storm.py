"""A compiled step that retraces on every call says so (once), naming why; its results stay eager's."""
import warnings

import pytest
import torch

import thunder_train as tt


def _model_and_step(fmt_inside):
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(x):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if fmt_inside:
            print(f"loss {loss.item():.6f}")
        return loss

    return m, step


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_a_format_of_the_loss_inside_the_step_matches_eager_and_warns_about_the_retraces(thin, capsys):
    m_ref, step_ref = _model_and_step(True)
    m, step = _model_and_step(True)
    cf = tt.compile(step, thin=thin)
    x = torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(10):
            torch.testing.assert_close(cf(x), step_ref(x))
            ours, eager = capsys.readouterr().out.splitlines()
            assert ours == eager  # every call printed its own loss, as eager did
    torch.testing.assert_close(m.weight, m_ref.weight)
    storms = [w for w in caught if "calls each traced a new program" in str(w.message)]
    assert len(storms) == 1, [str(w.message) for w in caught]
    msg = str(storms[0].message)
    assert "format spec '.6f'" in msg and "return the value" in msg
    assert storms[0].filename == __file__  # points at the user's call, not into thunder_train


def test_a_step_that_settles_does_not_warn():
    m, step = _model_and_step(False)
    cf = tt.compile(step, thin=True)
    x = torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(20):
            cf(x)
    assert not [w for w in caught if "each traced a new program" in str(w.message)]
    assert tt.compile_stats(cf).entries == 1
