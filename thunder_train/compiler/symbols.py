"""Symbols and bound symbols.

A ``Symbol`` is an operation of one of the three languages (``prims``,
``clang`` is plain functions, ``ltorch`` for the torch language) or an
executor's implementation.  Calling a symbol while a trace is active records
a ``BoundSymbol``: the symbol, its arguments and its output proxies.  A
composite symbol (anything that is not a prim) runs its decomposition in a
nested scope; the symbols recorded there become its ``subsymbols``, so an
executor can either claim the composite whole or run its decomposition.

Outside tracing a symbol executes eagerly on real tensors through the torch
executor, which is what makes every printed trace runnable.
"""
from __future__ import annotations

from typing import Callable

from . import codegen, context
from .proxies import is_checked, is_proxy, is_unbacked
from .pytree import tree_flatten, tree_leaves, tree_map

# How a symbol runs outside tracing (on real tensors).  The torch executor installs its
# implementation here when it is imported (it sits in a higher layer).
eager_executor: Callable | None = None

# The tags a symbol may carry, and what each tells the passes that read it.  The set is closed: making a symbol
# with any other tag raises (a misspelt tag would otherwise be a fact nothing reads).
TAGS = {
    "side_effect": "a call must run even if nobody reads its outputs (DCE keeps it, fusion leaves it alone)",
    "inplace": "the op writes one of its arguments (a side effect)",
    "fusible": "a fusing executor may put the op's torch call in a fused kernel (executors/regions.py)",
    "elementwise": "its output has its tensor inputs' broadcast shape, row-major when they are row-major and of "
                   "that shape (executors/layout_rules.py); prims and torch-language ops alike",
    "transcendental": "an elementwise prim whose CPU kernel spends 1-4 ns an element (exp, tanh, erf, sigmoid, ...), "
                      "where an add spends ~0.2: recomputing a large one as a kernel of its own is not cheap "
                      "(transforms/remat_policy.py ``costly_alone``)",
    "reduction": "a prim reducing over dimensions of its input (sum, amax, var, ...)",
    "commutative": "the operands of a binary prim may be swapped",
    "non_differentiable": "its outputs carry no gradient (autograd does not differentiate through it)",
    "cheap_to_recompute": "the backward recomputes its output from its input rather than saving it, when that "
                          "saves no extra value (views, conversions, constants; transforms/autograd.py)",
    "random": "it uses or changes a global generator's state (random values, prims/generators.py): its values "
              "differ from call to call (decisions refuse to depend on it), and DCE keeps it although nobody reads it "
              "(an unread draw still advances eager's generator; ``BoundSymbol.draws_random``)",
    "reads_generator": "it reads a global generator's state without changing it (``prims.get_rng_state``): its value "
                       "differs from call to call (decisions refuse to depend on it), and it runs in program order",
    "view": "a torch-language op whose result shares storage with its first argument in eager PyTorch (getitem "
            "with tensor indices aside): the tracer keeps the alias (acquisition/inplace.py ``is_view``)",
    "shape_only": "a prim computing a view or a reshape, whose output layout is the same on every device "
                  "(executors/layout_rules.py finds it, and torch-language \"view\" ops' layouts, on meta tensors)",
    "layout_on_meta": "its output layout is the same on every device (no device-specific kernel choice): "
                      "executors/layout_rules.py finds it on meta tensors (~0.2 ms a call) instead of fake tensors of "
                      "the device (~5 ms a new shape, the bulk of a first call's layout cost); tests/test_layout.py "
                      "checks that both agree",
    "fallible": "its run-time values can make it raise (an index out of range, a failed check); re-inplacing "
                "writes no input before it (executors/reinplace.py), so a failed call changes nothing",
    "fused_backward": "its gradient is recorded as one ``<name>_vjp`` line whose subsymbols are the rule's prims; "
                      "the torch executor runs PyTorch's own fused backward for it (transforms/autograd.py)",
    "vjp_layout_from_kernel": "its ``<name>_vjp`` line's gradients are laid out as PyTorch's backward kernel lays "
                              "them out (found by a fake run, executors/layout_rules.py), not row-major: the CPU "
                              "flash attention backward's are (batch, seq, heads, dim), GELU's the incoming gradient's, and fused kernels "
                              "check it; only where the fake run's layout is the kernel's (not log-softmax's)",
    "opaque": "an op the compiler does not know, run as the user called it (opaque.py): it may raise, and may "
              "keep references to its arguments (re-inplacing and kept buffers treat it so)",
}
KNOWN_TAGS = frozenset(TAGS)

