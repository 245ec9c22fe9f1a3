"""The recipes of docs/operating.md work as written.

Each recipe's command lines run under a clean environment, as cron and
systemd give them (`env -i PATH=/usr/bin:/bin HOME=...`), through the
installed `cortex` console script.  Only what the page tells the reader to
put in are replaced: the path of `cortex` (`/opt/cortex-cache/bin/cortex`),
the state directory systemd's StateDirectory= makes (`/var/lib/cortex-cache`),
and the shell's `~`; plus this test run's CORTEX_CACHE_SHM_PREFIX so the
pool is private to it.  A first boot, a reboot (segment deleted) and a
service restart each have to end with the whole pool there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cortex_cache import Pool
from cortex_cache.disklog import DiskLog
from cortex_cache.fill import FILL_BYTE
from cortex_cache.lock import RecordLock

from .helpers import REPO

PAGE = (REPO / "docs" / "operating.md").read_text()
DOC_CORTEX = "/opt/cortex-cache/bin/cortex"
DOC_STATE = "/var/lib/cortex-cache"
POOL = "llama"
CORTEX = Path(sys.executable).parent / "cortex"  # the console script pip installed beside this Python


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", PAGE, re.S)


def _code(block: str) -> str:
    """A block's lines without its comments (the `# not run here: ...` marker)."""
    return "\n".join(ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#"))


def test_readme_shows_the_tested_recipes():
    """The README's boot and cron lines are the ones tested here, character for character."""
    readme = (REPO / "README.md").read_text()
    for lang in ("sh", "cron"):
        tested = {_code(b) for b in _blocks(lang)}
        shown = [_code(b) for b in re.findall(rf"```{lang}\n(.*?)```", readme, re.S) if "/opt/cortex-cache" in b]
        assert shown and all(b in tested for b in shown), (lang, shown)


def _units() -> dict[str, str]:
    """The unit files on the page, by file name (each block starts with `# /etc/systemd/system/NAME`)."""
    out = {}
    for block in _blocks("ini"):
        first, _, body = block.partition("\n")
        m = re.fullmatch(r"# /etc/systemd/system/(\S+)", first)
        assert m, f"a unit block must start with its path: {first!r}"
        out[m.group(1)] = body
    return out


@pytest.fixture
def clean_env(tmp_path):
    """env -i PATH=/usr/bin:/bin HOME=<private home>, and this run's prefix; the pool removed after."""
    if not CORTEX.exists():
        pytest.skip(f"no installed console script at {CORTEX}")
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home),
           "CORTEX_CACHE_SHM_PREFIX": os.environ["CORTEX_CACHE_SHM_PREFIX"]}
    if os.geteuid() == 0:  # root's default is /var/lib/cortex-cache/snapshots: never the host's real one here
        env["CORTEX_CACHE_SNAPSHOT_DIR"] = str(home / ".local/state/cortex-cache/snapshots")
    assert not Pool.exists(POOL)
    yield env
    if Pool.exists(POOL):
        with Pool.open(POOL) as p:
            tier = p.disk_path
        Pool.unlink(POOL)
        if tier:
            DiskLog.destroy(tier)


def _sh(line: str, env: dict, state: Path | None = None) -> subprocess.CompletedProcess:
    line = line.replace(DOC_CORTEX, str(CORTEX))
    if state is not None:
        line = line.replace(DOC_STATE, str(state))
    return subprocess.run(["/bin/sh", "-c", line], env=env, capture_output=True, timeout=120, cwd="/")


def _exec_lines(unit: str, key: str) -> list[str]:
    return [m.group(1) for m in re.finditer(rf"^{key}=(.*)$", unit, re.M)]


def _unit_env(unit: str, env: dict, state: Path) -> dict:
    out = dict(env)
    for assignment in _exec_lines(unit, "Environment"):
        k, _, v = assignment.partition("=")
        out[k] = v.replace(DOC_STATE, str(state))
    return out


def _run_unit(unit: str, key: str, env: dict, state: Path) -> None:
    """Run a unit's ExecStart= (or ExecStop=) lines in order, as systemd would; fail like it would."""
    ok = {0} | {int(c) for line in _exec_lines(unit, "SuccessExitStatus") for c in line.split()}
    for line in _exec_lines(unit, key):
        ignore = line.startswith("-")
        r = _sh(line.lstrip("-"), _unit_env(unit, env, state), state)
        assert ignore or r.returncode in ok, (line, r.returncode, r.stderr.decode())


def _entries() -> dict:
    """Every entry of the pool, once a background fill (restore --background) is done."""
    with Pool.open(POOL) as p:
        lock = RecordLock(p.core.seg.fd, FILL_BYTE)  # the filler holds it from before the publish to its end
        lock.acquire(timeout=60)
        lock.release()
        fill = p.stats()["fill"]
        assert fill is None or fill["state"] == "done", fill
        return {k: p.get(k) for k in p.keys()}


