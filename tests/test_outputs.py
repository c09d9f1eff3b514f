"""Outputs are rebuilt with real tensors, whatever structure the function returns (torch.utils._pytree)."""
import collections
import copy
import dataclasses
import os
import typing

import pytest
import torch
import torch.utils._pytree as pytree

import thunder_train as tt
from thunder_train.compiler.errors import TracingError
from thunder_train.compiler.proxies import TensorProxy

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _leaves(x):
    return pytree.tree_leaves(x)


def _no_proxy(x):
    for v in _leaves(x):
        assert type(v) is not TensorProxy
    if dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            assert type(getattr(x, f.name)) is not TensorProxy


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    logits: torch.Tensor
    extra: typing.Any = None


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: torch.Tensor
    n: int = 3
    later: torch.Tensor = dataclasses.field(init=False, default=None)


class Pair(typing.NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class MyDict(collections.OrderedDict):
    pass


class Registered:
    def __init__(self, a, b, tag):
        self.a, self.b, self.tag = a, b, tag


pytree.register_pytree_node(
    Registered, lambda r: ([r.a, r.b], r.tag), lambda vals, tag: Registered(vals[0], vals[1], tag),
)


class Opaque:
    def __init__(self, t):
        self.t = t


def _dataclass_fn(x, w):
    y = x @ w
    return Out(loss=y.sum(), logits=y, extra={"h": [y * 2, Pair(y + 1, y - 1)]})


def _check_dataclass_out(out, ref):
    assert type(out) is Out and type(out.extra["h"][1]) is Pair
    _no_proxy(out)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.logits, ref.logits)
    torch.testing.assert_close(out.extra["h"][0], ref.extra["h"][0])
    torch.testing.assert_close(out.extra["h"][1].second, ref.extra["h"][1].second)


@pytest.mark.parametrize("thin", [False, True])
def test_dataclass_namedtuple_nesting(thin):
    x, w = torch.randn(3, 4), torch.randn(4, 5)
    cf = tt.compile(_dataclass_fn, thin=thin)
    outs = [cf(x, w) for _ in range(3)]
    for out in outs:
        _check_dataclass_out(out, _dataclass_fn(x, w))
    assert outs[0] is not outs[1]  # a fresh structure per call, as in eager
    if thin:
        assert tt.compile_stats(cf).thin_calls >= 1


def test_dataclass_output_with_autograd():
    x, w = torch.randn(3, 4), torch.randn(4, 5, requires_grad=True)
    w2 = w.detach().clone().requires_grad_()
    out = tt.compile(_dataclass_fn)(x, w)
    ref = _dataclass_fn(x, w2)
    _check_dataclass_out(out, ref)
    (out.loss + out.extra["h"][1].first.sum()).backward()
    (ref.loss + ref.extra["h"][1].first.sum()).backward()
    torch.testing.assert_close(w.grad, w2.grad)


def test_frozen_dataclass_and_fields_without_init():
    def f(x):
        r = Frozen(a=x.sin(), n=5)
        object.__setattr__(r, "later", x.cos())
        return r

    x = torch.randn(4)
    out = tt.compile(f)(x)
    assert type(out) is Frozen and out.n == 5
    torch.testing.assert_close(out.a, x.sin())
    torch.testing.assert_close(out.later, x.cos())


def test_ordereddict_subclass_and_plain_ordereddict():
    def f(x):
        d = MyDict()
        d["b"] = x + 1
        d["a"] = x * 3
        return d, collections.OrderedDict(z=x.exp())

    x = torch.randn(3)
    d, od = tt.compile(f)(x)
    assert type(d) is MyDict and list(d) == ["b", "a"] and type(od) is collections.OrderedDict
    torch.testing.assert_close(d["a"], x * 3)
    torch.testing.assert_close(od["z"], x.exp())
    _no_proxy((d, od))


def test_user_type_registered_with_torch_pytree():
    def f(x):
        return Registered(x.relu(), [x.tanh()], tag="t")

    x = torch.randn(5)
    out = tt.compile(f)(x)
    assert type(out) is Registered and out.tag == "t"
    torch.testing.assert_close(out.a, x.relu())
    torch.testing.assert_close(out.b[0], x.tanh())


def test_unrebuildable_type_is_a_trace_time_error_naming_it():
    with pytest.raises(TracingError, match="test_outputs.Opaque"):
        tt.compile(lambda x: Opaque(x * 2))(torch.randn(2))
    # Without tensors inside, the object is returned as is (it is the same object every call).
    marker = Opaque(None)
    r = tt.compile(lambda x: (x + 1, marker))(torch.randn(2))
    assert r[1] is marker


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def test_hf_model_output_forward_and_backward_match_eager():
    model = _tiny_gpt2()
    ref_model = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 8))
    out = tt.compile(model)(ids, labels=ids)
    ref = ref_model(ids, labels=ids)
    assert type(out) is type(ref)
    _no_proxy(out)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.logits, ref.logits)
    # The cache comes back as the transformers type, holding real tensors.
    assert type(out.past_key_values) is type(ref.past_key_values)
    torch.testing.assert_close(out.past_key_values.layers[1].keys, ref.past_key_values.layers[1].keys)
    out.loss.backward()
    ref.loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("thin", [False, True])
def test_whole_step_returning_a_model_output(thin):
    model = _tiny_gpt2()
    ref_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, eps=1e-6)

    def step(model, opt, ids):
        out = model(ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        return out

    cs = tt.compile(step, thin=thin)
    for _ in range(4):
        ids = torch.randint(0, 100, (2, 8))
        out, ref = cs(model, opt, ids), step(ref_model, ref_opt, ids)
        assert type(out) is type(ref)
        _no_proxy(out)
        torch.testing.assert_close(out.loss, ref.loss, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    if thin:
        assert tt.compile_stats(cs).thin_calls >= 1


def test_hf_encoder_decoder_output_with_its_cache():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, dropout_rate=0.0)
    model = transformers.T5ForConditionalGeneration(cfg)
    ref_model = copy.deepcopy(model)
    ids = torch.randint(0, 100, (2, 8))
    out, ref = tt.compile(model)(input_ids=ids, labels=ids), ref_model(input_ids=ids, labels=ids)
    assert type(out) is type(ref) and type(out.past_key_values) is type(ref.past_key_values)
    _no_proxy(out)
    torch.testing.assert_close(out.loss, ref.loss)
    torch.testing.assert_close(out.encoder_last_hidden_state, ref.encoder_last_hidden_state)
    out.loss.backward()
    ref.loss.backward()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=n)


def test_runtime_numbers_in_a_user_type_are_returned_as_values():
    def f(x):
        return Out(loss=x.sum(), logits=x * 2, extra=x.max().item()), x.min().item()

    x = torch.randn(4)
    out, lo = tt.compile(f)(x)
    assert type(out) is Out and out.extra == x.max().item() and lo == x.min().item()
