"""Install hints name raydl's own distribution, raydl-loader: `raydl` on PyPI is an unrelated package."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(60)


def test_the_distribution_is_raydl_loader():
    """pyproject.toml names the distribution raydl-loader; the package it installs is still `raydl`."""
    text = (ROOT / "pyproject.toml").read_text()  # tomllib is Python 3.11's; raydl runs on 3.10
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]
    assert re.search(r'^name = "([^"]+)"$', project, re.M).group(1) == "raydl-loader"
    assert 'include = ["raydl*"]' in text


def test_the_missing_torch_error_names_raydl_loader(monkeypatch):
    """Without torch, the error says `pip install 'raydl-loader[torch]'` and how to install from a checkout."""
    from raydl.util.optional import import_torch

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ImportError) as err:
        import_torch("iter_torch_batches")
    assert "pip install 'raydl-loader[torch]'" in str(err.value)
    assert "pip install -e '.[torch]'" in str(err.value)


def test_no_hint_installs_the_unrelated_raydl():
    """No install hint in the code, docs, examples or scripts names the distribution `raydl` (with extras or
    alone); `-e .` installs from the checkout."""
    wrong = re.compile(r"pip install [^\n`#]*?(?<![\w./-])'?raydl(\[[a-z,]+\])?'?(?![\w-])")
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "raydl").rglob("*.py"),
             *(ROOT / "examples").glob("*"), *(ROOT / "scripts").glob("*")]
    found = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files if p.is_file()
             for m in wrong.finditer(p.read_text(errors="replace"))]
    assert found == []
