"""The CLI's documentation surfaces and output rules.

- `-q/--quiet` silences confirmations and progress bars, never data or errors;
- `--help` loads neither numpy nor torch;
- the shell completions in completions/ and the man page man/cortex.1 are
  what scripts/gen_docs.py makes from the command tree today (stale = fail),
  and they work: bash/zsh/fish offer commands, options, choices and pools;
- the man page renders without warnings and names every command, option and
  exit code;
- the README's CLI usage examples show the output the commands really give.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, cli, run_py
from tests.test_cli import failed, fill, lib_keys, lib_stats, new_pool, ok, seg_path, show  # noqa: F401

# ---------------------------------------------------------------- -q / --quiet


def _read_pty(master: int) -> bytes:
    out = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            return out
        if not chunk:
            return out
        out += chunk


@pytest.mark.parametrize(
    "where",
    [
        pytest.param("root", id="cortex-q-cache"),
        pytest.param("group", id="cache-q-cmd"),
        pytest.param("command", id="cmd-q"),
        pytest.param("command-long", id="cmd--quiet"),
    ],
)
def test_quiet_silences_confirmations(pool_name, cleanup, tmp_path, where):
    def run(*args: str) -> subprocess.CompletedProcess:
        if where == "root":
            argv = ["-q", "cache", *args]
        elif where == "group":
            argv = ["cache", "-q", *args]
        else:
            argv = ["cache", *args, "-q" if where == "command" else "--quiet"]
        r = cli(*argv)
        assert r.returncode == 0, show(r)
        assert r.stdout == b"" and r.stderr == b"", (argv, show(r))
        return r

    name = pool_name
    cleanup.append(name)
    run("create", name, "--size", "1M", "--block-size", "4K")
    assert seg_path(name).is_file()
    fill(name, [("a", b"A" * 100), ("b", b"B" * 200)])
    run("verify", name)
    snap = tmp_path / "s.ccsnap"
    run("persist", name, "--output", str(snap))
    assert snap.stat().st_size > 300
    run("evict", name, "--key", "a")
    assert lib_keys(name) == ["b"]
    run("restore", name, "--input", str(snap), "--replace")
    assert lib_keys(name) == ["a", "b"]
    run("put", name, "c", str(snap))
    run("delete", name)
    assert not seg_path(name).exists()
    # "no pools" is a note for a person too
    env_prefix = os.environ["CORTEX_CACHE_SHM_PREFIX"] + "none."
    for args in (["list"], ["status"]):
        r = cli(*(["-q", "cache"] if where == "root" else ["cache", "-q"]), *args,
                env={"CORTEX_CACHE_SHM_PREFIX": env_prefix})
        assert r.returncode == 0 and r.stdout == b"" and r.stderr == b"", show(r)


def test_without_quiet_the_same_commands_confirm(pool_name, cleanup, tmp_path):
    """The other half of the test above: the confirmations exist and -q is what removes them."""
    name = pool_name
    cleanup.append(name)
    assert f"created pool {name}" in ok(cli("cache", "create", name, "--size", "1M", "--block-size", "4K")).stdout.decode()
    fill(name, [("a", b"A" * 100)])
    assert f"pool {name}: ok" in ok(cli("cache", "verify", name)).stdout.decode()
    snap = tmp_path / "s.ccsnap"
    assert "persisted 1 entry" in ok(cli("cache", "persist", name, "-o", str(snap))).stdout.decode()
    assert "evicted 1 entry" in ok(cli("cache", "evict", name, "--all")).stdout.decode()
    assert "restored 1 entry" in ok(cli("cache", "restore", name, "-i", str(snap), "--replace")).stdout.decode()
    r = cli("cache", "list", env={"CORTEX_CACHE_SHM_PREFIX": os.environ["CORTEX_CACHE_SHM_PREFIX"] + "none."})
    assert r.returncode == 0 and r.stderr == b"no pools\n", show(r)


def test_quiet_keeps_data_json_and_errors(new_pool, pool_name, cleanup, tmp_path):
    name = new_pool()
    fill(name, [("k1", b"\x00value\xff"), ("k2", b"two")])
    assert ok(cli("cache", "-q", "get", name, "k1")).stdout == b"\x00value\xff"
    assert ok(cli("cache", "keys", name, "-q")).stdout == b"k1\nk2\n"
    assert json.loads(ok(cli("-q", "cache", "status", name, "--json")).stdout)["entries"] == 2
    assert name in ok(cli("cache", "status", name, "-q")).stdout.decode()
    assert name in ok(cli("cache", "list", "-q")).stdout.decode()
    prom = ok(cli("cache", "status", name, "--format", "prometheus", "-q")).stdout.decode()
    assert f'cortex_cache_entries{{pool="{name}"}} 2' in prom
    doc = json.loads(ok(cli("cache", "evict", name, "--key", "k2", "--json", "-q")).stdout)
    assert isinstance(doc.pop("time"), str)  # every --json document says when it was made
    assert doc.pop("schema") == 1  # ... and the version of its shape (docs/cli.md, "JSON output")
    assert doc == {"pool": name, "tier": "memory", "entries": 1, "bytes": 3, "missing": []}
    created = f"{pool_name}-json"
    cleanup.append(created)
    doc = json.loads(ok(cli("cache", "create", created, "--size", "1M", "--json", "--quiet")).stdout)
    assert doc["name"] == created and doc["size_bytes"] == 1 << 20
    out = tmp_path / "s.ccsnap"
    doc = json.loads(ok(cli("cache", "persist", name, "-o", str(out), "--json", "-q")).stdout)
    assert doc["entries"] == 1 and doc["path"] == str(out)

    # errors: still one line on stderr and the exit code
    failed(cli("-q", "cache", "status", f"{pool_name}-missing"), 66)
    failed(cli("cache", "get", name, "nokey", "-q"), 66)
    failed(cli("cache", "-q", "create", name, "--size", "1M"), 73)
    msg = failed(cli("cache", "evict", name, "-q"), 2)
    assert "exactly one of" in msg


def test_quiet_verify_still_reports_problems(new_pool):
    from cortex_cache import Pool

    name = new_pool()
    fill(name, [("a", b"A" * 5000)])
    with Pool.open(name) as p:
        off = p.geometry.data_off + p.info("a")["first_block"] * p.geometry.block_size
    with open(seg_path(name), "r+b") as f:
        f.seek(off + 10)
        f.write(b"corrupt!")
    r = cli("cache", "verify", name, "-q")
    assert r.returncode == 1, show(r)
    text = r.stdout.decode()
    assert f"pool {name}: " in text and f"pool {name}: ok" not in text, show(r)  # the problem, no "ok" line


@pytest.mark.parametrize("quiet", [False, True], ids=["progress", "quiet"])
def test_quiet_silences_the_progress_bar_on_a_terminal(new_pool, tmp_path, quiet):
    name = new_pool()
    fill(name, [("a", b"A" * 100)])
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cortex_cache", "cache", "persist", name, "-o", str(tmp_path / "s"), *(["-q"] if quiet else [])],
        stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL, cwd=REPO,
    )
    os.close(slave)
    try:
        err = _read_pty(master)
    finally:
        os.close(master)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, err
    assert (tmp_path / "s").is_file()
    if quiet:
        assert out == b"" and err == b"", (out, err)
    else:
        assert b"persisted 1 entry" in out
        assert f"persist {name}".encode() in err, err  # the bar, drawn on the terminal


def test_status_does_not_list_itself_as_attached(new_pool):
    """`attached` is for the operator's other processes: the `cortex` that reads the pool is not one of them."""
    name = new_pool()
    assert json.loads(ok(cli("cache", "status", name, "--json")).stdout)["attached_pids"] == []
    doc = json.loads(ok(cli("cache", "status", "--json")).stdout)
    assert [p["attached_pids"] for p in doc["pools"] if p["name"] == name] == [[]]
    assert re.search(r"^attached\s+none\s*$", ok(cli("cache", "status", name)).stdout.decode(), re.M)


