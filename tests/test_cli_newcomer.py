"""What a newcomer met on a first session with `cortex` (issue 41) and a sweep of odd arguments (issue 40, 9).

Each test runs the CLI as a new user would, through `python -m cortex_cache`,
against real shared memory and a snapshot directory of its own: the help,
the words of its errors and where they go, the choices in any case, prefixes
that nest, the first boot, what a fill skipped, one ratio for snapshot space,
`--json`'s schema, and bad numbers and paths refused in one line (exit 2)
with nothing changed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, cli
from tests.test_cli import failed, fill, lib_stats, new_pool, ok, seg_path, show  # noqa: F401 (new_pool: a fixture)

PACKAGE = REPO / "cortex_cache"


def _doc(r) -> dict:
    """A --json document: one line on stdout, with its time and schema 1."""
    ok(r)
    assert r.stdout.count(b"\n") == 1, r.stdout
    doc = json.loads(r.stdout)
    assert isinstance(doc.pop("time"), str) and doc.pop("schema") == 1, doc
    return doc


# ---------------------------------------------------------------- help, choices, errors in our words


@pytest.mark.parametrize("argv", [[], ["cache"], ["-q"], ["cache", "-q"]])
def test_cortex_alone_prints_its_help_on_stdout_and_exits_0(argv):
    r = cli(*argv)
    assert r.returncode == 0 and r.stderr == b"", show(r)
    out = r.stdout.decode()
    assert out.startswith("Usage: cortex") and "Commands:" in out, out
    assert bool(re.search(r"^  create\s", out, re.M)) == (argv[:1] == ["cache"]), out


def test_create_help_lists_the_policies_one_a_line_and_says_which_if_unsure():
    from cortex_cache.policy_names import DEFAULT_POLICY, IF_UNSURE, POLICY_IDS

    out = ok(cli("cache", "create", "--help")).stdout.decode()
    lines = out.splitlines()
    for name in POLICY_IDS:  # each on its own line, its name first
        assert sum(1 for ln in lines if re.match(rf"\s+{name}\s{{2,}}\S", ln)) == 1, (name, out)
    at = next(n for n, ln in enumerate(lines) if re.match(rf"\s+{DEFAULT_POLICY}\s", ln))
    default = " ".join(lines[at:at + 3])  # its description, wrapped under it
    assert "(the default)" in default and sum("(the default)" in ln for ln in lines) == 1
    assert " ".join(IF_UNSURE.split()[:3]) in " ".join(out.split()) and "If unsure:" in out


def test_create_help_says_auto_adapts_and_an_existing_pool_keeps_its_policy():
    """auto's line says what it is now (adaptive, three regimes learnt online), and --policy says that
    `--if-missing` without it accepts an existing pool's policy (issue 42)."""
    out = " ".join(ok(cli("cache", "create", "--help")).stdout.decode().split())
    auto = out[out.index(" auto adaptive:") : out.index("(the default)")]
    assert all(word in auto for word in ("learning online", "frequency", "recency", "loop")), auto
    assert "with --if-missing, a pool that exists may have any policy unless this is given" in out


@pytest.mark.parametrize("given, stored", [("LRU", "lru"), ("Arc", "arc"), ("S3FIFO", "s3fifo"), ("auto", "auto")])
def test_policies_are_accepted_in_any_case(pool_name, cleanup, given, stored):
    cleanup.append(pool_name)
    ok(cli("cache", "create", pool_name, "--size", "1M", "--policy", given, "-q"))
    assert lib_stats(pool_name)["policy"] == stored


def test_a_wrong_choice_is_one_line_naming_the_valid_ones(pool_name, new_pool):
    from cortex_cache.policy_names import POLICY_IDS

    msg = failed(cli("cache", "create", pool_name, "--size", "1M", "--policy", "LRUX"), 2)
    assert "Value error" not in msg and "Input should" not in msg, msg
    assert "'LRUX'" in msg and ", ".join(POLICY_IDS) in msg, msg
    assert not seg_path(pool_name).exists()
    name = new_pool()
    assert ok(cli("cache", "status", name, "--format", "JSON")).stdout.startswith(b"{")
    assert ok(cli("cache", "keys", name, "--tier", "Memory")).stdout == b""
    msg = failed(cli("cache", "status", name, "--format", "yaml"), 2)
    assert "table, json, prometheus" in msg and "Value error" not in msg, msg
    msg = failed(cli("cache", "keys", name, "--limit", "many"), 2)
    assert msg == "cortex: error: invalid --limit: give a whole number (see --help)\n", msg


