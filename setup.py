"""Builds streamsync's compiled kernel (``streamsync/_kernel.c``) when the package is
installed or a wheel is built; the package's metadata is in pyproject.toml."""

import sys

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "streamsync._kernel",
            sources=["streamsync/_kernel.c"],
            # The flags the kernel is tuned with (Python's own add -fwrapv, which keeps the
            # compiler from assuming a loop counter never overflows). No -march: the AVX-512
            # loop is chosen at run time by the CPU's flags.
            extra_compile_args=["-O3", "-fno-wrapv"],
            libraries=["dl"] if sys.platform.startswith("linux") else [],
            # Without a working C compiler the package installs without it, and copies and
            # compares with torch and ctypes.memmove (streamsync._copies.kernel() says which).
            optional=True,
        )
    ]
)
