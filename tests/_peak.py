"""Peak memory of one call on the CPU, as the memory tests and the benchmarks measure it (one copy, imported by
tests/test_memory.py, tests/test_kept_buffers.py and benchmarks/train_step.py, which hands it to the other
benchmarks)."""
from __future__ import annotations


def peak_call_bytes(fn, compiled=None) -> int:
    """Peak bytes allocated during ``fn()`` above what was live before (torch.profiler's allocator events), plus
    the buffers the thunder_train function ``compiled`` keeps between calls for its intermediates
    (executors/buffers.py): they are allocated before the call, and held for it.  Deterministic on the CPU."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage if e.name != "[memory]" else e.cpu_memory_usage
        peak = max(peak, cur)
    if compiled is None:
        return peak
    import thunder_train as tt
    from thunder_train.compiler.executors.buffers import kept_bytes

    return peak + kept_bytes(tt.last_traces(compiled)[-1])
