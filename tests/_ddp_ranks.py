"""Both DDP scenarios of tests/test_ddp.py in one interpreter and one pair of forked gloo ranks (tests/_dist.py):
``tt.compile(model)`` inside DDP (tests/_ddp_compiled.py), then DDP inside a compiled whole step
(tests/_ddp_whole_step.py).  One interpreter start, one import of torch and thunder_train, one rendezvous.

Run by tests/test_ddp.py as ``main(OUT_DIR)`` (tests/_dist.py: run_ranks; or ``python tests/_ddp_ranks.py OUT_DIR``):
each scenario writes ``OUT_DIR/<name>/rank{r}.pt``.
"""
from __future__ import annotations

import os
import sys

import _ddp_compiled
import _ddp_whole_step
from _dist import spawn

SCENARIOS = {"compiled": _ddp_compiled.run, "whole_step": _ddp_whole_step.run}


def run(rank, world, out_dir):
    for name, scenario in SCENARIOS.items():
        scenario(rank, world, os.path.join(out_dir, name))


def main(out_dir):
    for name in SCENARIOS:
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
    spawn(run, out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
