"""Peak memory of one call on the CPU, as the memory tests and the benchmarks measure it (one copy, imported by
tests/test_memory.py, tests/test_kept_buffers.py and benchmarks/train_step.py, which hands it to the other
benchmarks), and the same count on gloo ranks, whose worker threads free memory too (tests/_fsdp_whole_step.py,
benchmarks/fsdp2.py)."""
from __future__ import annotations

import re


def peak_call_bytes(fn, compiled=None) -> int:
    """Peak bytes allocated during ``fn()`` above what was live before (torch.profiler's allocator events), plus
    the buffers the thunder_train function ``compiled`` keeps between calls for its intermediates
    (executors/buffers.py): they are allocated before the call, and held for it.  Deterministic on the CPU."""
    peak, _ = peak_and_net_call_bytes(fn)
    if compiled is None:
        return peak
    import thunder_train as tt
    from thunder_train.compiler.executors.buffers import kept_bytes

    return peak + kept_bytes(tt.last_traces(compiled)[-1])


# Profiler bookkeeping ops that its own table leaves out: what they allocate counts for the op around them.
_HIDDEN_OPS = {"profiler::_record_function_enter", "profiler::_record_function_enter_new",
               "profiler::_record_function_exit", "aten::is_leaf", "aten::output_nr", "aten::_version"}


def peak_and_net_call_bytes(fn) -> tuple[int, int]:
    """The peak of ``fn()``'s CPU allocations above what was live before, and their net sum, at the granularity of
    torch.profiler's table (``prof.events()``: each op's own allocations and frees, its children's excluded, counted
    at its start).  Read from the profiler's event tree, where each allocation's parent is that op: the same
    numbers as summing the table's ``self_cpu_memory_usage`` (checked on every call of tests/test_memory.py,
    test_kept_buffers.py and the FSDP2 peak tests), without building the table, which took 10-40x the time."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    changes, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            op = e.parent
            while op is not None and op.name in _HIDDEN_OPS:
                op = op.parent
            changes.append((e.start_time_ns if op is None else op.start_time_ns, e.extra_fields.alloc_size))
    cur = peak = 0
    for _, n in sorted(changes, key=lambda c: c[0]):
        cur += n
        peak = max(peak, cur)
    return peak, cur


def peak_call_bytes_all_threads(fn, compiled=None, kept_ok: bool = False) -> int:
    """The peak of ``fn()``'s CPU allocations in the order the allocator saw them, plus ``compiled``'s kept buffers.

    ``peak_call_bytes`` counts each allocation and free at the start of the op it happens in.  Where memory is freed
    inside an op that runs Python or other ops, that moves the free before allocations that happened earlier: eager's
    custom autograd functions (BLOOM's ``GeLUFunction``, whose forward and backward are Python arithmetic) free their
    temporaries inside the function's op, and autograd releases each node's saved tensors inside its
    ``evaluate_function``, so eager's peak read so is lower than the memory eager held (BLOOM's step: 136 KiB read
    so, 196 KiB allocated at once).  It also hides a kernel's own temporaries (allocated and freed inside one op).
    This count sees both, on every thread: a gloo rank's collectives allocate and release buffers on gloo's worker
    threads.  c10's CPU allocator keeps a process-wide count of the bytes it allocated while
    ``caffe2_report_cpu_memory_usage`` is on, whichever thread allocates or frees, and logs the count after each
    change at c10's INFO level; the call runs with that level on and the process's stderr going to a file, and the
    peak is the largest count logged less the count before it (blocks allocated before the flag was set are not
    counted), plus ``compiled``'s kept buffers; the count after the call must be the one before (checked: nothing
    leaked).  No profiler runs: with torch.profiler on, gloo runs each collective on its worker thread under the
    calling thread's profiler state, and a gloo rank measured so once died of heap corruption in CI
    (docs/distributed.md, "Peak memory per rank")."""
    import gc
    import time

    # Garbage left by earlier code (cycles of an earlier test's compiled functions) is collected now, not during the
    # call, where its frees would count against the call (a run of tests/test_memory.py once read -340 KB so).
    gc.collect()
    counts = _logged_counts(fn)
    before = counts[1]  # after the probe's allocation and free
    after = _logged_counts(lambda: None)[1]
    for _ in range(100):  # a worker thread may still be releasing the last collectives' buffers
        if after == before:
            break
        time.sleep(0.01)
        after = _logged_counts(lambda: None)[1]
    # (``kept_ok``: the benchmarks, whose torch.compile modes may keep a few bytes from a call in their caches)
    assert kept_ok or after == before, f"{after - before} bytes allocated during the call were not freed"
    peak = max(counts) - before
    if compiled is None:
        return peak
    import thunder_train as tt
    from thunder_train.compiler.executors.buffers import kept_bytes

    return peak + kept_bytes(tt.last_traces(compiled)[-1])


_COUNT_LINE = re.compile(rb"C10 (?:alloc|deleted) \d+ bytes, total alloc (\d+) bytes\.")


def _logged_counts(fn) -> list[int]:
    """c10's count of allocated bytes after each allocation or free during ``torch.empty(1); fn()`` (the probe's
    two first), in the order they were logged; the other lines written to stderr meanwhile are written there after."""
    import ctypes
    import os
    import sys
    import tempfile

    import torch

    c10 = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    report = ctypes.c_bool.in_dll(c10, "FLAGS_caffe2_report_cpu_memory_usage")
    level = ctypes.c_int.in_dll(c10, "FLAGS_caffe2_log_level")
    report.value = True
    sys.stderr.flush()
    with tempfile.TemporaryFile() as log:
        stderr = os.dup(2)
        old_level = level.value
        os.dup2(log.fileno(), 2)
        try:
            level.value = 0  # INFO: the allocator's count lines
            torch.empty(1)  # a probe: the count before the call is logged at its free
            fn()
        finally:
            level.value = old_level
            sys.stderr.flush()
            os.dup2(stderr, 2)
            os.close(stderr)
        log.seek(0)
        text = log.read()
    counts, others = [], []
    for line in text.splitlines(keepends=True):
        m = _COUNT_LINE.search(line)
        if m:
            counts.append(int(m.group(1)))
        else:
            others.append(line)
    if others:
        sys.stderr.buffer.write(b"".join(others))
        sys.stderr.flush()
    return counts
