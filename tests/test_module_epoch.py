"""The module epoch's process-wide hooks (runtime/module_epoch.py) are installed by the first thin binding only."""
import os
import subprocess
import sys
import textwrap

import thunder_train

_SCRIPT = textwrap.dedent("""
    import torch
    from torch import nn
    import thunder_train as tt
    mm = torch.nn.modules.module
    orig = nn.Module.__setattr__, nn.Module.__delattr__, nn.Module._apply
    hooks = lambda: (len(mm._global_parameter_registration_hooks), len(mm._global_buffer_registration_hooks),
                     len(mm._global_module_registration_hooks))
    before = hooks()
    m = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    m.eval(); m.train(); m.double(); m.float()
    tt.compile(lambda m, x: m(x))(m, torch.randn(3, 4))  # full mode binds nothing
    assert (nn.Module.__setattr__, nn.Module.__delattr__, nn.Module._apply) == orig, "wrapped before any thin binding"
    assert hooks() == before, "hooks registered before any thin binding"
    step = tt.compile(lambda m, x: m(x), thin=True)
    x = torch.randn(3, 4)
    for _ in range(3):
        step(m, x)
    assert step.is_thin_bound
    assert nn.Module.__setattr__ is not orig[0] and nn.Module.__setattr__.__wrapped__ is orig[0]
    assert hooks() == tuple(n + 1 for n in before)
    m[1].eval()  # seen through the wrapper installed at binding
    torch.testing.assert_close(step(m, x), m(x))
    assert not step.is_thin_bound or tt.compile_stats(step).thin_invalidations, "eval() went unseen"
    print("ok")
""")


def test_hooks_installed_at_the_first_thin_binding():
    root = os.path.dirname(os.path.dirname(os.path.abspath(thunder_train.__file__)))  # this checkout's package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