# Tags that make a bound symbol a side effect (DCE keeps it, fusion leaves it alone).
SIDE_EFFECT_TAGS = frozenset({"side_effect", "inplace"})


def checked_tags(tags, owner: str = "a symbol") -> frozenset:
    """``tags`` as a frozenset, after checking that each is a known tag (``TAGS``)."""
    if isinstance(tags, str):
        raise TypeError(f"{owner}: tags must be a collection of tag names, not the string {tags!r} (write ({tags!r},))")
    tags = frozenset(tags)
    unknown = tags - KNOWN_TAGS
    if unknown:
        raise ValueError(f"{owner}: unknown tag(s) {sorted(unknown)}; a tag is one of {sorted(KNOWN_TAGS)} "
                         f"(compiler/symbols.py TAGS says what each means; add a new one there with its meaning)")
    return tags


# Sets the eager memory layout of a new bound symbol's output proxies; installed by
# executors/layout_rules.py (it needs the torch executor's implementations).
layout_hook = None


def set_inner_layout(sub, composite) -> None:
    """Eager's layout for the values line ``sub`` of ``composite``'s decomposition computes, when a pass runs the
    decomposition instead of the composite (autograd expanding it, lowering decomposing it).  Tracing sets layouts
    on top-level lines only (``claimed_depth``), so these were row-major as created, while the program computes
    them with the torch calls of ``sub`` (an ``expand`` has stride 0 on its expanded dims), and what reads them (a
    fused kernel compiled for its inputs' strides, kept buffers) needs the layout they have.  The composite's own
    outputs keep the layout it set."""
    outs = {id(o) for o in composite.flat_outputs()}
    if layout_hook is not None and not any(id(o) in outs for o in sub.flat_outputs()):
        layout_hook(sub)

# Marks a new top-level bound symbol recorded inside an activation-checkpoint region (its ``region``);
# installed by acquisition/checkpoint_regions.py.
region_hook = None


