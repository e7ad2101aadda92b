import json

import numpy
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_mecefo.data.preprocess import iter_documents, main, write_indexed_dataset
from megatron_mecefo.data.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit


def test_txt_round_trip(tmp_path):
    src = tmp_path / "book.txt"
    src.write_text("first document\nstill first\n\nsecond — with ünïcode\n\n\nthird\n", encoding="utf-8")
    assert main(["--input", str(src), "--output-prefix", str(tmp_path / "out" / "book")]) == 0
    ds = IndexedDataset(str(tmp_path / "out" / "book"))
    tok = ByteTokenizer()
    docs = [ds[i] for i in range(len(ds))]
    assert [tok.detokenize(d) for d in docs] == ["first document\nstill first", "second — with ünïcode", "third"]
    assert all(int(d[-1]) == tok.eod for d in docs)
    assert len(ds.document_indices) == 4


def test_jsonl_round_trip_and_errors(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["a b", "", "ccc"])) + "\n")
    n = write_indexed_dataset(iter_documents(str(src)), str(tmp_path / "c"))
    assert n == 2
    ds = IndexedDataset(str(tmp_path / "c"))
    assert numpy.array_equal(ds[1], numpy.array([99, 99, 99, 256]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match='no "text" field'):
        list(iter_documents(str(bad)))
    with pytest.raises(ValueError, match=".txt or .jsonl"):
        list(iter_documents(str(tmp_path / "x.csv")))
    with pytest.raises(SystemExit):
        main(["--input", str(tmp_path / "missing.txt"), "--output-prefix", str(tmp_path / "m")])


def test_tokenizers_named_by_tokenizer_type():
    from megatron_mecefo.data.tokenizer import build_tokenizer

    byte = build_tokenizer("ByteTokenizer")
    assert (byte.vocab_size, byte.eod) == (258, 256)
    null = build_tokenizer("NullTokenizer", 50257)
    assert (null.vocab_size, null.eod) == (50258, 50257)  # Megatron-LM's convention: eod = V
    assert null.tokenize("5 7 11") == [5, 7, 11] and null.detokenize([5, 7]) == "5 7"
    with pytest.raises(ValueError, match="needs --vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="--tokenizer-type must be one of"):
        build_tokenizer("GPT2BPETokenizer")
