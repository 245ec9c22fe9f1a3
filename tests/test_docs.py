"""Every code block of README.md and docs/*.md runs in a test.

The convention, enforced here for every fenced block:

- ```console: a session (`$ command` and its output); tests/test_cli_docs.py
  reruns it and compares the output.
- ```python and ```sh: run here, each in a fresh process, in a scratch HOME
  and snapshot directory, under a private CORTEX_CACHE_SHM_PREFIX, with the
  checkout's `cortex` first on PATH; it must exit 0 and leave no segment.
  A block that cannot run here (it installs, needs a GPU, an engine or a
  server's sizes) starts with `# not run here: <why>`, and says why.
- ```cron and ```ini: the operating recipes; tests/test_recipes.py runs
  their command lines as written (they live in docs/operating.md, and the
  README's copies must match it).
- ```text: output or data, not code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

PAGES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
LANGS = {"console", "python", "sh", "cron", "ini", "text"}
SKIP = "# not run here:"
_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```$", re.S | re.M)


def _blocks() -> list[tuple[str, int, str, str]]:
    """(page, line, language, body) of every fenced block."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in _FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((page.relative_to(REPO).as_posix(), line, m.group(1).strip(), m.group(2)))
    return out


BLOCKS = _blocks()
RUNNABLE = [b for b in BLOCKS if b[2] in ("python", "sh") and not b[3].startswith(SKIP)]


def test_every_block_follows_the_convention():
    assert len(BLOCKS) > 20
    for page, line, lang, body in BLOCKS:
        assert lang in LANGS, f"{page}:{line}: block language {lang!r} is not one of {sorted(LANGS)}"
        if body.startswith(SKIP):
            assert lang in ("python", "sh"), f"{page}:{line}: only python and sh blocks can be skipped"
            why = body.splitlines()[0][len(SKIP):].strip()
            assert len(why) >= 10, f"{page}:{line}: say why the block cannot run here"
        if lang in ("cron", "ini"):
            assert page in ("docs/operating.md", "README.md"), f"{page}:{line}: recipes live in docs/operating.md"
    assert any(b[2] == "python" for b in RUNNABLE) and any(b[2] == "sh" for b in RUNNABLE)


@pytest.mark.parametrize("page,line,lang,body", RUNNABLE, ids=[f"{b[0]}:{b[1]}" for b in RUNNABLE])
def test_block_runs(page, line, lang, body, tmp_path):
    prefix = os.environ["CORTEX_CACHE_SHM_PREFIX"] + f"doc{line}."
    bindir, home = tmp_path / "bin", tmp_path / "home"
    bindir.mkdir()
    home.mkdir()
    (bindir / "cortex").write_text(f'#!/bin/sh\nexec {sys.executable} -m cortex_cache "$@"\n')
    (bindir / "cortex").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CORTEX_CACHE_")}
    env.update(PATH=f"{bindir}:{Path(sys.executable).parent}:/usr/bin:/bin", HOME=str(home),
               XDG_STATE_HOME=str(home / ".local" / "state"), CORTEX_CACHE_SHM_PREFIX=prefix,
               CORTEX_CACHE_SNAPSHOT_DIR=str(tmp_path / "snapshots"), PYTHONPATH=str(REPO), NO_COLOR="1")
    argv = [sys.executable, "-c", body] if lang == "python" else ["bash", "-e", "-c", body]
    try:
        r = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, timeout=300)
        assert r.returncode == 0, f"{page}:{line} failed ({r.returncode}):\n{r.stdout.decode()}\n{r.stderr.decode()}"
    finally:
        left = sorted(p.name for p in Path("/dev/shm").glob(prefix + "*"))
        for p in Path("/dev/shm").glob(prefix + "*"):
            p.unlink()
    assert not left, f"{page}:{line} left segments behind: {left}"


def test_readme_quickstart_commands_are_the_ci_ones():
    ci = (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    test_lines = [line for line in ci.splitlines() if "pytest" in line and not line.lstrip().startswith("#")]
    assert len(test_lines) == 6  # the suite, the engines' tests, -m long, the crash matrix, the fuzz, the short soak
    for line in test_lines:
        assert line in readme, line
    # Each kind of test the default run leaves out (pyproject's addopts) has a command of its own.
    addopts = re.search(r'^addopts = "(.*)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    assert test_lines[0].endswith("pytest -q -n 2 --dist loadfile") and re.findall(r"not (\w+)", addopts) == ["soak", "engine", "long"]
    for marker in re.findall(r"not (\w+)", addopts):
        assert any(f"-m {marker}" in line for line in test_lines), marker
    # The two fresh-machine commands stay near the top.
    top = readme[: readme.index("## Install")]
    assert ".venv/bin/cortex cache create demo" in top and test_lines[0] in top


def test_readme_is_a_newcomers_page():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    for page in re.findall(r"\]\((docs/[^)]+\.md)\)", readme):
        assert (REPO / page).exists(), page
    for word in ("issue [", "session 3", "the project's machine"):
        assert word not in readme
