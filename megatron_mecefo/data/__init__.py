"""Data for the examples: a byte-level tokenizer, preprocessing to Megatron indexed datasets, the
stdlib default corpus, and GPTDatasets addressable by sample index."""

TOKENIZERS = ("ByteTokenizer", "NullTokenizer")
"""What `--tokenizer-type` accepts (here, so that argument parsing imports no framework)."""