def test_cron_recipe(clean_env):
    (setup,) = [b.split("\n")[:1] for b in _blocks("sh") if b.startswith("mkdir")]
    assert setup == ["mkdir -p ~/.local/state/cortex-cache"]
    (cron,) = [line for line in _blocks("cron")[0].splitlines() if line.strip() and not line.startswith("#")]
    fields = cron.split(None, 5)
    assert fields[:5] == ["*/15", "*", "*", "*", "*"]
    command = fields[5]
    assert command.startswith(DOC_CORTEX + " ")  # absolute: cron's PATH has no venv
    with Pool.create(POOL, "1M", block_size="4K") as p:
        p.put("greeting", b"hello")
    assert _sh(setup[0], clean_env).returncode == 0
    for _ in range(2):
        r = _sh(command, clean_env)
        assert r.returncode == 0, r.stderr
    log = Path(clean_env["HOME"]) / ".local/state/cortex-cache/persist.log"
    lines = log.read_text().splitlines()
    assert len(lines) == 2
    for line in lines:
        doc = json.loads(line)
        assert doc["pool"] == POOL and doc["entries"] == 1 and "time" in doc
    snaps = Path(clean_env["HOME"]) / ".local/state/cortex-cache/snapshots"
    assert (snaps / (os.environ["CORTEX_CACHE_SHM_PREFIX"] + POOL + ".ccsnap")).exists()


def test_boot_line_first_boot_reboot_restart(clean_env):
    (line,) = [_code(b) for b in _blocks("sh") if "--if-missing" in b]
    line = line.replace("--size 64M", "--size 1M")  # what /dev/shm of a CI box affords
    assert _sh(line, clean_env).returncode == 0  # first boot: created
    with Pool.open(POOL) as p:
        p.put("k", b"v")
    assert _sh(f"{DOC_CORTEX} cache persist {POOL}", clean_env).returncode == 0
    assert _sh(line, clean_env).returncode == 0  # service restart: left alone
    assert _entries() == {"k": b"v"}
    with Pool.open(POOL) as p:
        tier = p.disk_path
    Pool.unlink(POOL)  # reboot
    assert _sh(line, clean_env).returncode == 0
    assert _entries() == {"k": b"v"}
    with Pool.open(POOL) as p:
        assert p.disk_path == tier


def test_systemd_recipe_first_boot_reboot_restart(clean_env, tmp_path):
    units = _units()
    pool_unit = units[f"cortex-cache-{POOL}.service"]
    persist_unit = units[f"cortex-cache-{POOL}-persist.service"]
    timer = units[f"cortex-cache-{POOL}-persist.timer"]
    assert "Before=vllm.service" in pool_unit
    assert f"After=cortex-cache-{POOL}.service" in persist_unit and f"Requires=cortex-cache-{POOL}.service" in persist_unit
    assert f"After=cortex-cache-{POOL}.service" in timer
    for line in _exec_lines(pool_unit, "ExecStart") + _exec_lines(persist_unit, "ExecStart"):
        assert line.lstrip("-").startswith(DOC_CORTEX + " ")
    pool_unit = pool_unit.replace("--size 64M", "--size 1M")
    state = tmp_path / "state"  # StateDirectory=cortex-cache
    state.mkdir()

    _run_unit(pool_unit, "ExecStart", clean_env, state)  # first boot: no snapshot, created
    with Pool.open(POOL) as p:
        for i in range(40):  # more than memory holds: the disk tier has some
            p.put(f"k{i}", bytes([i]) * 40_000)
        tier = p.disk_path
        assert tier.startswith(str(state / "disk"))
    want = _entries()
    _run_unit(persist_unit, "ExecStart", clean_env, state)  # the timer fires
    _run_unit(pool_unit, "ExecStop", clean_env, state)  # shutdown
    Pool.unlink(POOL)  # reboot: /dev/shm is empty again
    _run_unit(pool_unit, "ExecStart", clean_env, state)
    assert _entries() == want
    with Pool.open(POOL) as p:
        assert p.disk_path == tier and p.stats()["disk"]["entries"] > 0
        p.put("after", b"restart")
    _run_unit(pool_unit, "ExecStop", clean_env, state)  # systemctl restart
    _run_unit(pool_unit, "ExecStart", clean_env, state)
    assert _entries()["after"] == b"restart"
    snaps = list((state / "snapshots").iterdir())
    assert snaps, "the units wrote no snapshot"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_units(tmp_path):
    for name, body in _units().items():
        (tmp_path / name).write_text(body.replace(DOC_CORTEX, str(CORTEX)))
    r = subprocess.run(["systemd-analyze", "verify", "--man=no", *sorted(str(p) for p in tmp_path.iterdir())],
                       capture_output=True, timeout=120, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    noise = [ln for ln in r.stderr.splitlines() if ln.strip() and "vllm.service" not in ln]
    assert not noise, noise
