"""What a sample holds: named fields, each of a kind that says how it is batched and whether the image stages
decode it. Sources declare their fields (`Source.fields`); the worker batches by them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FIELD_KINDS", "IMAGE_AND_LABEL", "Field"]

#: How a field's values are batched (raydl/execute/collate.py) and whether the image stages decode it:
#: image - encoded image bytes, decoded by .decode() (bytes without it);
#: array - an ndarray whose shape every sample of a batch must share (a WebDataset .npy member);
#: list - a 1-D ndarray whose length may vary (a Parquet list column): stacked where the lengths agree;
#: value - anything else: an int, float or bool (stacked), str, dict, bytes or None (an object array).
FIELD_KINDS = ("image", "array", "list", "value")


@dataclass(frozen=True)
class Field:
    """One named field of a source's samples: `batch[name]`, batched as its `kind` says (FIELD_KINDS)."""

    name: str
    kind: str = "value"
    #: the numpy dtype of a "value" field's column where it is known (an empty batch has it too)
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FIELD_KINDS:
            raise ValueError(f"field {self.name!r}: kind must be one of {FIELD_KINDS}, got {self.kind!r}")
        if self.name in ("id", "key"):
            raise ValueError(
                f"a field cannot be named {self.name!r}: batch[{self.name!r}] is raydl's own; rename it"
            )


#: The fields of a source that reads an image and an integer label (image folders; fields=None).
IMAGE_AND_LABEL = (Field("image", "image"), Field("label", "value", "int64"))