# ---------------------------------------------------------------- what the messages say


def test_get_verify_names_the_pool_in_the_repair_it_suggests(pool_name, cleanup):
    import xxhash

    from cortex_cache import Pool

    cleanup.append(pool_name)
    with Pool.create(pool_name, "1M", block_size="4K") as p:
        p.put("k", b"v" * 5000)
        slot = p.core.find(b"k", xxhash.xxh3_64_intdigest(b"k"))
        off, length = p.core.value_at(slot)
        p.core.mv[off:off + 4] = b"XXXX"  # the bytes change in place: the checksum no longer matches
    msg = failed(cli("cache", "get", pool_name, "k", "--verify"), 65)
    assert f"`cortex cache verify {pool_name} --repair`" in msg, msg
    r = cli("cache", "verify", pool_name, "--repair")  # and what it suggests does the repair
    assert r.returncode == 1 and b"[repaired]" in r.stdout, show(r)
    failed(cli("cache", "get", pool_name, "k", "--verify"), 66)


@pytest.mark.parametrize("extra", [[], ["--background"]])
def test_the_boot_line_on_a_first_boot_is_a_note_not_an_error(pool_name, cleanup, snapshot_dir, extra):
    cleanup.append(pool_name)
    r = cli("cache", "restore", pool_name, "--if-missing", *extra)
    assert r.returncode == 66 and r.stdout == b"", show(r)
    err = r.stderr.decode()
    assert err.startswith(f"cortex: note: no snapshot of {pool_name} in {snapshot_dir}") and err.count("\n") == 1
    assert "error" not in err and f"cortex cache create {pool_name}" in err, err
    r = cli("cache", "restore", pool_name, "--if-missing", "--json", *extra)
    doc = json.loads(r.stderr)
    assert r.returncode == 66 and r.stdout == b"" and doc["exit"] == 66 and doc["schema"] == 1, show(r)
    assert "note" in doc and "error" not in doc
    r = cli("cache", "restore", pool_name, "--if-missing", "-q", *extra)
    assert r.returncode == 66 and r.stdout == r.stderr == b"", show(r)
    # Asked to restore (no --if-missing), or from a file that is not there: that stays an error.
    assert "error: no snapshot" in failed(cli("cache", "restore", pool_name, *extra), 66)
    missing = str(snapshot_dir / "nowhere.ccsnap")
    assert "error: no snapshot" in failed(cli("cache", "restore", pool_name, "--if-missing", "-i", missing), 66)
    # The whole boot line: the note, then the pool made.
    line = (f"cortex cache restore {pool_name} --if-missing {' '.join(extra)} || "
            f"cortex cache create {pool_name} --size 1M --if-missing")
    env = {**os.environ, "PATH": f"{_bin(snapshot_dir.parent)}:{os.environ['PATH']}"}
    import subprocess

    r = subprocess.run(["bash", "-c", line], capture_output=True, env=env, timeout=120)
    assert r.returncode == 0 and b"cortex: note:" in r.stderr and b"created pool" in r.stdout, show(r)
    assert seg_path(pool_name).exists()


def _bin(d: Path) -> Path:
    """A directory with a `cortex` that runs this checkout."""
    import sys

    b = d / "bin"
    b.mkdir(exist_ok=True)
    (b / "cortex").write_text(f'#!/bin/sh\nexec {sys.executable} -m cortex_cache "$@"\n')
    (b / "cortex").chmod(0o700)
    return b


def test_what_a_fill_skipped_is_explained_where_it_is_shown(pool_name, snapshot_dir, restored):
    from cortex_cache import Pool
    from cortex_cache import persist as snap

    # A pool whose clock runs two hours behind: its one-hour TTL has passed by the real clock, so the fill
    # of its snapshot skips the entry as expired.
    with Pool.create(pool_name, "1M", block_size="4K", clock=lambda: time.time() - 7200) as p:
        p.put("old", b"o" * 100, ttl=3600)
        p.put("new", b"n" * 100)
        snap.persist(p)
    Pool.unlink(pool_name)
    r = ok(cli("cache", "restore", pool_name))
    restored.append(Pool.open(pool_name))
    assert "1 expired entry skipped" in r.stdout.decode(), show(r)
    line = next(ln for ln in ok(cli("cache", "status", pool_name)).stdout.decode().splitlines()
                if ln.startswith("fill"))
    assert "1 skipped (there already or gone: put, read early, deleted; or expired)" in line, line
    assert lib_stats(pool_name)["entries"] == 1


