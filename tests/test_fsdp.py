"""fully_shard (FSDP2) models in compiled whole steps, against eager FSDP2, on gloo CPU processes
(tests/_fsdp_whole_step.py runs the ranks: 2 and then 4, forked from the test process, tests/_dist.py)."""
from __future__ import annotations

import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _dist import run_ranks, run_script  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """{world: [rank 0's results, rank 1's, ...]} for process groups of 2 and 4 ranks."""
    out = tmp_path_factory.mktemp("fsdp2")
    run_ranks("_fsdp_whole_step", out, 2, 4)
    return {w: [torch.load(out / f"w{w}" / f"rank{r}.pt", weights_only=False) for r in range(w)] for w in (2, 4)}


@pytest.fixture(scope="module")
def two_ranks(ranks):
    return ranks[2]


def _check_equal_to_eager(ranks, case, n_thin):
    names_gpt = case.startswith("gpt")
    for r in ranks:
        eager, compiled = r[case]["eager"], r[case]["compiled"]
        # Each rank's losses, sharded parameters and optimizer state are eager FSDP2's (float32 rounding) ...
        torch.testing.assert_close(torch.stack(compiled["losses"]), torch.stack(eager["losses"]))
        names = r["gpt_names"] if names_gpt else [""] * len(eager["params"])
        for n, a, b in zip(names, compiled["params"], eager["params"]):
            if not _key_bias(n):
                torch.testing.assert_close(a, b)
        for n, sa, sb in zip(names, compiled["state"], eager["state"]):
            assert sa.keys() == sb.keys()
            for k in sa:
                if not _key_bias(n):
                    torch.testing.assert_close(sa[k], sb[k])
        # ... of the same kinds: DTensor parameters and moments, a plain step count.
        assert compiled["kinds"] == eager["kinds"] and set(compiled["param_types"]) == {"DTensor"}
        assert compiled["thin_calls"] == n_thin
    # Different data per rank, yet one model: the shards differ (rank 0 holds other rows than rank 1).
    assert not torch.equal(torch.stack(ranks[0][case]["compiled"]["losses"]), torch.stack(ranks[1][case]["compiled"]["losses"]))


def _key_bias(name):
    """The attention qkv bias holds the key bias, whose gradient is rounding noise that Adam scales up
    (_models.without_key_bias); its shards split q, k and v differently on each rank, so it is left out whole."""
    return name.endswith("qkv.bias")


@pytest.mark.parametrize("case,n_thin", [("mlp_adamw", 0), ("mlp_adamw_thin", 1), ("mlp_sgd_keep_gathered", 0),
                                         ("gpt_adamw_thin", 0), ("mlp_bf16_params_fp32_reduce", 0)])
def test_fsdp2_step_equals_eager_on_two_ranks(two_ranks, case, n_thin):
    _check_equal_to_eager(two_ranks, case, n_thin)