class Symbol:
    """An operation with a meta function (prims) or a decomposition (composites).

    ``module`` is the name the symbol is printed under in traces ("prims",
    "ltorch"); ``fn`` is the meta function for prims and the decomposition for
    composites.

    Every other fact about the op hangs off the symbol and is declared where the
    op is defined (``@torchsymbol(...)`` in torchlang/, ``@register_vjp`` next to
    it); executors add their own implementations from their side, keyed by the symbol.
    ``tags``: a set of names from ``TAGS`` (checked here: an unknown tag raises).
    """

    # Class defaults of the facts (an instance sets what applies to it).
    grad_rule = None  # (rule, supports): the gradient rule, set by @register_vjp (compiler/grad_rules.py)
    torch_impl = None  # the torch callable the torch executor runs for the whole op
    autocast = None  # {"cpu": policy, "cuda": policy}: what torch.autocast does to its inputs (torchlang/autocast.py)
    not_differentiated_by_torch = frozenset()  # arguments PyTorch's autograd does not differentiate (our rule does)
    torch_direct_vjp = None  # torch executor: a backward needing no forward recomputation (registered by the executor; ``.wanted``: for which inputs' gradients, default the first's)
    torch_saved_statistics = None  # torch executor: rewrite of a forward/vjp pair that reuses forward statistics
    # torch executor: rewrite of such a pair whose forward keeps eager's autograd graph, or what that graph keeps (an
    # attention whose mask needs a gradient: the math kernel's probabilities, executors/attention_math.py)
    torch_kept_graph = None
    # torch executor, fused programs only (they round otherwise than eager anyway): rewrite of such a pair onto
    # kernels eager does not run for the call (attention with narrower value heads: executors/narrow_value_attention.py)
    torch_fused_program_pair = None
    # torch executor: (forward line) -> bytes the forward keeps for its paired backward line beyond what the trace
    # before executors shows (attention's output and log-sum-exp; the memory plan's probe counts them)
    torch_saved_statistics_bytes = None
    # torch executor: (forward line) -> whether its kernel keeps memory for the backward that the memory plan does not
    # count (an attention eager runs with its math kernel keeps its probabilities in a kept autograd graph)
    torch_holds_unplanned = None
    # (*args, **kwargs) -> the outputs made without tracing the decomposition, or None (traced then): where the trace
    # keeps no decompositions (``Trace.keep_decompositions``) and the torch executor runs the op whole, the
    # decomposition is never read (the optimizers' multi-tensor updates: ~15 lines per parameter, ~0.1 s a trace of T5)
    results_without_decomposition = None
    fusion_form = None  # fusing executors: (line args, kwargs) -> the torch function they compile for the op's line, or None
    fusion_vjp_form = None  # the same for the line of its ``<name>_vjp`` (executors/regions.py ``fusion_form``)
    inplace_variant = None  # the in-place symbol computing the same with the same arguments (torchlang/inplace.py)
    python_op = infix = mirrored = None  # elementwise prims on Python numbers (prims/elementwise.py ``_on_numbers``)
    # torch executor (executors/buffers.py): {torch callable a line of the op runs: its ``out=`` form, which
    # computes the same into given tensors}; kept buffers write the line's results through it
    torch_out_forms = None
    # torch executor (executors/buffers.py): the torch callables of the op whose results share no memory with their
    # arguments (a line running any other is taken to alias all its tensor arguments)
    torch_fresh = frozenset()
    # torch executor (executors/layout_rules.py): ``rule(bsym, tensors, outputs) -> bool`` sets the outputs' eager
    # layout without running the op (or leaves them row-major, as created) and says whether it knew it
    layout_rule = None
    vjp_layout_rule = None  # the same for the op's ``<name>_vjp`` line
    # nvFuser (executors/nvfuser_fusion.py): how a fusion defines the op's line, ``(kind, nvFuser op)``
    nvfuser_translation = None
    # ``() -> (reader, runner)`` for an op whose kernel eager picks from process-wide switches (SDPA's backend
    # switches): ``reader()`` reads them; ``runner(value)`` is a torch callable running the op under that value.
    # A call made under switches the function itself set (``with sdpa_kernel(...)`` inside it) runs under them on
    # every call (acquisition/kernel_switches.py)
    kernel_switches = None
    # ``(requires_grad, *args, **kwargs) -> torch callable | None`` for an op whose kernel eager picks by whether its
    # arguments require grad (SDPA on the CPU: a mask requiring grad rules flash out, eager runs its math kernel): the
    # callable running that kernel, recorded as the line's ``torch_fn`` so that its layout and values are eager's
    # (acquisition/dispatch.py); ``requires_grad(t)``: eager's ``t.requires_grad`` while tracing.  Each such callable
    # names the op as its ``kernel_of``: the op's ``layout_rule`` does not describe it (its run gives the layout)
    kernel_by_requires_grad = None
    # memory planning (transforms/remat_policy.py): ``(bsym) -> bool``, whether the backward computes this line's
    # output again instead of keeping it from the forward (an FSDP2 unit's gathered parameters that are resharded
    # after its forward: torchlang/distributed.py)
    recompute_in_backward = None
    # Lists in, lists out, result ``i`` computed from the ``i``-th entries alone (the other arguments shared): a line
    # may run as one line per index with the same values (transforms/early_updates.py: optimizer updates per parameter)
    splits_by_index = False
    # ``(bsym, is_read) -> bsym``: the line computing only the results ``is_read(result)`` says someone reads, the
    # others None, for an op whose kernel can skip results (transforms/dce.py; prims.convolution_backward)
    narrowed = None
    # torch executor (executors/buffers.py): its torch kernel allocates scratch memory of a size no rule here knows
    # (the CPU convolution backward's oneDNN buffers: 14 KiB on ResNet's 1 KiB activations), so a call may peak at
    # one of its lines: kept buffers must not raise that line's memory
    torch_unknown_scratch = False
    # ``(*args, **kwargs) -> int | None``: the bytes its torch kernel allocates and frees inside the line, None where
    # unknown for these arguments; where declared it answers for ``torch_unknown_scratch`` (``opaque.scratch_rule``)
    scratch_bytes = None
    # executors/buffers.py: a line whose backend allocates memory the plan does not see, outside its kernel (a
    # collective's buffers, made on the backend's own threads): the program's kept buffers get no room beyond its
    # own planned peak (``buffers._room``)
    torch_unseen_memory = False

    def __init__(self, name: str, fn: Callable, *, module: str, is_prim: bool = False, tags: tuple = ()):
        self.name = name
        self.fn = fn
        self.module = module
        self.is_prim = is_prim
        self.tags = tags  # checked against TAGS (the setter below)
        self.__doc__ = getattr(fn, "__doc__", None)
        self.id = f"{module}.{name}"

    def __repr__(self) -> str:
        return f"<Symbol {self.id}>"

    @property
    def print_name(self) -> str:
        return self.id

    def codegen_globals(self) -> dict:
        """Names the printed call needs in scope."""
        ns = codegen.namespaces.get(self.module) if self.module in ("prims", "ltorch") else None
        return {} if ns is None else {self.module: ns}

    @property
    def tags(self) -> frozenset:
        return self._tags

    @tags.setter
    def tags(self, tags) -> None:
        self._tags = checked_tags(tags, f"{getattr(self, 'module', '?')}.{getattr(self, 'name', '?')}")

    @property
    def has_side_effect(self) -> bool:
        """Whether a call mutates something or must run even when nobody reads its outputs."""
        return bool(self.tags & SIDE_EFFECT_TAGS)

    @property
    def runs_opaquely(self) -> bool:
        """An op the compiler does not know, run as called (tag ``"opaque"``): anything may happen in it."""
        return "opaque" in self.tags

    @property
    def draws_random(self) -> bool:
        """Whether a call uses or changes a global random generator's state (tag ``"random"``)."""
        return "random" in self.tags

    def kernel_scratch(self, *args, **kwargs) -> int | None:
        """The bytes this op's torch kernel allocates and frees inside one line with these arguments: its rule's
        answer (``scratch_bytes``), else None (unknown) where ``torch_unknown_scratch``, else 0."""
        if self.scratch_bytes is not None:
            return self.scratch_bytes(*args, **kwargs)
        return None if self.torch_unknown_scratch else 0

    def __call__(self, *args, **kwargs):
        trc = context.get_trace()
        if trc is None:
            if eager_executor is None:
                raise RuntimeError(f"{self.id} was called outside tracing before any executor was imported; import thunder_train first")
            return eager_executor(self, args, kwargs)
        if self.is_prim:
            out = self.fn(*args, **kwargs)
            bsym = BoundSymbol(self, args, kwargs, out, ())
            if _is_size(out):
                # Size arithmetic is recorded at the top of the program, never inside a composite:
                # any later line may use the size, whichever executor claims the composite.
                trc._scopes[0].append(bsym)
                return out
        else:
            direct = self.results_without_decomposition
            out = None if direct is None or trc.keep_decompositions else direct(*args, **kwargs)
            if out is not None:
                subs = ()
            else:
                claimed = getattr(self, "torch_impl", None) is not None
                trc.push_scope()
                trc.claimed_depth += claimed
                try:
                    out = self.fn(*args, **kwargs)
                finally:
                    subs = trc.pop_scope()
                    trc.claimed_depth -= claimed
            if not subs and _returns_an_input(out, args, kwargs):
                # A no-op at trace level (contiguous(), to(same dtype), ...): nothing to record.
                return out
            bsym = BoundSymbol(self, args, kwargs, _without_inputs(out, args, kwargs), tuple(subs))
        if layout_hook is not None and not trc.claimed_depth:
            layout_hook(bsym)
        if region_hook is not None:
            region_hook(trc, bsym)
        trc.add(bsym)
        return out


