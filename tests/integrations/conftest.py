"""Patched Megatron-DeepSpeed (with a tiny dataset) and Megatron-LM checkouts, shared by this folder's tests."""

from __future__ import annotations

import pytest

from megatron_mecefo.testing import mds, mlm


@pytest.fixture(scope="session")
def mds_checkout(tmp_path_factory):
    """(checkout root, dataset prefix): a fresh extract of the snapshot, patched by mecefo-patch, with
    upstream's unpatched script beside it as pretrain_gpt_upstream.py."""
    from megatron_mecefo import patch

    root = mds.extract(mds.SNAPSHOT_GLOB, tmp_path_factory.mktemp("mds") / "Megatron-DeepSpeed")
    patch.apply(str(root))
    (root / "pretrain_gpt_upstream.py").write_text(mds.original_script())  # the unpatched script, beside it
    data = root.parent / "data" / "corpus_text_document"
    data.parent.mkdir()
    mds.write_dataset(root, data)
    mds.prepare(root)
    return root, data


@pytest.fixture(scope="session")
def mlm_checkout(tmp_path_factory):
    """A fresh extract of the Megatron-LM snapshot, patched by mecefo-patch, with upstream's
    unpatched script beside it as pretrain_gpt_upstream.py."""
    from megatron_mecefo import patch

    root = mlm.extract(mlm.SNAPSHOT_GLOB, tmp_path_factory.mktemp("mlm") / "Megatron-LM")
    patch.apply(str(root))
    (root / "pretrain_gpt_upstream.py").write_text(mlm.original_script())
    mlm.prepare(root)
    return root