def test_one_ratio_for_snapshot_space_in_snapshots_doctor_and_the_readme(new_pool, snapshot_dir):
    from cortex_cache import persist as snap

    name = new_pool()
    fill(name, [(f"k{i}", bytes([i]) * 20_000) for i in range(10)])
    for _ in range(2):  # two whole copies of the same values: twice the largest, and no waste at all
        ok(cli("cache", "persist", name, "--full", "-q"))
    out = ok(cli("cache", "snapshots", name)).stdout.decode()
    assert re.search(r"\), 1\.00x what the kept snapshots need \(at most 1\.5x after a persist\)$", out, re.M), out
    assert "the largest" not in out
    space = _doc(cli("cache", "snapshots", name, "--json"))["space"]
    assert space["waste_ratio"] == pytest.approx(1.0, abs=0.01) and "ratio" not in space  # (pack headers)
    assert space["total_bytes"] >= 2 * 200_000
    r = cli("cache", "doctor", "--json")
    finding = next(f for f in json.loads(r.stdout)["findings"] if f["check"] == "snapshot-space")
    assert finding["ok"] and f"at most {snap.SPACE_BOUND}x what the kept snapshots need" in finding["message"]
    readme = " ".join((REPO / "README.md").read_text().split())
    assert f"at most {snap.SPACE_BOUND}x what the kept snapshots need" in readme
    assert "what the kept snapshots need" in " ".join((REPO / "docs" / "cli.md").read_text().split())


# ---------------------------------------------------------------- prefixes that nest


def test_a_listing_leaves_out_the_pools_of_a_longer_prefix(cleanup):
    from cortex_cache import Pool

    base = os.environ["CORTEX_CACHE_SHM_PREFIX"]
    outer, inner = {"CORTEX_CACHE_SHM_PREFIX": base + "nc."}, {"CORTEX_CACHE_SHM_PREFIX": base + "nc.sd."}
    try:
        ok(cli("cache", "create", "a", "--size", "1M", "-q", env=outer))
        ok(cli("cache", "create", "b", "--size", "1M", "-q", env=inner))
        assert Path(f"/dev/shm/{base}nc.sd.b").exists()  # which nc. would read as its pool "sd.b"
        assert [p["name"] for p in _doc(cli("cache", "list", "--json", env=outer))["pools"]] == ["a"]
        assert [p["name"] for p in _doc(cli("cache", "list", "--json", env=inner))["pools"]] == ["b"]
        assert [p["name"] for p in _doc(cli("cache", "status", "--json", env=outer))["pools"]] == ["a"]
        prom = ok(cli("cache", "status", "--format", "prometheus", env=outer)).stdout.decode()
        assert 'pool="a"' in prom and "sd.b" not in prom
        assert "sd.b" not in ok(cli("cache", "list", env=outer)).stdout.decode()
        # Named, it is used: the name addresses the segment, whichever prefix made it.
        assert _doc(cli("cache", "status", "sd.b", "--json", env=outer))["size_bytes"] == 1 << 20
        # A pool made before pools recorded their prefix (mark 0) is listed under both, as before.
        os.environ["CORTEX_CACHE_SHM_PREFIX"] = base + "nc.sd."
        try:
            with Pool.open("b") as p:
                p.core.header[0]["prefix_mark"] = 0
        finally:
            os.environ["CORTEX_CACHE_SHM_PREFIX"] = base
        assert [p["name"] for p in _doc(cli("cache", "list", "--json", env=outer))["pools"]] == ["a", "sd.b"]
    finally:
        for env, name in ((outer, "a"), (inner, "b")):
            cli("cache", "delete", name, "--force", "-q", env=env)
    assert not list(Path("/dev/shm").glob(base + "nc.*"))


# ---------------------------------------------------------------- evict, confirmations, metrics, --json


