"""What the framework test jobs share: their options and the tiny GPT-2 they train, built from its config."""

from __future__ import annotations

import argparse

from transformers import GPT2Config, GPT2LMHeadModel


def job_options() -> argparse.Namespace:
    """--out DIR --log LOG [--steps N] [--save-steps N] [--step-sleep S] [--cuda] [--fsdp]."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--save-sleep", type=float, default=0.0, help="rank 0 takes this much longer for each save")
    parser.add_argument("--cuda", action="store_true", help="train on the rank's GPU (NCCL), not the CPU (gloo)")
    parser.add_argument("--fsdp", action="store_true", help="HF only: FSDP2 through accelerate (needs --cuda)")
    return parser.parse_args()


def tiny_gpt2() -> GPT2LMHeadModel:
    """Two layers of 32, a vocabulary of 128, no dropout (a resumed run's loss can match an uninterrupted one)."""
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    return GPT2LMHeadModel(config)
