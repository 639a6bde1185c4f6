"""Checks that a dataset's pipelines can run, before any actor starts: image fields the program can decode,
batches with one shape, user functions that reach the workers (they must pickle)."""

from __future__ import annotations

import os
import sys
import sysconfig

from raydl.describe.catalog import Catalog
from raydl.describe.mixing import Mixture
from raydl.describe.records import Pipeline, decoded_fields

__all__ = ["check_mixture"]


def check_mixture(mixture: Mixture) -> None:
    """Every member's pipeline can run (a ValueError naming what is wrong, see `_check_pipeline`)."""
    for member in mixture.members:
        _check_pipeline(member.catalog, member.pipeline)


def _check_pipeline(catalog: Catalog, pipeline: Pipeline) -> list[tuple[str, bool]]:
    """The image fields the pipeline decodes ((name, is_mask)), after checking that it can run: a ValueError
    naming what is wrong (a decode stage with no image field to decode, no batch shape, a user function
    that does not pickle)."""
    program, fields = pipeline.program, catalog.source.fields
    decoded = decoded_fields(program, fields)
    if program is not None and not decoded:
        raise ValueError(
            f".decode() has no image field to decode: the {catalog.source.name} source's fields are "
            f"{[f.name for f in fields]}, none of them an image; drop .decode() and the image stages"
        )
    if catalog.source.reads_batches and pipeline.sample_stages:
        raise ValueError(
            f"the {catalog.source.name} source makes whole batches: per-sample stages (.map, .pad) do not "
            "apply to it; use .map_batches"
        )
    if decoded:
        program.slot_shapes()  # a ValueError when batches cannot have one image shape
    from ray import cloudpickle

    for fn in pipeline.functions:
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        if module is not None and _send_by_value(module):
            cloudpickle.register_pickle_by_value(module)
        try:
            cloudpickle.dumps(fn)
        except Exception as exc:  # noqa: BLE001 - any failure to pickle is the function's
            raise ValueError(
                f"{getattr(fn, '__qualname__', fn)!r} cannot be pickled, and the loader's workers need it: "
                f"{type(exc).__name__}: {exc}; define it at module level (not holding locks, files or "
                "sockets)"
            ) from exc
    return decoded


def _send_by_value(module) -> bool:
    """Whether a user function's module goes to the workers by value: a lone top-level module that is not
    installed (a test file, a script's sibling) may not be importable on the workers, whose path is the
    driver's script folder and working directory; a package's module (mypkg.transforms) or an installed one
    goes by reference."""
    name, path = module.__name__, getattr(module, "__file__", None)
    if name == "__main__" or "." in name or not path or not path.endswith(".py"):
        return False  # __main__ goes by value anyway; packages and extension modules by reference
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    real = os.path.realpath(path)
    return not any(real.startswith(os.path.realpath(p) + os.sep) for p in installed)
