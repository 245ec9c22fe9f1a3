"""Builds the optional C fast path (cortex_cache/_fastpath*.c); everything else is in pyproject.toml.

`optional=True`: where no C compiler is found, the install goes on without it and
the pool uses its pure-Python path (docs/internals.md, "The fast path").

It also puts the man page and the shell completions (pyproject's data-files) into
editable installs, which setuptools leaves them out of: its editable wheel asks the
distribution for `has_data`, a method it does not have (it is `has_data_files`), so
`pip install -e .` after `pip install .` removed `man cortex`.
"""

from setuptools import Extension, setup
from setuptools.command.editable_wheel import editable_wheel


class EditableWheelWithData(editable_wheel):
    def _run_install(self, category: str) -> None:
        super()._run_install(category)
        dist = self.distribution
        if category == "data" and not hasattr(dist, "has_data") and dist.has_data_files():
            self.run_command("install_data")  # into the wheel's .data/data, as a regular wheel has it


# The extension's compilation units (cortex_cache/_fastpath.h says what each holds).
FASTPATH_SOURCES = ["_fastpath", "_fastpath_spec", "_fastpath_guard", "_fastpath_pin", "_fastpath_read", "_fastpath_put",
                    "_fastpath_evict", "_fastpath_load", "_fastpath_fill", "_copyhash", "_copyhash_avx2"]
FASTPATH_HEADERS = ["_fastpath", "_fastpath_entries", "_copyhash", "_copyhash_loop"]


setup(
    cmdclass={"editable_wheel": EditableWheelWithData},
    ext_modules=[
        Extension(
            "cortex_cache._fastpath",
            [f"cortex_cache/{name}.c" for name in FASTPATH_SOURCES],
            include_dirs=["third_party/xxhash", "cortex_cache"],
            depends=[f"cortex_cache/{name}.h" for name in FASTPATH_HEADERS]
            + ["third_party/xxhash/xxhash.h", "third_party/xxhash/LICENSE"],
            # Hidden: what the files share (SLOW, guards, do_read...) stays inside the module.
            extra_compile_args=["-O2", "-std=c11", "-D_GNU_SOURCE", "-fvisibility=hidden"],
            optional=True,
        )
    ]
)
