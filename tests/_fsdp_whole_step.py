"""Whole training steps of fully_shard (FSDP2) models compiled, against eager FSDP2, on gloo CPU processes.

Run by tests/test_fsdp.py as ``main(OUT_DIR, 2, 4)`` (tests/_dist.py: run_ranks; or ``python tests/_fsdp_whole_step.py
OUT_DIR WORLD [WORLD ...]``): one process group of each size in turn, its ranks forked from the calling process.  Each rank trains eager FSDP2 and the same
step compiled on its own data, and saves losses, local shards of the parameters and of the optimizer state, the
types of what the epilogue wrote, the trace's collectives, the refused configurations' messages and (2 ranks) the
Lightning ModelParallelStrategy runs of tests/_fsdp_callback.py to ``OUT_DIR/w{WORLD}/rank{r}.pt``.  ``main(OUT_DIR,
"peak")`` measures the GPT step's peak per rank in 2 ranks of its own (``run_peaks``: ``OUT_DIR/wpeak/peak{r}.pt``).
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
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather
from torch.distributed.tensor import DTensor, Shard

import thunder_train as tt
import _fsdp_callback  # imports lightning here, once, before the ranks fork
from _dist import refused, spawn
from _models import Block, train_step
from _peak import peak_call_bytes_all_threads


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


def train(make, units, data, opt_fn, *, thin=False, compiled=True, prefetch=None, **kw):
    """``prefetch``: THUNDER_TRAIN_PREFETCH while compiling (on CPU the all-gathers are not prefetched unless asked,
    transforms/collectives.py)."""
    torch.manual_seed(0)
    model = shard(make(), units, **kw)
    opt = opt_fn(model.parameters())
    step = tt.compile(train_step, thin=thin) if compiled else train_step
    if prefetch is not None:
        os.environ["THUNDER_TRAIN_PREFETCH"] = "1" if prefetch else "0"
    try:
        out = {"losses": [step(model, opt, x, y).detach() for x, y in data]}
        out["params"], out["state"], out["kinds"] = snapshot(model, opt)
        out["param_types"] = [type(p).__name__ for p in model.parameters()]
        if compiled:
            out["thin_calls"] = tt.compile_stats(step).thin_calls
            out["trace"] = str(tt.last_traces(step)[-1])
            out["step"] = step
            out["objects"] = (model, opt)
    finally:
        os.environ.pop("THUNDER_TRAIN_PREFETCH", None)
    return out


def rank_data(rank):
    """Each rank its own batches: 4 of the MLP's, 3 of the GPT's."""
    g = torch.Generator().manual_seed(100 + rank)
    mlp_data = [(torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(4)]
    gpt_data = [(torch.randint(0, 13, (2, 5), generator=g), torch.randint(0, 13, (2, 5), generator=g)) for _ in range(3)]
    return mlp_data, gpt_data


def run(rank, world, out_dir):
    mlp_data, gpt_data = rank_data(rank)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    linears = lambda m: [l for l in m if isinstance(l, nn.Linear)]  # noqa: E731
    blocks = lambda m: list(m.blocks)  # noqa: E731
    result = {"gpt_names": [n for n, _ in TinyGPT().named_parameters()]}
    cases = {
        "mlp_adamw": (mlp, linears, mlp_data, adamw, {"prefetch": True}),
        "mlp_adamw_thin": (mlp, linears, mlp_data, adamw, {"thin": True}),
        "mlp_sgd_keep_gathered": (mlp, linears, mlp_data, sgd, {"reshard_after_forward": False}),
        "gpt_adamw_thin": (TinyGPT, blocks, gpt_data, adamw, {"thin": True, "prefetch": True}),
        # torchtitan's mixed precision: bfloat16 parameters in forward and backward, gradients reduced in float32
        "mlp_bf16_params_fp32_reduce": (mlp, linears, mlp_data, adamw, {
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}),
    }
    if world > 2:
        # (CI time: the GPT runs on 2 ranks.)  Prefetched: uneven and empty shards pad differently on each rank,
        # yet every rank issues its collectives in the same order.
        cases = {"mlp_adamw_thin": (mlp, linears, mlp_data, adamw, {"thin": True, "prefetch": True})}
    steps = {}  # the compiled step of each case
    objects = {}  # the model and optimizer it trained
    eager_runs = {}  # cases that differ only in how they compile (thin, prefetch) share one eager FSDP2 run
    for name, (make, units, data, opt_fn, kw) in cases.items():
        fsdp_kw = {k: v for k, v in kw.items() if k not in ("thin", "prefetch")}
        key = (make, units, id(data), opt_fn) if not fsdp_kw else name
        if key not in eager_runs:
            eager_runs[key] = train(make, units, data, opt_fn, compiled=False, **fsdp_kw)
        result[name] = {"eager": eager_runs[key]}
        result[name]["compiled"] = train(make, units, data, opt_fn, **kw)
        steps[name] = result[name]["compiled"].pop("step")
        objects[name] = result[name]["compiled"].pop("objects")
    if world == 2:
        # the uninterrupted run is mlp_adamw's compiled one; its compiled step serves the others (same structure)
        whole = result["mlp_adamw"]["compiled"]
        result["errors"] = errors(mlp_data[0])
        result["no_grad_unit"] = no_grad_unit(mlp_data[:3])
        result["clip_between"] = clip_between(mlp_data[:3])
        result["switched"] = switched_after_compiling(steps["mlp_adamw_thin"], *objects["mlp_adamw_thin"], mlp_data[0])
        # (after the switches: the thin step's model and optimizer are loaded from the checkpoint)
        result["checkpoint"] = checkpoint_resume(mlp_data, steps["mlp_adamw"], whole["losses"], whole["params"], whole["state"],
                                                 steps["mlp_adamw_thin"], *objects["mlp_adamw_thin"])
        result["lightning"] = _fsdp_callback.run(rank, world)  # last: Lightning's Trainer changes process state
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_peaks(rank, world, out_dir):
    """The GPT case's peak per rank, eager FSDP2's and the compiled step's: three steps each (AdamW's state created,
    the thin step bound), then one more on the last batch, its memory counted across threads (gloo's workers allocate
    and free collective buffers; tests/_peak.py).  Its own ranks, after the others: a crash while measuring fails the
    peak test alone."""
    _, gpt_data = rank_data(rank)
    peaks = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = shard(TinyGPT(), lambda m: list(m.blocks))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = tt.compile(train_step, thin=True) if compiled else train_step
        os.environ["THUNDER_TRAIN_PREFETCH"] = "1"
        try:
            for x, y in gpt_data:
                step(model, opt, x, y)
        finally:
            os.environ.pop("THUNDER_TRAIN_PREFETCH", None)
        kind = "compiled" if compiled else "eager"
        peaks[kind] = peak_call_bytes_all_threads(lambda: step(model, opt, *gpt_data[-1]), step if compiled else None)
    torch.save(peaks, os.path.join(out_dir, f"peak{rank}.pt"))


def checkpoint_resume(data, step, whole, params, opt_state, thin_step, thin_model, thin_opt):
    """Two compiled steps, a DCP save, a fresh model and optimizer loaded from it, two more compiled steps: the same
    as four uninterrupted compiled steps (``whole``, ending with ``params`` and ``opt_state``), and model.state_dict()
    holds DTensors between compiled steps.  ``step``: the compiled step of the uninterrupted run.  Then the same
    checkpoint loaded into a model and optimizer that a bound thin step has trained further (``thin_step``,
    ``thin_model``, ``thin_opt``: set_state_dict in place, the step reused), two more steps: the same again."""
    linears = lambda m: [l for l in m if isinstance(l, nn.Linear)]  # noqa: E731
    torch.manual_seed(0)
    model = shard(mlp(), linears)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
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
    second = [step(model2, opt2, x, y) for x, y in data[2:]]
    out = {"whole": whole, "resumed": first + second, "expected": (params, opt_state), "got": snapshot(model2, opt2)[:2],
           "sd_types": sd_types}
    msd3, osd3 = get_state_dict(thin_model, thin_opt)
    state = {"model": msd3, "optim": osd3}
    dcp.load(state, checkpoint_id=holder[0])
    set_state_dict(thin_model, thin_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    out["resumed_in_place"] = first + [thin_step(thin_model, thin_opt, x, y) for x, y in data[2:]]
    out["got_in_place"] = snapshot(thin_model, thin_opt)[:2]
    return out


def clip_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss


def evaluate(model, x):
    """An evaluation step called with grad enabled: no_grad inside (so no backward is needed)."""
    with torch.no_grad():
        return model(x)


def forward_backward(model, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def update(model, opt):
    opt.step()
    opt.zero_grad()


def clip_between(data):
    """What the refusal of clip_step advises: forward and backward compiled (twice per step: gradient accumulation
    that reduces each micro-batch), clip_grad_norm_ eagerly on the DTensor gradients, the update compiled; against
    the same three eagerly."""
    linears = lambda m: [l for l in m if isinstance(l, nn.Linear)]  # noqa: E731
    out = {}
    for kind, (fb, upd) in (("eager", (forward_backward, update)),
                            ("compiled", (tt.compile(forward_backward, thin=True), tt.compile(update, thin=True)))):
        torch.manual_seed(0)
        model = shard(mlp(), linears)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        values = []
        for x, y in data:
            values.append(fb(model, x, y).detach())
            values.append(fb(model, x[:3], y[:3]).detach())  # gradient accumulation: adds to the DTensor .grad
            values.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).full_tensor())
            upd(model, opt)
        out[kind] = {"values": values, "params": [local(p) for p in model.parameters()]}
    return out


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
    # Refused before tracing (fully_shard's configuration): CPU offloading, one unit for two modules, a custom
    # all-gather, gradients reduced in float16.
    out["offload"] = attempt(shard(mlp(), linears, offload_policy=CPUOffloadPolicy(pin_memory=False)))
    grouped = mlp()
    fully_shard([grouped[0], grouped[2]])
    out["grouped"] = attempt(fully_shard(grouped))
    custom = shard(mlp(), linears)
    custom[0].set_custom_all_gather(LoggedAllGather())
    out["custom_all_gather"] = attempt(custom)
    out["fp16_reduce"] = attempt(shard(mlp(), linears, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float16)))
    with torch.no_grad():
        m = shard(mlp(), linears)
        out["eval"] = (tt.compile(lambda m, x: m(x))(m, x), m(x))
    m, fn = shard(mlp(), linears), tt.compile(evaluate)
    msg = refused(fn, m, x)
    out["eval_inside"] = (msg, fn(m, x) if msg == "no error" else None, evaluate(m, x))
    return out


def switched_after_compiling(step, model, opt, batch):
    """FSDP2's switches flipped on a model whose thin step is bound: each call is refused (eager FSDP2 would
    accumulate without reducing, or divide by another factor) with the model left as it was, and switched back
    the same program runs again (no new trace)."""
    out = {}
    entries = tt.compile_stats(step).entries
    for name, switch, back in (("no_sync", lambda: model.set_requires_gradient_sync(False),
                                lambda: model.set_requires_gradient_sync(True)),
                               ("layer_no_sync", lambda: model[0].set_requires_gradient_sync(False, recurse=False),
                                lambda: model[0].set_requires_gradient_sync(True, recurse=False)),
                               ("divide_factor", lambda: model[2].set_gradient_divide_factor(4.0),
                                lambda: model[2].set_gradient_divide_factor(None))):
        switch()
        before = snapshot(model, opt)[:2]
        msg = refused(step, model, opt, *batch)
        after = snapshot(model, opt)[:2]
        unchanged = all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and \
            all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)
        back()
        out[name] = (msg, unchanged)
    thin = tt.compile_stats(step).thin_calls
    step(model, opt, *batch)
    out["rerun"] = (tt.compile_stats(step).entries - entries, tt.compile_stats(step).thin_calls - thin)
    return out


class LoggedAllGather(DefaultAllGather):
    """A custom all-gather (set_custom_all_gather): FSDP2 calls it instead of its own."""


def frozen_step(model, frozen, opt, x, y):
    """A fully_shard unit used only under no_grad inside the step (a frozen feature extractor)."""
    with torch.no_grad():
        x = frozen(x)
    return train_step(model, opt, x, y)


def no_grad_unit(data):
    """frozen_step compiled against eager: the same losses and updates; the frozen unit keeps its values, no .grad."""
    linears = lambda m: [l for l in m if isinstance(l, nn.Linear)]  # noqa: E731
    out = {}
    for kind, fn in (("eager", frozen_step), ("compiled", tt.compile(frozen_step))):
        torch.manual_seed(0)
        frozen, model = fully_shard(nn.Linear(8, 8)), shard(mlp(), linears)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = [fn(model, frozen, opt, x, y).detach() for x, y in data]
        frozen.reshard()  # (eager FSDP2 keeps a root unit gathered after a forward without backward)
        out[kind] = {"losses": losses, "params": [local(p) for p in model.parameters()],
                     "frozen": [local(p) for p in frozen.parameters()], "frozen_grads": [p.grad for p in frozen.parameters()]}
    return out


def warm_up():
    """An eager step and a compiled one of each model, unsharded, in the process the ranks fork from: what a first
    call initializes (lazy imports, caches) is done once here instead of in every rank.  No process group (a
    fake one would leave caches keyed by a mesh's shape that the ranks' real meshes would hit); this process's RNG
    is left as it was."""
    with torch.random.fork_rng():
        mlp_batch = (torch.randn(6, 8), torch.randint(0, 5, (6,)))
        gpt_batch = (torch.randint(0, 13, (2, 5)), torch.randint(0, 13, (2, 5)))
        for make, batch in ((mlp, mlp_batch), (TinyGPT, gpt_batch)):
            for step in (train_step, tt.compile(train_step)):
                model = make()
                step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), *batch)


_warmed = []  # whether warm_up ran in this process


def main(out_dir, *worlds):
    """Each process group size in turn (2 by default), its ranks forked from this process; ``peak``: the peak
    measurement's 2 ranks (``run_peaks``)."""
    if not _warmed:
        warm_up()
        _warmed.append(True)
    for world in worlds or [2]:
        out = os.path.join(out_dir, f"w{world}")
        os.makedirs(out, exist_ok=True)
        spawn(run_peaks if world == "peak" else run, out, world=2 if world == "peak" else int(world))


if __name__ == "__main__":
    main(*sys.argv[1:])
