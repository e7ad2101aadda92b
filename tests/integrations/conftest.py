"""A patched Megatron-DeepSpeed checkout with a tiny dataset, shared by this folder's tests."""

from __future__ import annotations

import pytest

from tests.integrations import mds


@pytest.fixture(scope="session")
def mds_checkout(tmp_path_factory):
    """(checkout root, dataset prefix): a fresh extract of the snapshot, patched by mecefo-patch."""
    from megatron_mecefo import patch

    root = mds.extract(mds.SNAPSHOT_GLOB, tmp_path_factory.mktemp("mds") / "Megatron-DeepSpeed")
    patch.apply(str(root))
    data = root.parent / "data" / "corpus_text_document"
    data.parent.mkdir()
    mds.write_dataset(root, data)
    return root, data