def test_fsdp2_collectives_are_lines_of_the_trace(two_ranks):
    trace = two_ranks[0]["mlp_adamw"]["compiled"]["trace"]
    # Four sharded parameters: four all-gathers in the forward, four reduce-scatters (averaging) in the backward,
    # each waited for; FSDP2's own hooks and collectives do not run.  reshard_after_forward=True (the default): the
    # backward gathers the one weight it reads (the second linear's, for the first one's input gradient) again,
    # rather than keeping it from the forward ...
    assert len(re.findall(r"= torch\.ops\._c10d_functional\.all_gather_into_tensor\(", trace)) == 5
    assert re.search(r"r\d+ = torch\.ops\._c10d_functional\.all_gather_into_tensor\(arg0_2_weight, 2, ", trace)
    assert len(re.findall(r"= torch\.ops\._c10d_functional\.reduce_scatter_tensor\(\w+, 'avg', 2, ", trace)) == 4
    assert len(re.findall(r"= ttex\.wait_collective\(", trace)) == 9
    # ... with reshard_after_forward=False it keeps it.
    kept = two_ranks[0]["mlp_sgd_keep_gathered"]["compiled"]["trace"]
    assert len(re.findall(r"= torch\.ops\._c10d_functional\.all_gather_into_tensor\(", kept)) == 4
    # Each wait sits at the first use of its result: the first reduce-scatters of the backward are waited for
    # only after the backward of the layers before them has run (by the optimizer).
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip() and not ln.strip().startswith(("#", "del "))]
    starts = {ln.split(" = ")[0]: i for i, ln in enumerate(lines) if "reduce_scatter_tensor(" in ln}
    waits = {re.search(r"wait_collective\((\w+),", ln).group(1): i for i, ln in enumerate(lines) if "wait_collective(" in ln}
    gaps = sorted(waits[t] - i for t, i in starts.items())
    assert gaps[-1] > 5 and any(re.search(r"torch\.(mm|matmul)\(", ln) for ln in lines[min(starts.values()):max(waits.values())]), gaps
    assert "fsdp" not in trace.replace("fsdp_all_gather", "")
    # Mixed precision: each shard is cast to bfloat16 before its all-gather; each gradient to float32 before its
    # reduce-scatter (FSDP2's param_dtype and reduce_dtype).
    mp = two_ranks[0]["mlp_bf16_params_fp32_reduce"]["compiled"]["trace"]
    assert re.search(r"= torch\.ops\._c10d_functional\.all_gather_into_tensor\(\w+, 2, '\w+'\)  # \w+: \"cpu bf16", mp)
    assert not re.search(r"= torch\.ops\._c10d_functional\.reduce_scatter_tensor\(.*# \w+: \"cpu bf16", mp)


def _plain(trace):
    return [ln.strip() for ln in trace.splitlines() if ln.strip() and not ln.strip().startswith(("#", "del ", "_"))]


def _is_compute(line):
    return not any(w in line for w in ("_c10d_functional", "wait_collective(", "__getitem__(", "ttex.pad("))


def test_fsdp2_next_units_all_gathers_start_before_the_current_units_compute(two_ranks):
    # Forward (asked for with THUNDER_TRAIN_PREFETCH=1; on CPU it is off by default): the second linear's
    # all-gathers start before the first linear computes (FSDP2's prefetch), and each unit's gathers start
    # together, before any of their waits.
    lines = _plain(two_ranks[0]["mlp_adamw"]["compiled"]["trace"])
    first_linear = next(i for i, ln in enumerate(lines) if "linear" in ln)
    gathers = [i for i, ln in enumerate(lines) if "all_gather_into_tensor(arg0_2_" in ln]
    assert len(gathers) == 3 and gathers[1] < first_linear, lines[:first_linear + 1]
    first_wait = next(i for i, ln in enumerate(lines) if "wait_collective(" in ln)
    assert all("all_gather_into_tensor(arg0_0_" in ln for ln in lines[:first_wait] if "all_gather" in ln[:60]) and \
        sum("all_gather_into_tensor(arg0_0_" in ln for ln in lines[:first_wait]) == 2
    # ... by default it does not (CPU): the second linear is gathered after the first one computed.
    lines = _plain(two_ranks[0]["mlp_adamw_thin"]["compiled"]["trace"])
    first_linear = next(i for i, ln in enumerate(lines) if "linear" in ln)
    assert not any("all_gather_into_tensor(arg0_2_" in ln for ln in lines[:first_linear])
    # Backward (GPT, reshard_after_forward=True, THUNDER_TRAIN_PREFETCH=1): every parameter gathered again but the
    # first starts while the backward of the one before it computes; the values are eager's (tests above).
    for key in ("gpt_adamw_thin", "mlp_adamw"):
        lines = _plain(two_ranks[0][key]["compiled"]["trace"])
        starts = {ln.split(" = ")[0]: i for i, ln in enumerate(lines) if re.match(r"r\d+ = torch\.ops\._c10d_functional\.all_gather", ln)}
        waits = {re.search(r"wait_collective\((\w+),", ln).group(1): i for i, ln in enumerate(lines) if "wait_collective(" in ln}
        order = sorted(starts.values())
        assert len(order) == {"gpt_adamw_thin": 16, "mlp_adamw": 1}[key]
        for name, i in starts.items():
            if i != order[0]:
                assert any(_is_compute(ln) for ln in lines[i + 1:waits[name]]), (key, name)


