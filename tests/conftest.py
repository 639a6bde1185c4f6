"""Fixtures shared by every test tier."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# raydl's node cache (WebDataset shard indexes): one folder for this test run, set before any Ray process starts
# so that Ray's workers inherit it, never the user's ~/.cache/raydl. Tests that count requests set their own.
os.environ.setdefault("RAYDL_CACHE_DIR", tempfile.mkdtemp(prefix="raydl-test-cache-"))

# ../shared beside the checkout holds real images (see its data/README.md).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared real-image folder; skips the test when it is absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real test images not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """A small generated ImageFolder: 4 classes, 61 JPEG/PNG images of varied sizes, no broken files."""
    from raydl.demo import make_images

    root = tmp_path_factory.mktemp("images")
    make_images(str(root), 61, classes=4, seed=1, corrupt=0)
    return root
