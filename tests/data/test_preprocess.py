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