def test_fsdp2_state_dict_and_dcp_between_compiled_steps(two_ranks):
    for r in two_ranks:
        c = r["checkpoint"]
        assert c["sd_types"] == ["DTensor"]
        # Saved after two compiled steps, loaded into a fresh model and optimizer, two more: the uninterrupted run.
        torch.testing.assert_close(torch.stack(c["resumed"]), torch.stack(c["whole"]))
        # ... and so does one loaded in place into the model and optimizer of a bound thin step, trained two steps
        # further (and switched by the test above), that step reused.
        for got in ("got", "got_in_place"):
            for a, b in zip(c[got][0], c["expected"][0]):
                torch.testing.assert_close(a, b)
            for sa, sb in zip(c[got][1], c["expected"][1]):
                assert sa.keys() == sb.keys()
                for k in sa:
                    torch.testing.assert_close(sa[k], sb[k])
        torch.testing.assert_close(torch.stack(c["resumed_in_place"]), torch.stack(c["whole"]))


def test_fsdp2_unsupported_configurations_are_refused(two_ranks):
    errors = two_ranks[0]["errors"]
    for key, words in {"shard_dim1": "sharding on dim 1", "hsdp": "HSDP", "no_sync": "set_requires_gradient_sync(False)",
                       "forward_only": "backward is not in the same function",
                       # a shard read outside its unit's forward and the optimizer: a norm, a matmul with the weight
                       "clip": "outside its fully_shard unit's forward", "tied_outside": "args[0].0.weight",
                       "offload": "CPU offloading", "grouped": "fully_shard of a list of modules",
                       "custom_all_gather": "a custom all-gather", "fp16_reduce": "gradients reduced in float16"}.items():
        msg, unchanged = errors[key]
        assert words in msg and "TracingError" in msg, (key, msg)
        assert unchanged, key  # a refused call leaves the parameters as they were
    compiled, eager = errors["eval"]  # evaluation under no_grad needs no backward
    torch.testing.assert_close(compiled, eager)
    # ... also where no_grad is inside the function, called with grad enabled (was refused as a forward without
    # its backward: grad mode was read where the function was called, not where the units ran)
    msg, compiled, eager = errors["eval_inside"]
    assert msg == "no error", msg
    torch.testing.assert_close(compiled, eager)


def test_fsdp2_switches_flipped_after_compiling_are_refused(two_ranks):
    # set_requires_gradient_sync(False) (on the root, or on one unit only) and a gradient divide factor set after
    # the thin step was bound: each is part of the guard, so the call retraces and is refused, leaving parameters and
    # optimizer state as they were (before, the bound program ran and reduce-scattered and stepped silently, where
    # eager FSDP2 accumulates without reducing and leaves the parameters alone).  Switched back: the same program.
    for r in two_ranks:
        s = r["switched"]
        for key, words in (("no_sync", "set_requires_gradient_sync(False)"), ("layer_no_sync", "set_requires_gradient_sync(False)"),
                           ("divide_factor", "a gradient divide factor")):
            msg, unchanged = s[key]
            assert "TracingError" in msg and words in msg, (key, msg)
            assert unchanged, key
        assert s["rerun"][0] == 0, s["rerun"]  # no new entry


