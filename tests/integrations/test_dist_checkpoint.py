"""Upstream's grad-buffer layout as the reader of "dp_reshardable" checkpoints reproduces it
(bucket_layout.bucket_offsets; the integration tests read real checkpoints with one bucket)."""

import torch

from megatron_mecefo.integrations.megatron_lm.bucket_layout import bucket_offsets


def test_reverse_order_64_aligned_starts_and_buckets():
    a, b, c = torch.zeros(10), torch.zeros(100), torch.zeros(30)
    where, sizes = bucket_offsets([a, b, c], bucket_size=None)  # laid out c, b, a
    assert (where[id(c)], where[id(b)], where[id(a)]) == ((0, 0), (0, 64), (0, 192)) and sizes == [202]
    where, sizes = bucket_offsets([a, b, c], bucket_size=100)  # c, b fill a bucket; a starts the next at 0
    assert (where[id(c)], where[id(b)], where[id(a)]) == ((0, 0), (0, 64), (1, 0)) and sizes == [164, 10]


def test_a_shared_embedding_gets_its_own_bucket():
    head, emb, tail = torch.zeros(10), torch.zeros(70), torch.zeros(5)
    emb.shared_embedding = True
    where, sizes = bucket_offsets([head, emb, tail], bucket_size=None)  # tail | emb | head
    assert (where[id(tail)], where[id(emb)], where[id(head)]) == ((0, 0), (1, 0), (2, 0))
    assert sizes == [64, 70, 10]  # the first bucket's size runs to the embedding's aligned start