def _is_size(x) -> bool:
    """Symbolic sizes and checked hyper-parameters, data-dependent sizes (and arithmetic on them)."""
    return is_checked(x) or is_unbacked(x)


def _returns_an_input(out, args, kwargs) -> bool:
    outs = [o for o in tree_flatten(out)[0] if is_proxy(o)]
    if not outs:
        return True
    ins = {id(x) for x in tree_flatten((args, kwargs))[0]}
    return all(id(o) in ins for o in outs)


def _without_inputs(out, args, kwargs):
    """``out`` with the entries that are the op's own inputs as None (printed ``_``): ``broadcast_tensors(x, b)``
    returns ``x`` itself where it has the broadcast shape, as eager does; the line computes only the others, so
    every value keeps the one line that computes it."""
    ins = {id(x) for x in tree_flatten((args, kwargs))[0] if is_proxy(x)}
    if not ins or not isinstance(out, (tuple, list)) or not any(is_proxy(o) and id(o) in ins for o in out):
        return out
    vals = [None if is_proxy(o) and id(o) in ins else o for o in out]
    return out._make(vals) if hasattr(out, "_make") else type(out)(vals)  # named tuples, torch.return_types


def run_eagerly(sym, *args, **kwargs):
    """Run ``sym`` on real values now, even while a trace is being recorded (nothing is recorded)."""
    return eager_executor(sym, args, kwargs)