def test_fsdp2_gradient_clipping_between_compiled_backward_and_update(two_ranks):
    # Clipping by total norm inside a compiled step is refused (above); what its message advises instead: forward and
    # backward compiled (twice per step, the second adding to the DTensor .grad: gradient accumulation that reduces
    # each micro-batch), clip_grad_norm_ eagerly on the DTensor gradients, the update compiled.  Losses, norms and
    # parameters equal the same three eagerly.
    for r in two_ranks:
        eager, compiled = r["clip_between"]["eager"], r["clip_between"]["compiled"]
        torch.testing.assert_close(torch.stack(compiled["values"]), torch.stack(eager["values"]))
        assert (torch.stack(eager["values"][2::3]) > 0.5).all()  # each step clipped
        for a, b in zip(compiled["params"], eager["params"]):
            torch.testing.assert_close(a, b)


def test_fsdp2_step_equals_eager_on_four_ranks(ranks):
    ranks = ranks[4]
    # Uneven shards of 33 and 5 rows over 4 ranks: one rank holds no row of the 5-row parameters (prefetch on:
    # the ranks' programs differ in their padding, not in the order of their collectives).
    _check_equal_to_eager(ranks, "mlp_adamw_thin", 1)


def test_fsdp2_unit_used_only_under_no_grad(two_ranks):
    # A frozen fully_shard unit (its parameters require grad, none is in the optimizer) run under no_grad inside
    # the step: gathered for the forward, no gradient and no reduce-scatter for it, as in eager FSDP2.
    for r in two_ranks:
        eager, compiled = r["no_grad_unit"]["eager"], r["no_grad_unit"]["compiled"]
        torch.testing.assert_close(torch.stack(compiled["losses"]), torch.stack(eager["losses"]))
        for a, b in zip(compiled["params"] + compiled["frozen"], eager["params"] + eager["frozen"]):
            torch.testing.assert_close(a, b)
        assert compiled["frozen_grads"] == eager["frozen_grads"] == [None, None]


def test_fsdp2_under_lightning_model_parallel_strategy(two_ranks):
    # ModelParallelStrategy(data_parallel_size=2) with fully_shard in configure_model, 2 gloo ranks (tests/_fsdp_callback.py,
    # in the module's forked ranks): the plain Trainer against ThunderCallback(thin=True, fuse_optimizer=True) (one
    # compiled whole-step program).
    ranks = [r["lightning"] for r in two_ranks]
    assert not torch.allclose(ranks[0]["eager"]["losses"], ranks[1]["eager"]["losses"])  # each rank its batches
    for r in ranks:
        torch.testing.assert_close(r["fused"]["losses"], r["eager"]["losses"])
        for a, b in zip(r["fused"]["params"], r["eager"]["params"]):
            torch.testing.assert_close(a, b)
        assert r["fused"]["param_types"] == r["eager"]["param_types"] == ["DTensor"]
        assert r["fused"]["programs"] == ["step"] and r["fused"]["thin_calls"] >= 3
        # Without fuse_optimizer the backward would run outside the program: refused at setup, clearly.
        assert "fuse_optimizer=True" in r["split"] and "ModelParallelStrategy" in r["split"], r["split"]
        # Clipping by norm would read every rank's gradient shards: refused at setup (it was refused by the first
        # step's trace, whose advice to clip outside the compiled step does not apply under the callback).
        assert "MisconfigurationException" in r["clip_norm"] and "gradient_clip_algorithm='value'" in r["clip_norm"], r["clip_norm"]


@pytest.fixture(scope="module")
def gloo_peaks(ranks, tmp_path_factory):
    """[rank 0's {"eager": peak, "compiled": peak}, rank 1's]: the GPT case's step on 2 gloo ranks of their own,
    forked from a fresh interpreter, not from this test worker: a rank forked from a worker that had run thousands of
    tests (its threads: torch's pools, gloo's, the fusion worker) died of heap corruption in CI now and then (SIGABRT,
    with and without torch.profiler: docs/distributed.md)."""
    out = tmp_path_factory.mktemp("fsdp2_peak")
    run_script("_fsdp_whole_step.py", out, "peak")
    return [torch.load(out / "wpeak" / f"peak{r}.pt", weights_only=False) for r in range(2)]