def test_evict_names_a_key_that_is_not_there_and_exits_66(new_pool):
    name = new_pool()
    fill(name, [("a", b"A" * 10), ("b", b"B" * 20)])
    msg = failed(cli("cache", "evict", name, "--key", "nokey"), 66)
    assert msg == f"cortex: error: no key 'nokey' in pool '{name}' (memory tier): nothing to evict for it\n"
    assert lib_stats(name)["entries"] == 2
    r = cli("cache", "evict", name, "--key", "a", "--key", "nokey", "--key", "no\nkey")
    assert r.returncode == 66 and r.stdout == b"evicted 1 entry, 10B (10 bytes)\n", show(r)
    assert r.stderr == f"cortex: error: no keys 'nokey', 'no\\x0akey' in pool '{name}' (memory tier): nothing to " \
                       "evict for them\n".encode(), show(r)
    r = cli("cache", "evict", name, "--key", "b", "--key", "gone", "--json")
    assert r.returncode == 66 and json.loads(r.stderr)["exit"] == 66, show(r)
    doc = json.loads(r.stdout)
    assert (doc["entries"], doc["bytes"], doc["missing"]) == (1, 20, ["gone"])
    assert lib_stats(name)["entries"] == 0
    fill(name, [("c", b"C")])
    assert ok(cli("cache", "evict", name, "--key", "c")).stdout == b"evicted 1 entry, 1B (1 bytes)\n"


def test_confirmations_go_to_stdout_notes_to_stderr(new_pool, pool_name, cleanup, snapshot_dir, tmp_path):
    name = new_pool()
    fill(name, [("k", b"v" * 1000)])
    for _ in range(3):
        ok(cli("cache", "persist", name, "-q"))
    r = ok(cli("cache", "snapshots", name, "--prune", "--keep", "1"))
    assert re.match(rf"removed \d+ files of {name}'s snapshots, .*; 1 snapshot kept\n", r.stdout.decode()), show(r)
    doc = _doc(cli("cache", "snapshots", name, "--prune", "--keep", "1", "--json"))
    assert doc["pruned"]["kept"] == 1
    assert ok(cli("cache", "snapshots", name, "--prune", "--keep", "1", "-q")).stdout.startswith(b"TIME")
    tiered = f"{pool_name}-tiered"
    cleanup.append(tiered)
    tier = tmp_path / "tier"
    ok(cli("cache", "create", tiered, "--size", "1M", "--disk-path", str(tier), "-q"))
    r = ok(cli("cache", "delete", tiered))
    assert r.stdout.decode().splitlines()[1].startswith(f"kept disk tier {tier}"), show(r)
    ok(cli("cache", "create", tiered, "--size", "1M", "--disk-path", str(tier), "-q"))
    r = ok(cli("cache", "delete", tiered, "--force"))
    assert r.stdout == f"deleted pool {tiered}\nremoved disk tier {tier}\n".encode(), show(r)
    # Notes that there is nothing to show stay on stderr: stdout holds only what was asked for.
    r = cli("cache", "snapshots", f"{pool_name}-none")
    assert r.returncode == 0 and r.stdout == b"" and r.stderr.startswith(b"no snapshots of"), show(r)


def test_the_last_snapshot_gauge_is_the_snapshots_bytes_not_its_manifests(new_pool, snapshot_dir):
    from cortex_cache import persist as snap

    name = new_pool(size="8M")
    fill(name, [(f"k{i}", bytes([i]) * 300_000) for i in range(5)])
    ok(cli("cache", "persist", name, "-q"))
    manifest = snap.latest_path(name).stat().st_size
    prom = ok(cli("cache", "status", name, "--format", "prometheus")).stdout.decode()
    gauge = int(re.search(rf'^cortex_cache_last_snapshot_bytes{{pool="{name}"}} (\d+)$', prom, re.M)[1])
    assert gauge == 1_500_000 and manifest < 100_000, (gauge, manifest)
    assert _doc(cli("cache", "status", name, "--json"))["snapshots"]["latest_value_bytes"] == 1_500_000


