"""A module's private scalars and plain containers that the compiled function reads are guarded by value
(acquisition/instance_reads.py): a change between calls runs eager's computation, in thin mode, on the full path
and through ``tt.compile(model)``; a private attribute the function does not read changes nothing.

Found with peft: after ``merge_adapter()`` (its layers' ``merged_adapters`` list appended in place, read through a
property) the compiled forward still ran the adapter's product beside the merged weight."""
from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

import thunder_train as tt

from _module_modes import MODES, classes_left_as_they_were, compiled, each_change_matches_eager


class Base(nn.Module):
    _flag = False  # a class default the instance shadows (peft declares its layers' state so)


class Stateful(Base):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._scale = 1.0
        self._mode = "a"
        self.cfg = {"k": 1.0}
        self.merged = []
        self._flag = True
        self._bookkeeping = 0  # never read by forward: Lightning-style state assigned every step
        self._tags = {"a"}
        self.nested = {"a": [1.0]}

    @property
    def is_merged(self):
        return bool(self.merged)

    def forward(self, x):
        y = self.lin(x) * self._scale * self.cfg["k"]
        if self._mode == "b":
            y = y + 1
        if self.is_merged:
            y = y * 2
        y = y * len(self._tags) * self.nested["a"][-1]
        return y - 3 if self._flag else y


CHANGES = {
    "private float reassigned": lambda m: setattr(m, "_scale", 3.0),
    "private str reassigned": lambda m: setattr(m, "_mode", "b"),
    "dict item set in place": lambda m: m.cfg.__setitem__("k", 5.0),
    "list appended in place": lambda m: m.merged.append("default"),
    "list cleared in place": lambda m: m.merged.clear(),
    "shadowed class default": lambda m: setattr(m, "_flag", False),
    "set item added in place": lambda m: m._tags.add("b"),
    "list inside a dict changed in place": lambda m: m.nested["a"].append(4.0),
}


@pytest.mark.parametrize("mode", MODES)
def test_each_change_runs_eagers_computation(mode):
    m, x = Stateful(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    each_change_matches_eager(lambda: call(x), lambda: m(x), [(what, lambda c=c: c(m)) for what, c in CHANGES.items()])
    reasons = tt.compile_stats(cf).retrace_reasons
    for name in ("_scale", "_mode", "cfg", "merged", "_flag", "_tags", "nested"):
        assert any(f".{name}" in r or f"attr {name}" in r for r in reasons), (name, reasons)


@pytest.mark.parametrize("mode", MODES)
def test_every_instance_of_a_class_is_watched(mode):
    """The first instance's watch puts the class's stand-in in place; the later ones are watched through it (they were
    not: only the first of GPT-2's five LayerNorms had its ``normalized_shape`` guarded)."""
    m, x = nn.Sequential(Stateful(), Stateful(), Stateful()), torch.randn(2, 4)
    _, call = compiled(mode, m)
    for k in (2, 1):
        for _ in range(3):
            torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
        m[k]._scale += 1.0
        m[k].merged.append("default")
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)


class Scaled(nn.LayerNorm):
    """A subclass of a class another walked module's watch already stands in for (nn.LayerNorm's ``normalized_shape``)."""

    def __init__(self):
        super().__init__(4)
        self._gain = 1.0

    def forward(self, x):
        return super().forward(x) * self._gain


class WithProperty(nn.Module):
    @property
    def mode(self):  # a data descriptor: it wins over an instance __dict__ entry of the same name, in eager too
        return "property"


class ShadowedByProperty(WithProperty):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.__dict__["mode"] = ["dict"]

    def forward(self, x):
        return self.lin(x) * (2.0 if self.mode == "property" else 3.0)


@pytest.mark.parametrize("mode", MODES)
def test_subclasses_and_base_class_descriptors_read_as_in_eager(mode):
    m, x = nn.Sequential(nn.LayerNorm(4), Scaled(), ShadowedByProperty()), torch.randn(2, 4)
    _, call = compiled(mode, m)
    for _ in range(3):
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    m[1]._gain = 2.0
    torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    assert "mode" not in vars(ShadowedByProperty) and "_gain" not in vars(Scaled)


@pytest.mark.parametrize("mode", MODES)
def test_a_private_attribute_the_function_does_not_read_changes_nothing(mode):
    m, x = Stateful(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    for step in range(6):
        m._bookkeeping = step  # assigned every step, as Lightning assigns its own
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    stats = tt.compile_stats(cf)
    assert stats.cache_misses == 1 and not stats.retrace_reasons, stats.retrace_reasons
    if mode == "thin":
        assert stats.thin_calls >= 3 and not stats.thin_invalidations, stats.thin_invalidations


def test_the_watch_leaves_the_classes_as_they_were_also_when_tracing_fails():
    m, x = Stateful(), torch.randn(2, 4)
    classes_left_as_they_were(m, x, (Stateful, Base))
    assert m._flag is True and Stateful._flag is False and m.merged == [] and m._scale == 1.0


def test_plain_key_tells_containers_and_nans_apart():
    from thunder_train.compiler.acquisition.instance_reads import NOT_PLAIN, plain_key

    assert plain_key([1, "a"]) == plain_key([1, "a"]) != plain_key((1, "a"))
    assert plain_key({"k": float("nan")}) == plain_key({"k": float("nan")})
    assert plain_key({1, 2}) == plain_key({2, 1}) and plain_key({"a": [1]}) != plain_key({"a": [2]})
    assert plain_key([torch.ones(1)]) is NOT_PLAIN and plain_key(list(range(100))) is NOT_PLAIN
    hash(plain_key({"a": [1, (2.0, None)], "b": {3}}))


# ---------------------------------------------------------------------------
# peft: LoRA adapters on a tiny Llama (tests/_zoo.py), against eager
# ---------------------------------------------------------------------------
def _lora_llama(**extra):
    peft = pytest.importorskip("peft")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _zoo

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], **extra)
    return peft.get_peft_model(_zoo.build("llama"), config), _zoo


@pytest.mark.parametrize("mode", MODES)
def test_peft_adapter_switches_and_merges_run_eagers_forward(mode):
    model, _zoo = _lora_llama(init_lora_weights=False)
    import peft

    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["k_proj"], init_lora_weights=False))
    batch = _zoo.batches("llama", 1)[0]
    fwd = lambda m, b: m(**b).loss.detach()  # noqa: E731
    _, call = compiled(mode, model, fwd)
    steps = [("default", lambda: None), ("merge_adapter", model.merge_adapter), ("unmerge_adapter", model.unmerge_adapter),
             ("set_adapter second", lambda: model.set_adapter("second")), ("set_adapter default", lambda: model.set_adapter("default")),
             ("disable_adapter_layers", model.base_model.disable_adapter_layers),
             ("enable_adapter_layers", model.base_model.enable_adapter_layers)]
    each_change_matches_eager(lambda: call(batch), lambda: fwd(model, batch), steps)
