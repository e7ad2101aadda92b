"""Helpers shared by the tests: tiny sizes, batches, losses, gradient snapshots."""

from __future__ import annotations

import torch

TINY = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96)
VOCAB, SEQ = 128, 16


def make_batch(seed: int, batch: int = 2, seq: int = SEQ, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    position_ids = torch.arange(seq).expand(batch, seq)
    return tokens, position_ids, labels


def gpt_loss(model, batch) -> torch.Tensor:
    tokens, position_ids, labels = batch
    return model(tokens, position_ids, None, labels=labels).float().mean()


def grads(model):
    return {n: (None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}
