"""Executing symbols outside tracing, so printed traces run as plain Python."""
from __future__ import annotations


def run_eagerly(sym, args, kwargs):
    from .torch_executor import torch_executor

    return torch_executor.eager_impl(sym, args, kwargs)