class BoundSymbol:
    """One line of a trace: ``output = sym(*args, **kwargs)``."""

    _FIELDS = ("sym", "args", "kwargs", "output", "subsymbols", "comment", "torch_fn", "source", "region")
    # ``_flat_args`` / ``_flat_outputs``: the leaves, found once (every pass asks for them, many times a line; the
    # line's arguments and outputs are not changed after it is made: ``replace`` makes a new line); ``_all_reads``
    # the same for ``all_reads``; ``_side_effect`` / ``_random`` for ``has_side_effect`` / ``draws_random`` (facts of
    # the symbol and its decomposition, neither of which a line changes).
    __slots__ = _FIELDS + ("_flat_args", "_flat_outputs", "_all_reads", "_side_effect", "_random", "_sizes_inside")

    def __init__(self, sym, args, kwargs, output, subsymbols=(), comment: str | None = None, torch_fn=None, source=None,
                 region=None):
        # region: where the line sits for the memory planner (transforms/remat.py): a checkpoint region's mark,
        # or the mark of a line a traced backward recorded; None elsewhere.
        self.region = region
        # torch_fn: the torch callable the user actually called (torch.softmax,
        # F.softmax, Tensor.softmax ...); the torch executor calls exactly it.
        self.torch_fn = torch_fn
        # source: for a line an executor claimed, the symbol it was lowered from (a prim, a torch-language
        # symbol, a ``<name>_vjp``): passes after lowering read the op's facts (tags) from it.
        self.source = source
        self.sym = sym
        self.args = tuple(args)
        self.kwargs = dict(kwargs)
        self.output = output
        self.subsymbols = subsymbols
        self.comment = comment
        self._flat_args = self._flat_outputs = self._all_reads = self._side_effect = self._random = None
        self._sizes_inside = None

    def replace(self, **changes) -> "BoundSymbol":
        d = {s: getattr(self, s) for s in self._FIELDS}
        d.update(changes)
        new = BoundSymbol(**d)
        if "args" not in changes and "kwargs" not in changes:
            new._flat_args = self._flat_args
            if "subsymbols" not in changes:
                new._all_reads = self._all_reads
        if "output" not in changes:
            new._flat_outputs = self._flat_outputs
        return new

    def renamed(self, mapping: dict, *, inside: bool = False) -> "BoundSymbol":
        """This line reading ``mapping[id(v)]`` wherever it reads a value ``v`` that ``mapping`` renames (a pass that
        drops or replaces lines); with ``inside``, its decomposition's lines too."""
        sub = lambda x: mapping.get(id(x), x) if is_proxy(x) else x  # noqa: E731
        changes = dict(args=tree_map(sub, self.args), kwargs=tree_map(sub, self.kwargs))
        if inside:
            changes["subsymbols"] = tuple(s.renamed(mapping, inside=True) for s in self.subsymbols)
        return self.replace(**changes)

    def flat_args(self) -> tuple:
        flat = self._flat_args
        if flat is None:
            flat = self._flat_args = tuple(tree_leaves((self.args, self.kwargs)))
        return flat

    def all_reads(self) -> tuple:
        """The proxies the line reads, its decomposition's reads included (the memory passes: lowering may run those
        lines instead); found once (a pass over a step's trace asks it of every line, several passes in a row)."""
        reads = self._all_reads
        if reads is None:
            reads = [a for a in self.flat_args() if is_proxy(a)]
            for s in self.subsymbols:
                reads.extend(s.all_reads())
            reads = self._all_reads = tuple(reads)
        return reads

    def sizes_inside(self) -> tuple:
        """``(checked values its decomposition reads, symbolic sizes in the shapes of its decomposition's values)``,
        found once: computed at the top of the program, not passed as arguments (DCE keeps them)."""
        found = self._sizes_inside
        if found is None:
            reads, dims = [], []
            for sub in self.subsymbols:
                reads.extend(a for a in sub.flat_args() if is_checked(a))
                dims.extend(d for o in sub.flat_outputs() for d in getattr(o, "_tt_shape", ()) if type(d) is not int)
                inner_reads, inner_dims = sub.sizes_inside()
                reads.extend(inner_reads)
                dims.extend(inner_dims)
            found = self._sizes_inside = (tuple(reads), tuple(dims))
        return found

    def flat_outputs(self) -> tuple:
        flat = self._flat_outputs
        if flat is None:
            flat = self._flat_outputs = tuple(tree_leaves(self.output))
        return flat

    @property
    def has_side_effect(self) -> bool:
        """The symbol's own side effect, or one of its decomposition's (DCE keeps the line)."""
        found = self._side_effect
        if found is None:
            found = self._side_effect = self.sym.has_side_effect or any(s.has_side_effect for s in self.subsymbols)
        return found

    @property
    def draws_random(self) -> bool:
        """The symbol or one of its decomposition's uses or changes a global generator's state: the line runs
        even when nobody reads its outputs (an unread ``torch.rand`` still advances the generator in eager)."""
        found = self._random  # the symbol's and the decomposition's (the source is set after the line is made)
        if found is None:
            found = self._random = self.sym.draws_random or any(s.draws_random for s in self.subsymbols)
        src = self.source
        return found or (src is not None and src.draws_random)

    def __repr__(self) -> str:
        return "\n".join(codegen.format_bsym(self, None, with_subsymbols=False))


def flat_proxies(x) -> list:
    return [v for v in tree_flatten(x)[0] if is_proxy(v)]


def may_raise_on_values(bsym) -> bool:
    """Whether the line's run-time values can make it raise: its op is tagged ``"fallible"`` where it is defined (an
    index out of range, a failed check), or runs opaquely (``Symbol.runs_opaquely``, tag ``"opaque"``: anything may
    raise).  The gradient line of a fallible op (``<op>_vjp``) is not: in a program that computes gradients, the
    op's own line runs before it on the same indices and targets and raises first (its backward kernels check
    nothing the forward did not).  Re-inplacing (executors/reinplace.py) writes inputs in place only after the
    last such line, so that a call that raises leaves them as they were; optimizer updates run during the backward
    (transforms/early_updates.py) after it."""
    src = bsym.source if bsym.source is not None else bsym.sym
    if "fallible" in src.tags:
        return True
    return src.runs_opaquely or getattr(bsym.sym, "runs_opaquely", False)