def test_fsdp2_peak_memory_per_rank_on_gloo_is_at_most_eager(gloo_peaks):
    # One more step of the GPT case (reshard_after_forward=True, prefetch) on each gloo rank, its peak counted by
    # c10's allocator across threads (gloo's workers allocate and free collective buffers; tests/_peak.py, which also
    # checks that the count returns to where it was).
    for r in gloo_peaks:
        assert 0 < r["compiled"] <= r["eager"], r


def _step_peak(fn, compiled, *args):
    """Peak bytes of one call above what was live before (torch.profiler's allocator events, tests/_peak.py), plus
    the buffers a compiled program keeps between calls; the call's net allocation must be zero (no free was missed)."""
    import thunder_train as tt
    from _peak import peak_and_net_call_bytes
    from thunder_train.compiler.executors.buffers import kept_bytes

    peak, net = peak_and_net_call_bytes(lambda: fn(*args))
    assert net == 0, net
    return peak + (kept_bytes(tt.last_traces(fn)[-1]) if compiled else 0)


@pytest.mark.parametrize("reshard,prefetch", [(True, "1"), (False, "0")])
def test_fsdp2_peak_memory_per_rank_is_at_most_eager(monkeypatch, reshard, prefetch):
    # One rank of 2 in this process, on torch's fake process group: the collectives move no data, so the peak is
    # the same on every run (on gloo, frees done by its threads escape the profiler and the measured peak varies;
    # docs/distributed.md).  The recipe's GPT of width 64, batch 4 x 32 (with 4 layers it measured 1.06x eager's
    # on gloo; here 2 layers, for CI's time).
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import thunder_train as tt
    from _fsdp_gpt import gpt, shard, step

    monkeypatch.setenv("THUNDER_TRAIN_PREFETCH", prefetch)
    monkeypatch.setenv("THUNDER_TRAIN_FUSION", "off")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        peaks = []
        for compiled in (False, True):
            torch.manual_seed(0)
            model = shard(gpt(vocab=256, block=32, layers=2, d=64), reshard)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
            fn = tt.compile(step, thin=True) if compiled else step
            step(model, opt, x, y)  # an eager step creates AdamW's state: the compiled step traces once, with it
            if compiled:
                fn(model, opt, x, y)
            peaks.append(_step_peak(fn, compiled, model, opt, x, y))
            assert _step_peak(fn, compiled, model, opt, x, y) == peaks[-1]  # deterministic
        eager, comp = peaks
        assert comp <= eager, (comp / 2**20, eager / 2**20)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("rank", [0, 1], ids=["rank0", "padded_rank1"])
def test_fsdp2_tiny_mlp_peak_per_rank_is_at_most_eager(monkeypatch, rank):
    # The 8-33-5 MLP of the gloo scenarios: rank 1 pads its shards.  Its peak is a few KiB, so the kept-buffers
    # arena's allowance above the planned peak is a share of that peak (buffers._slack): a whole KiB had put
    # this step above eager FSDP2's.  Torch's fake process group, one rank in this process: deterministic.
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import thunder_train as tt
    from _fsdp_whole_step import mlp, shard
    from _models import train_step

    monkeypatch.setenv("THUNDER_TRAIN_FUSION", "off")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        peaks = []
        for compiled in (False, True):
            torch.manual_seed(0)
            model = shard(mlp(), lambda m: [m[0], m[2]])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))
            fn = tt.compile(train_step, thin=True) if compiled else train_step
            train_step(model, opt, x, y)
            if compiled:
                fn(model, opt, x, y)
            peaks.append(_step_peak(fn, compiled, model, opt, x, y))
        eager, comp = peaks
        assert comp <= eager, (comp, eager)
    finally:
        dist.destroy_process_group()
