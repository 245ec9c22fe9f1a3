"""The README's commands are real: run them as written."""

from __future__ import annotations

import re
import shlex

from cortex_cache import Pool
from tests.helpers import REPO, cli

README = (REPO / "README.md").read_text()


def _cortex_commands(block_lang: str) -> list[list[str]]:
    """`cortex ...` command lines inside ```block_lang blocks, as argv lists (program dropped)."""
    out = []
    for block in re.findall(rf"```{block_lang}\n(.*?)```", README, re.S):
        for m in re.finditer(r"(?:^|\s|=)(?:/usr/local/bin/)?cortex (cache [^>\n]*)", block):
            out.append(shlex.split(m.group(1)))
    return out


def test_readme_cron_and_systemd_commands_run(pool_name, tmp_path, monkeypatch):
    monkeypatch.setenv("CORTEX_CACHE_SNAPSHOT_DIR", str(tmp_path / "snaps"))
    cron = _cortex_commands("cron")
    units = _cortex_commands("ini")
    assert cron and len(units) == 2, (cron, units)
    name = "llama"
    assert not Pool.exists(name)
    try:
        # First boot: no snapshot yet, the unit's SuccessExitStatus=66 case.
        restore = [a.replace("%i", name) for a in units[1]]
        assert restore[:2] == ["cache", "restore"]
        assert cli(*restore).returncode == 66
        with Pool.create(name, "1M", block_size="4K") as p:
            p.put("greeting", b"hello")
        for argv in (cron[0], [a.replace("%i", name) for a in units[0]]):
            r = cli(*argv)
            assert r.returncode == 0, (argv, r.stderr)
        Pool.unlink(name)
        r = cli(*restore)  # boot: the pool comes back from the latest snapshot
        assert r.returncode == 0, r.stderr
        with Pool.open(name) as p:
            assert p.get("greeting") == b"hello"
    finally:
        if Pool.exists(name):
            Pool.unlink(name)


def test_readme_quickstart_commands_are_the_ci_ones():
    ci = (REPO / ".ci" / "run").read_text()
    test_lines = [line for line in ci.splitlines() if "pytest" in line and not line.lstrip().startswith("#")]
    assert len(test_lines) == 3  # the suite, the short soak, the crash matrix with more kills
    for line in test_lines:
        assert line in README, line
