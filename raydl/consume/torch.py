"""numpy batches to torch tensors (`DataIterator.iter_torch_batches`). torch is an optional extra.

What each column becomes:
    numbers, images, masks, fixed-shape arrays   a tensor; on CPU a zero-copy view of the numpy array
                                                  (of the object store), read-only in spirit
    variable-length arrays (tokens; dtype=object  a list of 1-D tensors, each a view of its row's array
    arrays of 1-D arrays)                         (Ray Data raises here; `.pad()` makes one (B, L) tensor)
    text, dicts, bytes, None (dtype=object)       a Python list of the same values
    "key"                                        a list of str, as in iter_batches
    "bucket"                                     the (H, W) tuple, as in iter_batches
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from raydl.util.optional import import_torch

__all__ = ["check_torch_args", "torch_batches"]


def check_torch_args(
    *, collate_fn: Callable[[Any], Any] | None, dtypes: Any, device: str, pin_memory: bool
) -> None:
    """iter_torch_batches' arguments, checked when it is called (not at the first batch)."""
    if collate_fn is not None:
        if dtypes is not None or device != "auto" or pin_memory:
            raise ValueError(
                "collate_fn cannot be used with dtypes, device or pin_memory: what collate_fn returns is "
                "yielded as it is; convert dtypes and move tensors to the device inside collate_fn"
            )
        return
    if dtypes is not None and not isinstance(dtypes, dict):
        torch = import_torch("iter_torch_batches")
        if not isinstance(dtypes, torch.dtype):
            raise TypeError(f"dtypes must be a torch.dtype or a dict column -> torch.dtype, got {dtypes!r}")
    _device(device, pin_memory)


def _device(device: str, pin_memory: bool):
    """The torch.device batches go to ("auto": the CPU); CUDA and pinned memory need a CUDA device."""
    torch = import_torch("iter_torch_batches")
    dev = torch.device("cpu" if device == "auto" else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={device!r} was asked for, but torch sees no CUDA device")
    if pin_memory and not torch.cuda.is_available():
        raise RuntimeError("pin_memory=True needs a CUDA device, and torch sees none")
    return dev


def torch_batches(
    batches: Iterator[dict[str, Any]],
    *,
    device: str = "auto",
    dtypes: Any = None,
    pin_memory: bool = False,
    images: tuple[str, ...] = ("image",),
) -> Iterator[dict[str, Any]]:
    """Each numpy batch with its numeric columns as tensors on `device` (see the module docstring).

    `dtypes`: one torch dtype for the image columns (`images`: the decoded image fields, masks not among
    them), or a dict column -> dtype (a variable-length column's tensors each get it).
    """
    torch = import_torch("iter_torch_batches")
    convert = _Converter(torch, _device(device, pin_memory), _dtype_of(dtypes, images), pin_memory)
    for batch in batches:
        # once a batch: entering it costs a few us, a token list has B tensors
        with warnings.catch_warnings():
            # Object-store arrays are read-only; the tensors share their memory (no copy).
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            out = convert.batch(batch)
        yield out


def _dtype_of(dtypes: Any, images: tuple[str, ...]) -> dict[str, Any]:
    """The torch dtype asked for each column: none, a dict's, or one dtype for every image column."""
    if dtypes is None:
        return {}
    if isinstance(dtypes, dict):
        return dict(dtypes)
    return dict.fromkeys(images, dtypes)


class _Converter:
    """One iterator's columns to tensors on `dev`, each numeric one a view of its array where it can be."""

    def __init__(self, torch: Any, dev: Any, dtype_of: dict[str, Any], pin_memory: bool) -> None:
        self._torch, self._dev, self._dtype_of, self._pin = torch, dev, dtype_of, pin_memory

    def tensor(self, name: str, value: np.ndarray):
        try:
            t = self._torch.from_numpy(value)
        except TypeError as exc:
            raise TypeError(
                f"iter_torch_batches: column {name!r} has dtype {value.dtype}, which torch cannot hold; "
                "convert it in map_batches, or use iter_batches"
            ) from exc
        if self._pin:
            t = t.pin_memory()
        if name in self._dtype_of or self._dev.type != "cpu":
            t = t.to(device=self._dev, dtype=self._dtype_of.get(name), non_blocking=self._pin)
        return t

    def batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in batch.items():
            if not isinstance(value, np.ndarray):
                out[name] = value  # "key" (a list), "bucket" (a tuple)
            elif value.dtype.kind in "biufc":
                out[name] = self.tensor(name, value)
            elif value.dtype == object and _all_numeric_rows(value):
                out[name] = [None if v is None else self.tensor(name, v) for v in value]
            elif name in self._dtype_of:
                raise ValueError(
                    f"dtypes names column {name!r}, which holds {_kinds(value)} values, not numbers"
                )
            elif value.dtype.kind in "OUS":
                out[name] = value.tolist()  # text, dicts, bytes: the same Python values, in a list
            else:
                out[name] = self.tensor(name, value)  # datetimes and the like: torch's refusal, named
        return out


def _all_numeric_rows(value: np.ndarray) -> bool:
    """An object column whose every value is a numeric ndarray (or None), and one at least: a token list."""
    rows = [v for v in value if v is not None]
    return bool(rows) and all(isinstance(v, np.ndarray) and v.dtype.kind in "biuf" for v in rows)


def _kinds(value: np.ndarray) -> str:
    """The types of a column's values, for a message: "NoneType/str"."""
    kinds = (
        sorted({type(v).__name__ for v in value.tolist()}) if value.dtype == object else [str(value.dtype)]
    )
    return "/".join(kinds)
