"""read_webdataset's fields=: which members of a sample are fields, under which names, and of which kinds.

A selection is a tuple of (field name, its extensions), the first extension
a sample has being its member (webdataset's `to_tuple` alternatives,
"jpg;png"). `fields="all"` resolves at listing to every field that some
sample of the shards has, from the shards' field-set signatures, which
their indexes keep (raydl/sources/_wds_index.py); the kinds come from the
extensions (raydl/sources/_values.py).
"""

from __future__ import annotations

from raydl.describe.fields import Field
from raydl.errors import MissingFieldError
from raydl.sources._values import dtype_of, kind_of
from raydl.sources._wds_blocks import fields_of_signatures

__all__ = ["Select", "fields_of", "lacks", "parse_fields", "resolve_fields"]

#: fields= as listing resolves it: (field name, its extensions: the first a sample has is its member)
Select = tuple[tuple[str, tuple[str, ...]], ...]


def parse_fields(fields) -> Select | str | None:
    """fields= checked and normalised: None (the image and label), "all", or the selection of a dict
    {name: "ext;ext"} or a list of extensions (each its own name); a ValueError naming what is wrong."""
    if fields is None or fields == "all":
        return fields
    if isinstance(fields, dict):
        items = list(fields.items())
    elif isinstance(fields, (list, tuple)) and all(isinstance(e, str) for e in fields):
        items = [(e.split(";")[0].strip().lower().lstrip("."), e) for e in fields]
    else:
        raise ValueError(
            f"fields must be None, 'all', a dict {{name: 'ext;ext'}} or a list of extensions, got {fields!r}"
        )
    if not items:
        raise ValueError("fields= selects no field; pass None for the image and label, or 'all'")
    out = []
    for name, exts in items:
        alts = exts.split(";") if isinstance(exts, str) else exts
        if not isinstance(name, str) or not name or not isinstance(alts, (list, tuple)):
            raise ValueError(
                f"fields: {name!r}: {exts!r} is not an extension, or extensions separated by ';'"
            )
        alts = tuple(a.strip().lower().lstrip(".") if isinstance(a, str) else "" for a in alts)
        if not alts or not all(alts):
            raise ValueError(
                f"fields: {name!r}: {exts!r} is not an extension, or extensions separated by ';'"
            )
        kinds = {kind_of(a) for a in alts}
        if len(kinds) > 1:
            raise ValueError(
                f"fields: {name!r}: its extensions {list(alts)} are of different kinds {sorted(kinds)}"
            )
        Field(name, kinds.pop())  # a ValueError for "id" and "key"
        out.append((name, alts))
    names = [n for n, _ in out]
    if len(set(names)) < len(names):
        raise ValueError(f"fields: a name given twice in {names}")
    return tuple(out)


def fields_of(select: Select) -> tuple[Field, ...]:
    """The Field of each selected field: its kind from its (first) extension; int members are int64."""
    return tuple(Field(name, kind_of(exts[0]), dtype_of(exts[0])) for name, exts in select)


def resolve_fields(wanted: Select | str, shards: list[tuple[str, dict[str, int] | None]], urls) -> Select:
    """fields= against what the shards' samples have, from each shard's (uri, field-set signatures or None
    where unknown): "all" becomes every field some sample has (sorted); a selected field that no sample
    has is a ValueError naming it and the shards."""
    known = [(uri, sigs) for uri, sigs in shards if sigs is not None]
    have: set[str] = set()
    for _, sigs in known:
        have |= fields_of_signatures(sigs)
    where = (
        f"the {len(shards)} shard(s) of {urls!r}"
        if len(known) == len(shards)
        else (f"the {len(known)} of {len(shards)} shard(s) of {urls!r} whose index raydl has")
    )
    where += f" (the first {known[0][0]})" if known else ""
    if wanted == "all":
        for clash in ("id", "key"):
            if clash in have:
                raise ValueError(
                    f"fields='all': the samples of {where} have a .{clash} member, which would be "
                    f"batch[{clash!r}], raydl's own column; rename it with fields={{'sample_{clash}': "
                    f"'{clash}', ...}}"
                )
        return tuple((f, (f,)) for f in sorted(have))
    for name, exts in wanted:
        if not any(e in have for e in exts):
            raise ValueError(
                f"fields: no sample of {where} has the field {name!r} (a .{' or .'.join(exts)} member); "
                f"their fields are {sorted(have)}"
            )
    return wanted


def lacks(uri: str, key: str, name: str, exts: tuple[str, ...]) -> MissingFieldError:
    """A sample lacks a selected field (none of its extensions is a member): found by locate, or by cut; the
    sample's own defect, which on_error settles."""
    return MissingFieldError(
        f"{uri}: sample {key!r} lacks the field {name!r} (no .{' or .'.join(exts)} member)", uri=uri
    )
