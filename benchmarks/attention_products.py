"""Narrow-value attention: the flash pair on the padded value against the same lines compiled whole as products.

Run: PYTHONPATH=. python benchmarks/attention_products.py

A fused program runs attention whose value heads are narrower than its query and key heads (DeepSeek-V3's) as the
CPU flash pair on v padded to the key's width (executors/narrow_value_attention.py), or, where the attention is small
(``attention_products.SMALL_SCORES``), the pair's two lines compiled whole by Inductor as products
(executors/attention_products.py).  For each size (batch, heads, positions, q/k width 16, v width 8; causal; q, k, v
laid out (batch, positions, heads, width) as models make them) this times, on one thread, the pair's forward and
backward torch functions and the two compiled kernels (best of several runs of many calls, microseconds a call), and
prints products / flash.  A measuring aid: timings vary by machine.
"""
from __future__ import annotations

import time

import torch

from thunder_train.compiler.executors import attention_products, inductor_fusion
from thunder_train.compiler.executors.narrow_value_attention import sdpa_flash_cpu_narrow_value, \
    sdpa_flash_cpu_narrow_value_backward

SIZES = [(2, 4, 12), (2, 4, 32), (2, 8, 32), (4, 8, 32), (2, 8, 64), (4, 8, 64), (8, 8, 64), (2, 8, 128)]
QK, V = 16, 8


def _best_us(call) -> float:
    for _ in range(10):
        call()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < 0.2:
        call()
        n += 1
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def _compiled(form, args, results):
    """``form`` compiled by Inductor as whole_lines compiles a line: writing its results into given buffers."""
    buffers = [torch.empty_strided(r.shape, r.stride(), dtype=r.dtype) for r in results]
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    constants = {i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}

    def into(*ts):
        it = iter(ts[:len(tensors)])
        values = form(*(constants[i] if i in constants else next(it) for i in range(len(args))))
        for b, v in zip(ts[len(tensors):], values):
            b.copy_(v)
        return ()

    call = inductor_fusion._inductor_compile(into, tensors + buffers, asserts=False)
    return lambda: call(tensors + buffers)


def measure(batch, heads, n):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, n, heads, QK, generator=gen).transpose(1, 2) for _ in range(2))
    v = torch.randn(batch, n, heads, V, generator=gen).transpose(1, 2)
    strides = q.new_empty(batch, n, heads, V).transpose(1, 2).stride()
    with torch.no_grad():
        fwd_args = (q, k, v, strides, True, None)
        out, padded, lse = sdpa_flash_cpu_narrow_value(*fwd_args)
        g = torch.randn_like(out)
        bwd_args = (g, q, k, v, padded, lse, True, None, (0, 1, 2), (q.stride(), k.stride(), strides))
        grads = sdpa_flash_cpu_narrow_value_backward(*bwd_args)
        flash = _best_us(lambda: sdpa_flash_cpu_narrow_value(*fwd_args)) + \
            _best_us(lambda: sdpa_flash_cpu_narrow_value_backward(*bwd_args))
        fwd = _compiled(attention_products.narrow_value_by_products, fwd_args, (out, padded, lse))
        bwd = _compiled(attention_products.narrow_value_backward_by_products, bwd_args, grads)
        products = _best_us(fwd) + _best_us(bwd)
    return flash, products


def main():
    torch.set_num_threads(1)
    print(f"{'batch':>5} {'heads':>5} {'n':>4} {'scores':>8} {'flash us':>9} {'products us':>11} {'products/flash':>14}")
    for batch, heads, n in SIZES:
        flash, products = measure(batch, heads, n)
        print(f"{batch:>5} {heads:>5} {n:>4} {batch * heads * n * n:>8} {flash:>9.1f} {products:>11.1f} {products / flash:>14.2f}",
              flush=True)
    print(f"SMALL_SCORES = {attention_products.SMALL_SCORES}")


if __name__ == "__main__":
    main()
