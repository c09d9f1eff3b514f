"""CUDA graphs for a thin-bound whole step: ``tt.compile(step, thin=True, cuda_graphs=True)``.

Thin mode's contract is what a CUDA graph needs: the static tensors (parameters, optimizer state) are bound
once and updated in place, only the batch changes.  ``GraphedProgram`` wraps the computation thin mode calls
(the trace's callable, before the epilogue and the output rebuild, which stay Python):

* call 1 after binding: a **warm-up** on a side stream (a real step, uncaptured);
* call 2: the per-call tensors (the batch, tensors re-read every call) are copied into **static input
  buffers**, the whole program is **captured** once on that stream, then replayed (the real step);
* later calls: copy the batch into the buffers, write the hyper-parameters that are device tensors, replay.

Hyper-parameters: a runtime number used only as the ``lr`` of torch's fused optimizer kernels
(``_fused_adam(w)_``, ``_fused_sgd_``, which take a device tensor ``lr``) lives in a one-element device
tensor written before each replay, so a scheduler never re-captures.  Any other runtime number is baked
into the graph at capture: a new value re-captures (at most ``MAX_CAPTURES`` times per binding, then the
program runs uncaptured, with a note).

Outputs: a returned tensor that is a bound input (a parameter) is returned as is, one that is a per-call
input is that call's tensor, and every other one (the loss) is a clone of the graph's output buffer, so a
value kept from an earlier step is never overwritten by a later replay.

Everything that drops the thin binding (the thin-mode hazards, ``revalidate()``, eviction) drops the graph
with it: the next binding captures again.  A call of a new size does not drop it: the binding is parked with
its entry (graph included) while another entry runs, and a symbolic entry keeps a graph per size
(``graphs_per_size.py``).  Where capture is impossible the reason is one line in
``compile_stats(cf).cuda_graph_notes`` and the program runs uncaptured (``obstacle``).
"""
from __future__ import annotations

import time

import torch
import torch.utils._pytree as pytree

from ..compiler.proxies import NumberProxy, TensorProxy
from ..compiler.executors import torch_impls

MAX_CAPTURES = 4  # per binding: captures beyond the first are for baked-in numbers that changed

# Ops that wait for the device (a host sync is an error inside a capture).
_HOST_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.nonzero, torch.Tensor.nonzero, torch.masked_select,
               torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.Tensor.cpu, torch.Tensor.numpy,
               torch_impls.check_decision}  # a decision the program checks reads the value on the host
# Optimizer update symbols (torchlang/optim.py, executors/torch_impls.py) whose ``lr`` may be a device tensor.
_TENSOR_LR = {"adam_update_", "adam_update", "sgd_update_", "sgd_update"}


def obstacle(entry) -> str | None:
    """Why the program of ``entry`` cannot be captured as one CUDA graph, or None."""
    if entry.backward_traces is not None:
        return ("the program connects to PyTorch autograd (its backward runs after the call); a graph captures "
                "whole steps that call loss.backward() inside the compiled function, or programs without gradients")
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (torch.cuda.is_available() is False)"
    trc = entry.traces[-1]
    # Inputs first: a CPU step counter is the cause users can act on, and the `.item()` that reads it follows from it.
    for p in trc.args:
        if type(p) is TensorProxy and p._tt_device.type != "cuda":
            return (f"input {p.name} is a {p._tt_device.type} tensor; every tensor of a captured step must be on a "
                    "CUDA device (optimizer step counters: AdamW(fused=True) or capturable=True keep them there)")
    for b in trc.bound_symbols:
        if getattr(b.sym, "fn", None) in _HOST_SYNCS:
            return f"{b.sym.name} waits for the device (a host sync cannot be captured)"
    for b in trc.bound_symbols:
        for o in b.flat_outputs():
            if type(o) is TensorProxy and o._tt_device.type != "cuda":
                return f"{b.sym.name} computes a {o._tt_device.type} tensor ({o.name}); every tensor of a captured step must be on a CUDA device"
    return None


def tensor_lr_positions(trc) -> set:
    """Positions of the trace's number inputs used only as ``lr=`` of a fused optimizer update."""
    numbers = {id(p): j for j, p in enumerate(trc.args) if isinstance(p, NumberProxy)}
    ok, bad = set(), set()
    for b in trc.bound_symbols:
        lr = b.kwargs.get("lr") if b.sym.name.rsplit(".", 1)[-1] in _TENSOR_LR else None
        for a in b.flat_args():
            j = numbers.get(id(a))
            if j is None:
                continue
            (ok if a is lr and sum(x is a for x in b.flat_args()) == 1 else bad).add(j)
    return ok - bad


