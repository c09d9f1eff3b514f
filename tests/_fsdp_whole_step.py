"""Whole training steps of fully_shard (FSDP2) models compiled, against eager FSDP2, on gloo CPU processes.

Run by tests/test_fsdp.py as ``python tests/_fsdp_whole_step.py OUT_DIR WORLD``.  Each rank trains eager FSDP2
and the same step compiled on its own data, and saves losses, local shards of the parameters and of the
optimizer state, the types of what the epilogue wrote, the trace's collectives and the refused configurations'
messages to ``OUT_DIR/rank{r}.pt``.
"""
from __future__ import annotations

import copy
import os
import sys
import tempfile

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

import thunder_train as tt
from _dist import spawn
from _models import Block, train_step


class TinyGPT(nn.Module):
    def __init__(self, vocab=13, d=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def mlp():
    # Odd sizes: the shards of dim 0 are uneven (FSDP2 pads them).
    return nn.Sequential(nn.Linear(8, 33), nn.GELU(), nn.Linear(33, 5))


def shard(model, units, **kw):
    """torchtitan's way: fully_shard each block, then the root."""
    for m in units(model):
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    return model


def local(t):
    return t._local_tensor.detach().clone() if isinstance(t, DTensor) else t.detach().clone()


def snapshot(model, opt):
    params = [local(p) for p in model.parameters()]
    state = [{k: local(v) for k, v in opt.state[p].items()} for p in model.parameters()]
    kinds = [{k: type(v).__name__ for k, v in opt.state[p].items()} for p in model.parameters()]
    return params, state, kinds


def train(make, units, data, opt_fn, *, thin=False, compiled=True, **kw):
    torch.manual_seed(0)
    model = shard(make(), units, **kw)
    opt = opt_fn(model.parameters())
    step = tt.compile(train_step, thin=thin) if compiled else train_step
    losses = [step(model, opt, x, y).detach() for x, y in data]
    out = {"losses": losses}
    out["params"], out["state"], out["kinds"] = snapshot(model, opt)
    out["param_types"] = [type(p).__name__ for p in model.parameters()]
    if compiled:
        out["thin_calls"] = tt.compile_stats(step).thin_calls
        out["trace"] = str(tt.last_traces(step)[-1])
    return out


def refused(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return "no error"


def run(rank, world, out_dir):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    mlp_data = [(torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(4)]
    gpt_data = [(torch.randint(0, 13, (2, 5), generator=g), torch.randint(0, 13, (2, 5), generator=g)) for _ in range(3)]
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    linears = lambda m: [l for l in m if isinstance(l, nn.Linear)]  # noqa: E731
    blocks = lambda m: list(m.blocks)  # noqa: E731
    result = {}
    cases = {
        "mlp_adamw": (mlp, linears, mlp_data, adamw, {}),
        "mlp_adamw_thin": (mlp, linears, mlp_data, adamw, {"thin": True}),
        "mlp_sgd_keep_gathered": (mlp, linears, mlp_data, sgd, {"reshard_after_forward": False}),
        "gpt_adamw_thin": (TinyGPT, blocks, gpt_data, adamw, {"thin": True}),
        # torchtitan's mixed precision: bfloat16 parameters in forward and backward, gradients reduced in float32
        "mlp_bf16_params_fp32_reduce": (mlp, linears, mlp_data, adamw, {
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}),
    }
    if world > 2:
        cases = {k: cases[k] for k in ("mlp_adamw_thin",)}  # (CI time: the GPT runs on 2 ranks)
    for name, (make, units, data, opt_fn, kw) in cases.items():
        fsdp_kw = {k: v for k, v in kw.items() if k != "thin"}
        result[name] = {"eager": train(make, units, data, opt_fn, compiled=False, **fsdp_kw),
                        "compiled": train(make, units, data, opt_fn, **kw)}
    if world == 2:
        result["checkpoint"] = checkpoint_resume(mlp_data)
        result["errors"] = errors(mlp_data[0])
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def checkpoint_resume(data):
    """Two compiled steps, a DCP save, a fresh model and optimizer loaded from it, two more compiled steps: the same
    as four uninterrupted compiled steps (and model.state_dict() holds DTensors between compiled steps)."""
    linears = lambda m: [l for l in m if isinstance(l, nn.Linear)]  # noqa: E731
    torch.manual_seed(0)
    model = shard(mlp(), linears)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = tt.compile(train_step)
    whole = [step(model, opt, x, y) for x, y in data]
    expected = snapshot(model, opt)[:2]

    torch.manual_seed(0)
    model = shard(mlp(), linears)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = tt.compile(train_step)
    first = [step(model, opt, x, y) for x, y in data[:2]]
    sd_types = sorted({type(v).__name__ for v in model.state_dict().values()})
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None
    holder = [path]
    torch.distributed.broadcast_object_list(holder)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=holder[0])

    torch.manual_seed(1)  # other initial values: the load must replace them
    model2 = shard(mlp(), linears)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    msd2, osd2 = get_state_dict(model2, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=holder[0])
    set_state_dict(model2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    step2 = tt.compile(train_step)
    second = [step2(model2, opt2, x, y) for x, y in data[2:]]
    return {"whole": whole, "resumed": first + second, "expected": expected, "got": snapshot(model2, opt2)[:2],
            "sd_types": sd_types}


def clip_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def errors(batch):
    from torch.distributed.device_mesh import init_device_mesh

    x, y = batch
    linears = lambda m: [l for l in m if isinstance(l, nn.Linear)]  # noqa: E731

    def attempt(model, fn=train_step, with_opt=True):
        args = (model, torch.optim.SGD(model.parameters(), lr=0.1), x, y) if with_opt else (model, x, y)
        before = [local(p) for p in model.parameters()]
        msg = refused(tt.compile(fn), *args)
        unchanged = all(torch.equal(a, local(b)) for a, b in zip(before, model.parameters()))
        return msg, unchanged

    out = {}
    out["shard_dim1"] = attempt(shard(mlp(), linears, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None))
    mesh2d = init_device_mesh("cpu", (1, torch.distributed.get_world_size()), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = attempt(shard(mlp(), linears, mesh=mesh2d))
    no_sync = shard(mlp(), linears)
    no_sync.set_requires_gradient_sync(False)
    out["no_sync"] = attempt(no_sync)
    out["forward_only"] = attempt(shard(mlp(), linears), lambda m, x, y: F.cross_entropy(m(x), y), with_opt=False)
    out["clip"] = attempt(shard(mlp(), linears), clip_step)
    out["tied_outside"] = attempt(shard(mlp(), linears), lambda m, x, y: (m(x) + x @ m[0].weight.t()[:, :5]).sum().backward(),
                                  with_opt=False)
    with torch.no_grad():
        m = shard(mlp(), linears)
        out["eval"] = (tt.compile(lambda m, x: m(x))(m, x), m(x))
    return out


if __name__ == "__main__":
    spawn(run, sys.argv[1], world=int(sys.argv[2]) if len(sys.argv) > 2 else 2)
