"""Train the small character-level GPT of train_gpt.py with the Lightning Trainer and ThunderCallback.

    python recipes/lightning_gpt.py                           # ThunderCallback(thin=True), CPU (CUDA when present)
    python recipes/lightning_gpt.py --compile eager           # the plain Trainer, for comparison
    python recipes/lightning_gpt.py --compile thunder --steps 20 --print-trace
    python recipes/lightning_gpt.py --fuse-optimizer          # forward, backward and AdamW as one program

Same model, data, initialisation and AdamW settings as ``recipes/train_gpt.py``, so
the two recipes print the same losses for the same ``--steps``.  The LightningModule
is ordinary Lightning code; ``ThunderCallback`` compiles its ``training_step`` (the
forward and the loss, with thunder_train's own backward), while Lightning runs the
backward call, the optimizer and the loop.  With ``--fuse-optimizer``
(``ThunderCallback(fuse_optimizer=True)``) the backward, gradient clipping
(``--clip``) and the AdamW update are part of the compiled program as well; Lightning
still runs the loop, the hooks and ``zero_grad``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings

import torch
import torch.nn.functional as F
import lightning as L
from torch.utils.data import DataLoader, IterableDataset
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import GPT, GPTConfig, ALPHABET, add_common_args, batches, make_corpus, pick_device  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train import ThunderCallback  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(p, default_compile="thunder-thin")
    p.add_argument("--precision", choices=["32-true", "bf16-mixed"], default="32-true")
    p.add_argument("--fuse-optimizer", action="store_true",
                   help="ThunderCallback(fuse_optimizer=True): backward, clipping and AdamW inside the compiled step")
    p.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    return p.parse_args(argv)


class GPTModule(L.LightningModule):
    def __init__(self, cfg: GPTConfig, lr: float):
        super().__init__()
        self.model = GPT(cfg)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class Additions(IterableDataset):
    """The endless random windows of ``gpt.batches``, already batched (use ``DataLoader(batch_size=None)``)."""

    def __init__(self, batch_size: int, block_size: int, seed: int):
        self.batch_size, self.block_size, self.seed = batch_size, block_size, seed

    def __iter__(self):
        return batches(make_corpus(seed=self.seed), self.batch_size, self.block_size, "cpu", seed=self.seed)


class SpeedBar(L.Callback):
    """A tqdm bar with the loss and tokens/s; times every step from batch start to batch end."""

    def __init__(self, desc: str, total: int, tokens_per_step: int, disable: bool):
        self.bar = tqdm(total=total, desc=desc, disable=disable, mininterval=0.5)
        self.tokens_per_step = tokens_per_step
        self.step_times: list = []
        self.loss = float("nan")
        self.t_start = self._t0 = 0.0

    def on_train_start(self, trainer, pl_module):
        self.t_start = time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - self._t0
        self.step_times.append(dt)
        self.bar.update(1)
        step = len(self.step_times) - 1
        if step % 10 == 0 or step == self.bar.total - 1:
            self.loss = outputs["loss"].item()
            self.bar.set_postfix(loss=f"{self.loss:.3f}", tok_s=f"{self.tokens_per_step / max(dt, 1e-9):,.0f}")

    def on_train_end(self, trainer, pl_module):
        self.bar.close()


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    accelerator = pick_device(args.device).type
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab_size=len(ALPHABET), block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    module = GPTModule(cfg, args.lr)
    bar = SpeedBar(f"lightning_gpt [{args.compile}, {accelerator}]", args.steps, args.batch_size * args.block_size, args.no_progress)
    callbacks = [bar]
    thunder = None
    if args.compile != "eager":
        thunder = ThunderCallback(thin=args.compile == "thunder-thin", fuse_optimizer=args.fuse_optimizer)
        callbacks.insert(0, thunder)
    trainer = L.Trainer(
        max_steps=args.steps, accelerator=accelerator, devices=1, precision=args.precision, callbacks=callbacks,
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
        limit_val_batches=0, gradient_clip_val=args.clip,
    )
    data = DataLoader(Additions(args.batch_size, args.block_size, args.seed), batch_size=None)
    trainer.fit(module, data)
    total = time.perf_counter() - bar.t_start
    times = bar.step_times
    steady = sorted(times[1:])[len(times[1:]) // 2] if len(times) > 1 else times[0]
    fused = " fuse_optimizer=True" if args.fuse_optimizer and thunder is not None else ""
    print(f"summary: mode={args.compile}{fused} device={accelerator} precision={args.precision} steps={len(times)} "
          f"final_loss={bar.loss:.4f} first_step_s={times[0]:.3f} median_step_ms={steady * 1e3:.2f} total_s={total:.1f}")
    if thunder is not None:
        print(f"thunder: {thunder.summary()}")
        if args.print_trace:
            print(tt.last_traces(thunder.compiled("training_step"))[-1])
    return bar.loss


if __name__ == "__main__":
    main()