class GraphedProgram:
    """The computation thin mode calls, captured as a CUDA graph after one warm-up (see the module docstring)."""

    def __init__(self, entry, binding, note, stats):
        self.fn = entry.program
        self.entry, self.binding, self.note, self.stats = entry, binding, note, stats
        self.lr_pos = tensor_lr_positions(entry.traces[-1])
        self.graph = None
        self.captures = 0
        self._call = self._warm_up

    def __call__(self, *inputs):
        return self._call(*inputs)

    # ---- states ----
    def _uncaptured(self, *inputs):
        return self.fn(*inputs)

    def _give_up(self, why: str, inputs):
        self.note(f"cuda_graphs: not captured: {why}; the program runs uncaptured")
        self.release()
        self._call = self._uncaptured
        return self.fn(*inputs)

    def _warm_up(self, *inputs):
        dev = next((v.device for v in inputs if isinstance(v, torch.Tensor) and v.is_cuda), None)
        if dev is None:
            return self._give_up("no CUDA tensor among the inputs", inputs)
        self.device = dev
        self.stream = torch.cuda.Stream(dev)
        self.stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self.stream):
            out = self.fn(*inputs)
        self.stream.synchronize()  # its buffers were allocated on the side stream: done before anyone reuses them
        self._call = self._capture
        return out

    def _capture(self, *inputs):
        static = set(self.binding.static_idx)
        written = set(self.entry.prologue.written)
        idx = self.entry.input_idx
        args, self.copies, self.numbers, self.const_pos = [], [], [], []
        for j, v in enumerate(inputs):
            if isinstance(v, torch.Tensor):
                if idx[j] in static:
                    args.append(v)
                    continue
                if idx[j] in written:
                    return self._give_up(f"input {j} is updated in place but is a different tensor object on each call", inputs)
                buf = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                buf.copy_(v)
                self.copies.append((j, buf))
                args.append(buf)
            elif j in self.lr_pos and type(v) in (float, int):
                buf = torch.full((), float(v), dtype=torch.float32, device=self.device)
                self.numbers.append([j, buf, v])
                args.append(buf)
            else:
                self.const_pos.append(j)
                args.append(v)
        self.consts = [inputs[j] for j in self.const_pos]
        t0 = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (a DataLoader's pin-memory thread) do not break the capture.
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                out = self.fn(*args)
        except Exception as e:  # noqa: BLE001 - nothing ran on the device: run the call uncaptured
            first = (str(e).strip().splitlines() or [""])[0][:160]
            return self._give_up(f"capture failed: {type(e).__name__}: {first}", inputs)
        leaves, self.spec = pytree.tree_flatten(out)
        buffers = {id(b): j for j, b in self.copies}
        copy_storage = {b.untyped_storage().data_ptr() for _, b in self.copies}
        self.out_plan = []  # per output leaf: ("same", value) | ("input", j) | ("clone", buffer)
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                self.out_plan.append(("same", x))
            elif id(x) in buffers:
                self.out_plan.append(("input", buffers[id(x)]))
            elif x.untyped_storage().data_ptr() in copy_storage:
                return self._give_up("the program returns a view of a per-call input", inputs)
            elif any(x is a for a in args):
                self.out_plan.append(("same", x))
            else:
                self.out_plan.append(("clone", x))
        self.graph = graph
        self.captures += 1
        self.stats.cuda_graph_captures += 1
        self.note(f"cuda_graphs: captured the whole program at call {self.stats.calls} in {time.perf_counter() - t0:.2f} s "
                  f"({len(self.copies)} per-call tensor(s) copied into static buffers, {len(self.numbers)} hyper-parameter(s) "
                  f"as device tensors, {len(self.const_pos)} value(s) baked in); later calls replay it")
        self._call = self._replay
        return self._replay(*inputs)

    def _replay(self, *inputs):
        if self.const_pos and [inputs[j] for j in self.const_pos] != self.consts:
            changed = [j for j, old in zip(self.const_pos, self.consts) if inputs[j] != old]
            if self.captures >= MAX_CAPTURES:
                return self._give_up(f"a value baked into the graph (input {changed[0]}) changed on {self.captures} captures", inputs)
            self.note(f"cuda_graphs: input {changed[0]} (a number baked into the graph) changed: re-capturing")
            self.graph.reset()
            self.graph = None
            return self._capture(*inputs)
        for j, buf in self.copies:
            buf.copy_(inputs[j])
        for n in self.numbers:
            v = inputs[n[0]]
            if v != n[2]:
                n[1].fill_(float(v))
                n[2] = v
        self.graph.replay()
        self.stats.cuda_graph_replays += 1
        return pytree.tree_unflatten([x if k == "same" else inputs[x] if k == "input" else x.clone()
                                      for k, x in self.out_plan], self.spec)

    def release(self):
        """Drop the graph and its buffers (the binding it was captured for is gone)."""
        if self.graph is not None:
            self.graph.reset()
        self.graph = None
        self.copies, self.numbers, self.out_plan = [], [], []
        self._call = self._uncaptured
