"""Caller-owned memory as (pointer, size): bytes-likes, numpy arrays, torch tensors, mmaps.

The span keeps its owner alive and, for buffer-protocol objects, holds the
buffer export until `release()` (an mmap cannot be closed while exported).
"""

from __future__ import annotations

from typing import Any

from raydl.native.pyfi._lib import loaded


class Span:
    """A contiguous range of host memory lent by `owner`."""

    def __init__(self, ptr: Any, nbytes: int, owner: Any, export: Any = None) -> None:
        self.ptr = ptr  # cffi `char *`
        self.nbytes = nbytes
        self.owner = owner  # keeps the memory alive while registered
        self._export = export  # cffi from_buffer object, released explicitly

    @property
    def address(self) -> int:
        ffi, _ = loaded()
        return int(ffi.cast("uintptr_t", self.ptr))

    def release(self) -> None:
        """Drop the buffer export (idempotent); the span must not be used afterwards."""
        if self._export is not None:
            ffi, _ = loaded()
            ffi.release(self._export)
            self._export = None
        self.owner = None


def as_span(obj: Any, *, writable: bool) -> Span:
    """Borrow obj's memory. Torch tensors must be CPU and contiguous; anything
    else must export a C-contiguous buffer (writable when `writable`)."""
    ffi, _ = loaded()
    if _is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise TypeError(
                f"pyfi moves host memory only; got a tensor on {obj.device} "
                "(device memory needs FI_HMEM, not supported yet)"
            )
        if not obj.is_contiguous():
            raise ValueError("tensor is not contiguous; pass tensor.contiguous()")
        nbytes = obj.numel() * obj.element_size()
        return Span(ffi.cast("char *", obj.data_ptr()), nbytes, obj)
    try:
        view = memoryview(obj)
    except TypeError as exc:
        raise TypeError(
            f"{type(obj).__name__} does not expose a buffer (bytearray, numpy array, torch tensor, mmap ...)"
        ) from exc
    if not view.c_contiguous:
        raise ValueError(f"{type(obj).__name__} is not C-contiguous")
    if writable and view.readonly:
        raise TypeError(f"{type(obj).__name__} is read-only; a writable buffer is needed")
    nbytes = view.nbytes
    view.release()
    export = ffi.from_buffer("char[]", obj, require_writable=writable)
    return Span(export, nbytes, obj, export)


def _is_torch_tensor(obj: Any) -> bool:
    return (
        type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr") and hasattr(obj, "element_size")
    )
