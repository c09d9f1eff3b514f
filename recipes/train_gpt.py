"""Train a small character-level GPT on generated additions ("37+48=85").

    python recipes/train_gpt.py                        # thunder_train, CPU (CUDA when present)
    python recipes/train_gpt.py --compile eager        # the same in eager PyTorch, for comparison
    python recipes/train_gpt.py --compile torch        # the same with torch.compile
    python recipes/train_gpt.py --steps 20 --print-trace

With ``--compile thunder`` the whole training step — forward, cross-entropy,
``loss.backward()``, the AdamW update and ``zero_grad`` — is one program
compiled by ``thunder_train.compile``; ``--compile thunder-thin`` validates it
once and afterwards only checks the batch.  ``--print-trace`` prints that
program: the forward, its backward and the optimizer update, functionalized,
with one write-back per updated parameter and optimizer-state tensor.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, ALPHABET, add_common_args, batches, make_corpus, pick_device  # noqa: E402

import thunder_train as tt  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, default_compile="thunder", extra_compile=("torch",))  # torch: torch.compile, for comparison
    return p.parse_args(argv)


def train_step(model, opt, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def build_step(mode):
    if mode == "eager":
        return train_step
    if mode == "torch":
        return torch.compile(train_step)
    return tt.compile(train_step, thin=(mode == "thunder-thin"))


def main(argv=None):
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    cfg = GPTConfig(vocab_size=len(ALPHABET), block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    step_fn = build_step(args.compile)
    data = batches(make_corpus(seed=args.seed), args.batch_size, args.block_size, device, seed=args.seed)

    step_times, loss = [], float("nan")
    bar = tqdm(range(args.steps), desc=f"train_gpt [{args.compile}, {device.type}]", disable=args.no_progress, mininterval=0.5)
    t_start = time.perf_counter()
    for step in bar:
        x, y = next(data)
        t0 = time.perf_counter()
        loss_t = step_fn(model, opt, x, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t0)
        if step % 10 == 0 or step == args.steps - 1:
            loss = loss_t.item()
            tokens_per_s = args.batch_size * args.block_size / max(step_times[-1], 1e-9)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
    total = time.perf_counter() - t_start
    steady = sorted(step_times[1:])[len(step_times[1:]) // 2] if len(step_times) > 1 else step_times[0]
    first = step_times[0]
    print(f"summary: mode={args.compile} device={device.type} steps={args.steps} final_loss={loss:.4f} "
          f"first_step_s={first:.3f} median_step_ms={steady * 1e3:.2f} total_s={total:.1f}")
    if args.print_trace and args.compile not in ("eager", "torch"):
        print(tt.last_traces(step_fn)[-1])
    return loss


if __name__ == "__main__":
    main()
