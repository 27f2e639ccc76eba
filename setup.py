"""Builds the optional C extension cdc._native (the capture's hot spot: cdc/_native.pyx and the parts it includes,
cdc/_native_*.pxi); everything else is declared in pyproject.toml.

``optional=True``: without a C compiler or Python's headers the install still succeeds and the capture runs
its pure-Python path (at start the capture logs `fast paths: …`: which paths run in C, and why not where not).
"""

from Cython.Build import cythonize
from setuptools import Extension, setup

setup(
    ext_modules=cythonize(
        [Extension("cdc._native", ["cdc/_native.pyx"], optional=True, extra_compile_args=["-O2"])],
        compiler_directives={"language_level": "3"},
    )
)
