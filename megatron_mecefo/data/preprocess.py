"""Turn a text or JSONL file into a Megatron indexed dataset (PREFIX.bin / PREFIX.idx).

    python -m megatron_mecefo.data.preprocess --input corpus.jsonl --output-prefix data/corpus
    python -m megatron_mecefo.data.preprocess --input book.txt --output-prefix data/book

JSONL: one JSON object per line with a "text" field (--json-key to change it). TXT: documents are
separated by blank lines. Every document is tokenized (byte-level) and ends with the end-of-document
token. The result loads with megatron.core's IndexedDataset / GPTDataset (`--data-path PREFIX`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Iterable, Iterator

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from megatron_mecefo.data.tokenizer import ByteTokenizer

__all__ = ["iter_documents", "write_indexed_dataset", "main"]


def iter_documents(path: str, json_key: str = "text") -> Iterator[str]:
    """Documents of a .jsonl (field `json_key`) or .txt (split on blank lines) file."""
    if path.endswith((".jsonl", ".json")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
                if json_key not in record:
                    raise ValueError(f'{path}:{n}: no "{json_key}" field (use --json-key)')
                yield record[json_key]
    elif path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for block in text.replace("\r\n", "\n").split("\n\n"):
            if block.strip():
                yield block.strip("\n")
    else:
        raise ValueError(f"--input must be a .txt or .jsonl file, got {path}")


def write_indexed_dataset(documents: Iterable[str], output_prefix: str) -> int:
    """Tokenize `documents` into OUTPUT_PREFIX.bin/.idx. Returns the number of documents."""
    tok = ByteTokenizer()
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=numpy.uint16)
    count = 0
    for doc in documents:
        ids = tok.tokenize(doc)
        if ids.size == 0:
            continue
        builder.add_item(torch.from_numpy(numpy.append(ids, tok.eod)))
        builder.end_document()
        count += 1
    builder.finalize(output_prefix + ".idx")
    if count == 0:
        raise ValueError("no non-empty documents found")
    return count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help=".txt (blank-line separated) or .jsonl")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-key", default="text")
    args = p.parse_args(argv)
    if not os.path.exists(args.input):
        p.error(f"--input {args.input} does not exist")
    try:
        n = write_indexed_dataset(iter_documents(args.input, args.json_key), args.output_prefix)
    except ValueError as e:
        p.error(str(e))
    print(f"wrote {n} documents to {args.output_prefix}.bin / .idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