# ---------------------------------------------------------------- startup


def test_help_loads_neither_numpy_nor_torch():
    """`cortex --help`, `cortex cache --help` and every command's --help, in one child."""
    out = run_py(
        """
        import contextlib, io, json, sys
        from cortex_cache.cli import app, main
        import typer
        cmds = sorted(typer.main.get_command(app).commands["cache"].commands)
        res = {}
        for argv in [["--help"], ["cache", "--help"]] + [["cache", c, "--help"] for c in cmds]:
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(argv)
            res[" ".join(argv)] = [rc, len(buf.getvalue())]
        print(json.dumps({"helps": res, "loaded": [m for m in ("numpy", "torch") if m in sys.modules]}))
        """
    )
    doc = json.loads(out.stdout)
    assert len(doc["helps"]) == 2 + len(COMMANDS), doc
    for argv, (rc, n) in doc["helps"].items():
        assert rc == 0 and n > 100, (argv, rc, n)
    assert doc["loaded"] == []


# ---------------------------------------------------------------- Typer's completion protocol


def test_typer_completion_protocol_through_main():
    """`_CORTEX_COMPLETE=complete_bash` (Typer's own scripts, powershell) is answered by main()."""
    env = {"_CORTEX_COMPLETE": "complete_bash", "COMP_WORDS": "cortex cache cr", "COMP_CWORD": "2"}
    r = cli(env=env)
    assert r.returncode == 0 and r.stdout.split() == [b"create"], show(r)
    env.update(COMP_WORDS="cortex cache create x --policy ", COMP_CWORD="5")
    r = cli(env=env)
    assert r.returncode == 0 and r.stdout.split() == [b"lru", b"lfu", b"fifo", b"priority", b"ttl", b"size", b"s3fifo", b"arc", b"auto"], show(r)
    r = cli(env={"_CORTEX_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "cortex cache del"})
    assert r.returncode == 0 and b'"delete"' in r.stdout, show(r)


# ---------------------------------------------------------------- generated files


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", REPO / "scripts" / "gen_docs.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gen_docs"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gen_docs = _gen_docs()


def test_completions_and_man_page_are_not_stale():
    rendered = gen_docs.render_all()
    assert set(rendered) == {"completions/cortex.bash", "completions/_cortex", "completions/cortex.fish", "man/cortex.1"}
    stale = gen_docs.stale(rendered)
    assert not stale, f"{stale} differ from what the CLI makes now: run `python scripts/gen_docs.py` and commit them"


def test_gen_docs_check_mode_names_a_stale_file(tmp_path):
    """`gen_docs.py --check` (the CI-friendly form) fails on a changed file and passes on the committed one."""
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_docs.py"), "--check"], capture_output=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    gen_docs_copy = tmp_path / "repo"
    for rel in ("scripts/gen_docs.py", *gen_docs.OUTPUTS):
        (gen_docs_copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, gen_docs_copy / rel)
    fish = gen_docs_copy / "completions" / "cortex.fish"
    fish.write_text(fish.read_text().replace("-l policy", "-l polcy"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, str(gen_docs_copy / "scripts" / "gen_docs.py"), "--check"], capture_output=True, env=env)
    assert r.returncode == 1 and r.stderr.decode() == "stale: completions/cortex.fish (run: python scripts/gen_docs.py)\n", r


def _tree():
    """{command: [option names]} straight from the Typer/click command tree."""
    import typer

    from cortex_cache.cli import app

    root = typer.main.get_command(app)
    group = root.commands["cache"]
    out = {}
    for name, cmd in group.commands.items():
        ctx = typer.Context(cmd, info_name=name)
        opts = [o for p in cmd.params if p.param_type_name == "option" for o in (*p.opts, *p.secondary_opts)]
        out[name] = opts + list(cmd.get_help_option(ctx).opts)
    return out, [o for p in root.params for o in p.opts], [o for p in group.params for o in p.opts]


# ---------------------------------------------------------------- completions: bash

BASH_DRIVER = r"""
source completions/cortex.bash
while IFS= read -r line; do
    read -ra COMP_WORDS <<< "$line"
    words=()
    for w in "${COMP_WORDS[@]}"; do  # as readline splits at COMP_WORDBREAKS' "="
        if [[ $w == --*=* ]]; then
            words+=("${w%%=*}" "=")
            [[ -n ${w#*=} ]] && words+=("${w#*=}")
        else
            words+=("$w")
        fi
    done
    COMP_WORDS=("${words[@]}")
    [[ $line == *" " ]] && COMP_WORDS+=("")
    COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))
    COMPREPLY=()
    _cortex
    printf '%s\t' "${COMPREPLY[@]}"
    printf '\n'
done
"""


def bash_complete(lines: list[str], env: dict | None = None) -> list[list[str]]:
    r = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", BASH_DRIVER], input="\n".join(lines) + "\n", capture_output=True,
        text=True, cwd=REPO, env=dict(os.environ, **(env or {})), timeout=60,
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = [sorted(x for x in ln.split("\t") if x) for ln in r.stdout.split("\n")[:-1]]
    assert len(out) == len(lines), r.stdout
    return out


POLICIES = ["arc", "auto", "fifo", "lfu", "lru", "priority", "s3fifo", "size", "ttl"]
COMMANDS = sorted(["create", "list", "status", "delete", "put", "get", "info", "keys", "evict", "verify", "persist",
                   "restore", "resize", "snapshots", "doctor"])

# (command line as typed, the candidates offered: exactly these)
SHELL_CASES = [
    ("cortex ca", ["cache"]),
    ("cortex cache cr", ["create"]),
    ("cortex cache ", COMMANDS),
    ("cortex -q cache create x --pol", ["--policy"]),
    ("cortex cache create x --policy ", POLICIES),
    ("cortex cache create x --size 4M --policy l", ["lfu", "lru"]),
    ("cortex cache create x --tier ", ["cpu", "disk"]),
    ("cortex cache status --format ", ["json", "prometheus", "table"]),
    ("cortex cache evict p --a", ["--all"]),
    ("cortex cache verify p --re", ["--repair"]),
    ("cortex cache keys p --l", ["--limit", "--long"]),
    ("cortex cache restore p --rep", ["--replace"]),
    ("cortex cache persist p --k", ["--keep"]),
    ("cortex cache delete p --f", ["--force"]),
    ("cortex cache create x --size ", []),  # a size: nothing to offer, certainly not files
    ("cortex cache put p ", []),  # a key
]


def test_bash_completion():
    lines = [line for line, _ in SHELL_CASES]
    got = bash_complete(lines + ["cortex -", "cortex cache create x --policy=", "cortex cache get p k -o scr",
                                 "cortex cache put p k scr", "cortex cache put p -- ", "cortex cache create x -"])
    for (line, want), have in zip(SHELL_CASES, got):
        assert have == sorted(want), (line, have)
    rest = got[len(SHELL_CASES):]
    assert rest[0] == ["--debug", "--help", "--quiet", "--version", "-q"]
    assert rest[1] == POLICIES  # --policy=<TAB>
    assert rest[2] == ["scripts"] and rest[3] == ["scripts"]  # file arguments
    assert rest[4] == []  # after --, the next word is the KEY
    tree, _, _ = _tree()
    assert rest[5] == sorted(tree["create"])  # every option of create, as the parser knows them


def _pools_and_snapshots(new_pool, tmp_path) -> tuple[str, str, dict]:
    """Two pools (a, b) and snapshot files of b and of a pool that is gone; the env the shells need."""
    a, b = new_pool("alpha"), new_pool("beta")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    gone = a.rsplit("-", 1)[0] + "-gone"
    sp = os.environ["CORTEX_CACHE_SHM_PREFIX"]  # not the default: file names start with it
    for f in (f"{sp}{b}.ccsnap", f"{sp}{gone}.ccsnap", f"{sp}{gone}-20260101T010203.123456Z.ccsnap",
              f"other.{gone}x.ccsnap"):  # another deployment's snapshot: not offered
        (snaps / f).write_bytes(b"x")
    return a, b, {"CORTEX_CACHE_SNAPSHOT_DIR": str(snaps), "gone": gone}


def test_bash_completes_pool_names(new_pool, tmp_path):
    a, b, env = _pools_and_snapshots(new_pool, tmp_path)
    gone = env.pop("gone")
    stem = a.rsplit("-", 1)[0]
    got = bash_complete([f"cortex cache status {stem}", f"cortex cache evict {stem}-a", f"cortex cache create {stem}",
                         f"cortex cache restore {stem}", f"cortex cache put {a} {stem}"], env)
    assert got[0] == [a, b]
    assert got[1] == [a]
    assert got[2] == []  # create takes a new name
    assert got[3] == sorted([a, b, gone])  # pools, and pools known by their latest snapshot only
    assert got[4] == []  # the KEY is not a pool
    # Another prefix sees other pools.
    assert bash_complete([f"cortex cache status {stem}"], {"CORTEX_CACHE_SHM_PREFIX": "no-such-prefix."}) == [[]]


# ---------------------------------------------------------------- completions: zsh

ZSH_CAPTURE = r"""
# zsh -f capture.zsh COMPDIR 'command line' -> the candidates, one a line.
# A zsh in a pty with compinit and our fpath; compadd is wrapped to print what it adds.
zmodload zsh/zpty || exit 3
compdir=$1; shift
init=$TMPDIR/capture-init.zsh
cat > $init <<'INIT'
PROMPT=
RPROMPT=
autoload -Uz compinit
compinit -u -d $TMPDIR/zcompdump
bindkey '^M' undefined
bindkey '^J' undefined
bindkey '^I' complete-word
null-line () { print -rn -- $'\0\n' }
compprefuncs=( null-line )
comppostfuncs=( null-line exit )
zstyle ':completion:*' list-grouped false
zstyle ':completion:*' insert-tab false
compadd () {
  if [[ ${@[1,(i)(-|--)]} == *-(O|A|D)\ * ]]; then
    builtin compadd "$@"
    return $?
  fi
  typeset -a __hits
  builtin compadd -A __hits "$@"
  local h
  for h in $__hits; do print -r -- "HIT $h"; done
}
print -r -- READY
INIT
zpty z zsh -f -i
zpty -w z "fpath=(${(q)compdir} \$fpath); source ${(q)init}"
local line
repeat 50; do
  zpty -r z line || exit 4
  [[ $line == READY* ]] && break
done
zpty -w -n z "$*"$'\t'
integer tog=0
while zpty -r z line; do
  if [[ $line == *$'\0'* ]]; then
    (( tog++ )) && break || continue
  fi
  (( tog )) && [[ $line == *HIT\ * ]] && print -r -- ${${line#*HIT }%%[$'\r\n']#}
done
zpty -d z
"""


def zsh_complete(tmp_path: Path, line: str, env: dict | None = None) -> list[str]:
    harness = tmp_path / "capture.zsh"
    harness.write_text(ZSH_CAPTURE)
    home = tmp_path / "zhome"
    home.mkdir(exist_ok=True)
    r = subprocess.run(
        ["zsh", "-f", str(harness), str(REPO / "completions"), line], capture_output=True, text=True, timeout=60, cwd=REPO,
        env=dict(os.environ, TMPDIR=str(home), HOME=str(home), ZDOTDIR=str(home), **(env or {})),
    )
    assert r.returncode == 0, r
    return sorted(set(x for x in r.stdout.splitlines() if x))


needs_zsh = pytest.mark.skipif(shutil.which("zsh") is None, reason="zsh is not installed")
needs_fish = pytest.mark.skipif(shutil.which("fish") is None, reason="fish is not installed")


@needs_zsh
def test_zsh_completion_file_parses():
    r = subprocess.run(["zsh", "-n", str(REPO / "completions" / "_cortex")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr


@needs_zsh
@pytest.mark.parametrize("line, want", [pytest.param(*c, id=c[0]) for c in SHELL_CASES])
def test_zsh_completion(tmp_path, line, want):
    assert zsh_complete(tmp_path, line) == sorted(want)


@needs_zsh
def test_zsh_completes_files_and_pools(new_pool, tmp_path):
    a, b, env = _pools_and_snapshots(new_pool, tmp_path)
    gone = env.pop("gone")
    stem = a.rsplit("-", 1)[0]
    assert zsh_complete(tmp_path, "cortex cache get p k -o scr") == ["scripts"]
    assert zsh_complete(tmp_path, "cortex cache put p k READ") == ["README.md"]
    assert zsh_complete(tmp_path, "cortex cache create x --size ") == []
    assert zsh_complete(tmp_path, f"cortex cache status {stem}", env) == [a, b]
    assert zsh_complete(tmp_path, f"cortex cache restore {stem}", env) == sorted([a, b, gone])


# ---------------------------------------------------------------- completions: fish


def fish_complete(line: str, env: dict | None = None) -> list[str]:
    r = subprocess.run(
        ["fish", "--no-config", "-c", f"source completions/cortex.fish; complete -C {shlex_quote(line)}"],
        capture_output=True, text=True, cwd=REPO, timeout=60, env=dict(os.environ, **(env or {})),
    )
    assert r.returncode == 0 and r.stderr == "", r
    return sorted(x.split("\t")[0] for x in r.stdout.splitlines() if x)


def shlex_quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


@needs_fish
def test_fish_completion_file_parses():
    r = subprocess.run(["fish", "--no-config", "-n", str(REPO / "completions" / "cortex.fish")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == "", r.stderr


@needs_fish
def test_fish_completion(new_pool, tmp_path):
    for line, want in SHELL_CASES:
        assert fish_complete(line) == sorted(want), line
    assert fish_complete("cortex cache get p k -o scr") == ["scripts/"]
    assert fish_complete("cortex cache put p -- ") == []
    a, b, env = _pools_and_snapshots(new_pool, tmp_path)
    gone = env.pop("gone")
    stem = a.rsplit("-", 1)[0]
    assert fish_complete(f"cortex cache status {stem}", env) == [a, b]
    assert fish_complete(f"cortex cache restore {stem}", env) == sorted([a, b, gone])
    assert fish_complete(f"cortex cache create {stem}", env) == []


# ---------------------------------------------------------------- man page

MAN = REPO / "man" / "cortex.1"


def _roff_text(src: str) -> str:
    """The words of a roff source, without requests' names or font escapes."""
    out = []
    for line in src.splitlines():
        if line.startswith('.\\"'):
            continue
        if line.startswith("."):
            line = line.split(None, 1)[1] if " " in line else ""
        line = re.sub(r"\\f[BIRP]", "", line)
        line = line.replace("\\-", "-").replace("\\~", " ").replace("\\:", "").replace("\\&", "").replace("\\e", "\\").replace("\\(aq", "'")
        out.append(line.strip('"'))
    return "\n".join(out)


def _man_sections() -> dict[str, str]:
    """{section name: text} for .SH sections and {"cmd:NAME": text} for each .SS of COMMANDS."""
    src = MAN.read_text()
    parts: dict[str, str] = {}
    key = ""
    for line in src.splitlines():
        m = re.match(r'\.(SH|SS) "?([^"]*)"?$', line)
        if m:
            key = m.group(2) if m.group(1) == "SH" else f"cmd:{m.group(2)}"
            parts[key] = ""
            continue
        parts[key] = parts.get(key, "") + line + "\n"
    return {k: _roff_text(v) for k, v in parts.items()}


def test_man_page_has_the_sections():
    sections = _man_sections()
    for name in ("NAME", "SYNOPSIS", "DESCRIPTION", "OPTIONS", "COMMANDS", "SIZES", "EXIT STATUS", "ENVIRONMENT",
                 "FILES", "EXAMPLES", "SEE ALSO"):
        assert name in sections, name
    assert sections["NAME"].strip().startswith("cortex - ")


def test_man_page_names_every_command_and_option():
    tree, root_opts, group_opts = _tree()
    sections = _man_sections()
    missing = []
    for cmd, opts in tree.items():
        text = sections.get(f"cmd:{cmd}")
        if text is None:
            missing.append(f"command {cmd}")
            continue
        synopsis = [ln for ln in sections["SYNOPSIS"].splitlines() if ln.startswith(f"cache {cmd} ") or ln == f"cache {cmd}"]
        if not synopsis:
            missing.append(f"SYNOPSIS of {cmd}")
        for o in opts:
            # in the command's own section, as a word (--prefix is not --prefix-x)
            if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", text):
                missing.append(f"{cmd} {o}")
    for o in set(root_opts + group_opts) | {"--debug"}:
        if not re.search(rf"(?<![\w-]){re.escape(o)}(?![\w-])", sections["OPTIONS"]):
            missing.append(f"global {o}")
    assert not missing, f"not in man/cortex.1: {missing}"


def test_man_page_exit_codes_are_errors_py():
    from cortex_cache import errors

    codes = sorted({getattr(errors, n) for n in dir(errors) if n.startswith("EX_")})
    listed = [int(x) for x in re.findall(r"^\.B (\d+)$", MAN.read_text().split(".SH EXIT STATUS", 1)[1].split(".SH", 1)[0], re.M)]
    assert listed == codes
    # and --help says the same numbers
    r = ok(cli("--help"))
    said = " ".join(r.stdout.decode().split("Exit status:", 1)[1].split("\n\n", 1)[0].split())
    assert sorted(int(item.split()[0]) for item in said.split(";")) == codes, said


def test_man_page_shows_the_readme_examples_and_environment():
    readme = (REPO / "README.md").read_text()
    examples = _man_sections()["EXAMPLES"]
    for block in re.findall(r"```(?:cron|ini)\n(.*?)```", readme, re.S):
        for line in block.splitlines():
            if "cortex cache" in line:
                assert line.strip() in examples, line
    env = _man_sections()["ENVIRONMENT"]
    for var in sorted(set(re.findall(r"\bCORTEX_CACHE_[A-Z_]+", readme))):
        assert var in env, var


@pytest.mark.skipif(shutil.which("man") is None, reason="man (man-db) is not installed")
@pytest.mark.parametrize("width", ["80", "60"])
def test_man_page_renders_without_warnings(width):
    r = subprocess.run(["man", "--warnings", "-l", str(MAN)], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, MANWIDTH=width, MANPAGER="cat", PAGER="cat", LANG="C.UTF-8"))
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr
    text = r.stdout
    assert "CORTEX(1)" in text and "EXIT STATUS" in text
    for cmd in COMMANDS:
        assert f"cortex cache {cmd}" in text, cmd


# ---------------------------------------------------------------- README usage


def test_readme_has_a_usage_example_per_command():
    """docs/cli.md (linked from the README) has a real session for every command."""
    page = (REPO / "docs" / "cli.md").read_text()
    usage = page.split("## Usage", 1)[1].split("\n## ", 1)[0]
    for cmd in COMMANDS:
        section = usage.split(f"### {cmd}\n", 1)
        assert len(section) == 2, f"no usage subsection for {cmd}"
        body = section[1].split("\n### ", 1)[0]
        assert re.search(rf"^\$ cortex (-q )?cache {cmd}\b", body, re.M), f"no `$ cortex cache {cmd}` example under ### {cmd}"


def test_pages_with_sessions():
    pages = [p.relative_to(REPO).as_posix() for p in gen_docs.session_pages()]
    assert "README.md" in pages and "docs/cli.md" in pages, pages


@pytest.mark.parametrize("page", [p.relative_to(REPO).as_posix() for p in gen_docs.session_pages()])
def test_readme_usage_output_is_real(tmp_path, page):
    """Rerun every `$ ...` line of a page's console blocks, in order; the output must be what the page shows."""
    text = (REPO / page).read_text()
    commands = gen_docs.console_commands(text)
    shown = gen_docs.console_outputs(text)
    assert sum(map(len, commands)) >= 5
    got = gen_docs.run_console(commands, tmp_path / "work", os.environ["CORTEX_CACHE_SHM_PREFIX"] + "readme.")
    differ = []
    for cmds, want_block, got_block in zip(commands, shown, got):
        for cmd, want, have in zip(cmds, want_block, got_block):
            if gen_docs.normalize(want) != gen_docs.normalize(have):
                differ.append(f"$ {cmd}\n--- {page}\n{want}--- now\n{have}")
    assert not differ, f"{page} output is stale (python scripts/gen_docs.py --readme):\n" + "\n".join(differ)


def test_readme_normalize_keeps_what_matters():
    """The comparison above ignores times and speeds, but not counts, sizes or messages."""
    n = gen_docs.normalize
    assert n("persisted 1 entry in 0.01s (1.2GiB/s)") == n("persisted 1 entry in 3.50s (70.3KiB/s)")
    assert n("persisted 1 entry, 1.2GiB of p") != n("persisted 1 entry, 1.2MiB of p")
    assert n("created  2026-01-01 10:00:00") == n("created 2027-02-02 11:11:11")
    assert n('{"time":"2026-12-01T06:17:24.770Z","ok":true}') == n('{"time":"2027-01-01T00:00:00.000Z","ok":true}')
    assert n("llama-20261129T175048.267719Z.ccsnap") == n("llama-20270101T000000.000000Z.ccsnap")
    assert n("evicted 1 entry, 293.0KiB (300000 bytes)") != n("evicted 2 entries, 293.0KiB (300000 bytes)")
    assert n("entries 2 of 4096") != n("entries 2 of 4095")
    assert n("size 64.0MiB") != n("size 64.0KiB")
    assert n("exit 66") != n("exit 65")
