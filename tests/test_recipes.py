"""Recipes run end to end with a tiny step count and learn (loss falls) like eager."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_recipe(*args):
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "recipes", "train_gpt.py"), "--device", "cpu", "--no-progress", *args],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT},
    )
    assert out.returncode == 0, out.stderr
    m = re.search(r"final_loss=([0-9.]+)", out.stdout)
    assert m, out.stdout
    return float(m.group(1)), out.stdout


def test_train_gpt_thunder_matches_eager():
    loss_tt, stdout = run_recipe("--compile", "thunder", "--steps", "40", "--print-trace")
    loss_eager, _ = run_recipe("--compile", "eager", "--steps", "40")
    assert loss_tt == pytest.approx(loss_eager, rel=1e-3)
    assert loss_tt < 2.4  # ln(13) ≈ 2.56 is chance level for the 13-character alphabet
    assert "def computation(" in stdout and ("scaled_dot_product_attention" in stdout or "sdpa_flash_cpu" in stdout)


def test_train_gpt_thin_mode_matches_eager():
    loss_thin, stdout = run_recipe("--compile", "thunder-thin", "--steps", "20")
    loss_eager, _ = run_recipe("--compile", "eager", "--steps", "20")
    assert loss_thin == pytest.approx(loss_eager, rel=1e-3)
    assert "mode=thunder-thin" in stdout


def test_lightning_gpt_callback_matches_plain_trainer():
    def run(*args):
        out = subprocess.run(
            [sys.executable, os.path.join(ROOT, "recipes", "lightning_gpt.py"), "--device", "cpu", "--no-progress", "--steps", "20", *args],
            capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT},
        )
        assert out.returncode == 0, out.stderr[-4000:]
        m = re.search(r"summary: mode=(\S+) .*steps=20 final_loss=([0-9.]+) .*median_step_ms=([0-9.]+)", out.stdout)
        assert m, out.stdout
        return float(m.group(2)), out.stdout

    loss_thin, stdout = run("--compile", "thunder-thin", "--print-trace")
    loss_eager, _ = run("--compile", "eager")
    assert loss_thin == pytest.approx(loss_eager, rel=1e-3)
    assert "mode=thunder-thin" in stdout and "thin calls" in stdout
    assert "def computation(" in stdout and ("scaled_dot_product_attention" in stdout or "sdpa_flash_cpu" in stdout)
