"""Builds the optional C fast path (cortex_cache/_fastpath.c); everything else is in pyproject.toml.

`optional=True`: where no C compiler is found, the install goes on without it and
the pool uses its pure-Python path (docs/internals.md, "The fast path").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "cortex_cache._fastpath",
            ["cortex_cache/_fastpath.c", "cortex_cache/_copyhash_avx2.c"],
            include_dirs=["third_party/xxhash", "cortex_cache"],
            depends=["cortex_cache/_copyhash.h", "cortex_cache/_fastpath_put.h", "cortex_cache/_fastpath_load.h",
                     "third_party/xxhash/xxhash.h", "third_party/xxhash/LICENSE"],
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE"],
            optional=True,
        )
    ]
)
