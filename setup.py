"""Builds raydl's native kernels with cffi at install time.

Everything else lives in pyproject.toml. The kernels are optional: when no C
compiler is present the build is skipped and raydl uses its numpy/Pillow
fallback, with a warning that says why (see raydl/native/__init__.py).
"""

from setuptools import setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """Build the extension, but never fail the install because of it."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - any build failure falls back
            print(f"raydl: native kernels not built ({exc}); the Python fallback will be used")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            print(f"raydl: native kernels not built ({exc}); the Python fallback will be used")


setup(
    cffi_modules=[
        "raydl/native/_build_kernels.py:ffibuilder",
        "raydl/native/_build_kernels.py:jpeg_ffibuilder",
        "raydl/native/_build_pyfi.py:ffibuilder",
    ],
    cmdclass={"build_ext": OptionalBuildExt},
)
