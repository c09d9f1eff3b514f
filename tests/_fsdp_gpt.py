"""The recipe's GPT (recipes/gpt.py) sharded as torchtitan does (fully_shard each block, then the root) and its
training step: one definition for tests/test_fsdp.py's peak-memory test and benchmarks/fsdp2.py."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from gpt import GPT, GPTConfig  # noqa: E402
from _models import train_step as step  # noqa: E402,F401  (the step the tests compile)


def gpt(*, vocab: int, block: int, layers: int, d: int) -> GPT:
    return GPT(GPTConfig(vocab_size=vocab, block_size=block, n_layer=layers, n_head=4, n_embd=d))


def shard(model: GPT, reshard_after_forward: bool = True) -> GPT:
    from torch.distributed.fsdp import fully_shard

    for b in model.blocks:
        fully_shard(b, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    return model