def test_every_json_document_carries_its_schema_and_the_rule_is_written_down(new_pool, pool_name, cleanup, tmp_path):
    from cortex_cache.cli_render import JSON_SCHEMA

    name = new_pool()
    fill(name, [("k", b"v")])
    created = f"{pool_name}-made"
    cleanup.append(created)
    for argv in (["create", created, "--size", "1M"], ["list"], ["status"], ["status", name], ["keys", name],
                 ["info", name, "k"], ["verify", name], ["persist", name, "-o", str(tmp_path / "s")],
                 ["snapshots", name], ["resize", name, "--size", "8M"], ["evict", name, "--all"], ["doctor"],
                 ["status", name, "--watch", "0.01", "--count", "1"]):
        r = cli("cache", *argv, "--json")
        assert r.returncode in (0, 1) and json.loads(r.stdout.splitlines()[0])["schema"] == JSON_SCHEMA, (argv, show(r))
    r = cli("cache", "info", name, "nokey", "--json")
    assert r.returncode == 66 and json.loads(r.stderr)["schema"] == JSON_SCHEMA
    page = " ".join((REPO / "docs" / "cli.md").read_text().split())
    assert "**JSON output**" in page and "`schema`" in page and "fields are only added" in page


# ---------------------------------------------------------------- every command and option documented


def _tree() -> dict[str, list[str]]:
    """Each command of `cortex cache` with its long options, from the command tree."""
    import typer

    from cortex_cache.cli import app

    group = typer.main.get_command(app).commands["cache"]
    return {name: [o for p in cmd.params if p.param_type_name == "option" for o in p.opts if o.startswith("--")]
            for name, cmd in group.commands.items()}


COMMON = {"--help", "--quiet", "--debug", "--json"}


def test_docs_cli_md_names_every_command_and_option_in_its_row():
    rows = {}
    for ln in (REPO / "docs" / "cli.md").read_text().splitlines():
        m = re.match(r"\| `(\w+) ", ln)
        if m:
            rows.setdefault(m[1], ln)
    for name, opts in _tree().items():
        assert name in rows, f"docs/cli.md has no row for {name}"
        missing = [o for o in opts if o not in COMMON and o not in rows[name]]
        assert not missing, f"docs/cli.md's row of {name} lacks {missing}"


def test_the_readme_cheat_sheet_names_every_command():
    text = (REPO / "README.md").read_text()
    sheet = text[text.index("## CLI cheat-sheet"):text.index("## Operating it")]
    for name in _tree():
        assert f"`{name}" in sheet or f", `{name}" in sheet, f"the README's cheat-sheet lacks {name}"
    for opt in ("--background", "--tier-admit"):
        assert opt in sheet


# ---------------------------------------------------------------- odd numbers and paths (issue 40, 9)


def _world(name: str, snapshot_dir: Path, cwd: Path) -> tuple:
    """What a refused command must leave as it was: the pool's counters and settings, the segments under
    the prefix, the snapshot directory, the files of the working directory."""
    st = lib_stats(name)
    seen = ("entries", "puts", "evictions", "size_bytes", "last_snapshot", "policy")
    listing = sorted(p.name for p in snapshot_dir.iterdir()) if snapshot_dir.exists() else []
    shm = sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(os.environ["CORTEX_CACHE_SHM_PREFIX"]))
    return tuple(st[k] for k in seen), listing, shm, sorted(p.name for p in cwd.iterdir())


ODD = [  # (arguments, what the one line must say)
    (["get", "{p}", "k", "-o", ""], '--output needs a file name'),
    (["get", "{p}", "k", "--verify", "-o", ""], '--output needs a file name'),
    (["persist", "{p}", "--keep", "99999999999"], 'at most 4294967295'),
    (["persist", "{p}", "--keep", "99999999999", "--full"], 'at most 4294967295'),
    (["persist", "{p}", "--keep", "18446744073709551616"], 'at most 4294967295'),
    (["persist", "{p}", "-o", ""], '--output needs a file name'),
    (["create", "{new}", "--size", "1M", "--keep", "99999999999"], 'at most 4294967295'),
    (["create", "{new}", "--size", "1M", "--keep", "0"], 'at least 1'),
    (["create", "{new}", "--size", "1M", "--tier-admit", "3"], 'at most 2'),
    (["create", "{new}", "--size", "1M", "--tier-admit", "-1"], 'at least 1'),
    (["create", "{new}", "--size", "1M", "--tier", "disk", "--disk-max-entries", "99999999999"], 'at most 2147483646'),
    (["create", "{new}", "--size", "1M", "--max-entries", b"\xff"], 'not UTF-8'),
    (["create", "{new}", "--size", "1M", "--disk-path", ""], 'the disk path is empty: give a directory (or leave'),
    (["snapshots", "{p}", "--prune", "--keep", "99999999999"], 'at most 4294967295'),
    (["status", "{p}", "--watch", "99999999999", "--count", "1"], 'from 0.01 to 86400 seconds'),
    (["status", "{p}", "--watch", "inf", "--count", "1"], 'from 0.01 to 86400 seconds'),
    (["status", "{p}", "--watch", "1e-300", "--count", "1"], 'from 0.01 to 86400 seconds'),
    (["put", "{p}", "k2", "/dev/null", "--ttl", "inf"], 'at most 3155760000 (100 years'),
    (["put", "{p}", "k2", "/dev/null", "--ttl", "1e400"], 'at most 3155760000 (100 years'),
    (["put", "{p}", "k2", "/dev/null", "--ttl", "nan"], 'at most 3155760000 (100 years'),
    (["put", "{p}", "k2", "/dev/null", "--ttl", "1e12"], 'at most 3155760000 (100 years'),
    (["put", "{p}", "k2", ""], 'FILE needs a file name'),
    (["restore", "{p}", "--replace", "-i", ""], '--input needs a file name'),
    (["delete", "{new}", "--force", "--disk-path", ""], '--disk-path needs a directory'),
    (["keys", "{p}", "--limit", "0"], 'at least 1'),
]

@pytest.fixture(scope="module")
def odd_pool():
    """One pool with a value and a snapshot for every odd argument (each must leave it as it was)."""
    from cortex_cache import Pool
    from cortex_cache import persist as snap

    name = "odd-args"
    with Pool.create(name, "4M", block_size="4K") as p:
        p.put("k", b"value")
        snap.persist(p)
    yield name
    Pool.unlink(name)
    snap.prune(name, 0)


@pytest.mark.parametrize("argv, says", ODD, ids=[" ".join(a if isinstance(a, str) else repr(a) for a in argv)
                                                  for argv, _ in ODD])
def test_an_odd_number_or_path_is_one_line_exit_2_and_changes_nothing(odd_pool, pool_name, cleanup, tmp_path, argv,
                                                                       says):
    name, snapshot_dir = odd_pool, Path(os.environ["CORTEX_CACHE_SNAPSHOT_DIR"])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cleanup.append(f"{pool_name}-new")
    args = [a.format(p=name, new=f"{pool_name}-new") if isinstance(a, str) else a for a in argv]
    before = _world(name, snapshot_dir, cwd)
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cortex_cache", "cache", *args], capture_output=True, cwd=cwd,
                       timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    msg = failed(r, 2)
    assert "Input should" not in msg and "Value error" not in msg and "internal error" not in msg, msg
    assert says in msg, msg  # the bound broken, or what is missing: never a wrong bound
    assert _world(name, snapshot_dir, cwd) == before


def test_a_put_ttl_is_one_every_reader_can_show(new_pool):
    """The far end of what --ttl accepts still reads back: info, keys --long and valid JSON."""
    from cortex_cache.values import MAX_TTL

    name = new_pool()
    ok(cli("cache", "put", name, "far", "-", "--ttl", str(MAX_TTL), input=b"x"))
    assert "far" in ok(cli("cache", "info", name, "far")).stdout.decode()
    assert ok(cli("cache", "keys", name, "-l")).stdout.count(b"\n") == 2
    assert _doc(cli("cache", "keys", name, "--json"))["keys"][0]["ttl_remaining"] > 99 * 365 * 86400


# ---------------------------------------------------------------- the CLI's rooms


def test_the_cli_is_split_into_modules_of_readable_size_and_the_library_never_imports_them():
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["cortex"] == "cortex_cache.cli:main"
    cli_modules = sorted(p for p in PACKAGE.glob("cli*.py"))
    assert len(cli_modules) >= 6
    for path in cli_modules:
        n = len(path.read_text().splitlines())
        assert n <= 900, f"{path.name} has {n} lines"
    for path in PACKAGE.rglob("*.py"):
        if path.name.startswith("cli") or path.name == "__main__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            assert not any(n.split(".")[-1].startswith("cli") for n in names), f"{path} imports the CLI"
