#!/usr/bin/env python
"""Startup time of the `cortex` command, beside the interpreter's own.

Runs the installed entry point (`cortex` next to this Python, else on PATH)
as a shell would, N times each, interleaved so that noise hits every case
alike, and prints the median wall time of:

    python -c pass              the floor: starting the interpreter
    python -c "import typer"    the floor of any Typer CLI
    cortex --help
    cortex cache --help
    cortex cache create --help
    python -m cortex_cache --help
    cortex cache list           a real command (loads numpy), for contrast

and, from `python -X importtime`, whether `cortex --help` loaded numpy or
torch (it must not: docs/design.md, "Layers"; exit 1 if it did), how many modules it
imported, and whether pydantic came in (Typer's value coercion does that for
every command below the top level: most of the gap between `cortex --help`
and `cortex cache --help`).

Usage:  python benchmarks/bench_startup.py [--rounds N] [--quick] [--json PATH]

Machines are noisy: compare the ratios to `python -c pass` within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def entry_point() -> list[str]:
    """The installed `cortex` script: beside this interpreter (a venv), else on PATH."""
    here = Path(sys.executable).parent / "cortex"
    if here.exists():
        return [str(here)]
    found = shutil.which("cortex")
    if found:
        return [found]
    sys.exit("bench_startup: no `cortex` entry point installed (pip install -e .)")


def cases(cortex: list[str]) -> list[tuple[str, list[str]]]:
    py = sys.executable
    return [
        ("python -c pass", [py, "-c", "pass"]),
        ("python -c 'import typer'", [py, "-c", "import typer"]),
        ("cortex --help", [*cortex, "--help"]),
        ("cortex cache --help", [*cortex, "cache", "--help"]),
        ("cortex cache create --help", [*cortex, "cache", "create", "--help"]),
        ("python -m cortex_cache --help", [py, "-m", "cortex_cache", "--help"]),
        ("cortex cache list", [*cortex, "cache", "list"]),
    ]


def run_once(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"bench_startup: {argv} exited {r.returncode}: {r.stderr.decode()[-500:]}")
    return dt


def imports_of(cortex: list[str], args: list[str], env: dict) -> list[str]:
    """Modules imported by `cortex ARGS` (the entry point run under -X importtime)."""
    script = cortex[0]
    with open(script, "rb") as f:
        is_python = f.read(2) == b"#!" and b"python" in f.readline()
    argv = [sys.executable, "-X", "importtime", script, *args] if is_python else [
        sys.executable, "-X", "importtime", "-c", "import sys; from cortex_cache.cli import run; sys.argv[0] = 'cortex'; run()", *args
    ]
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=REPO)
    mods = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)", r.stderr.decode(), re.M)
    return mods


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10, help="runs of each command (default 10; median reported)")
    ap.add_argument("--quick", action="store_true", help="5 rounds")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = ap.parse_args(argv)
    rounds = 5 if args.quick else args.rounds

    # A private prefix: `cortex cache list` sees no one's pools and touches nothing.
    env = dict(os.environ, CORTEX_CACHE_SHM_PREFIX=f"ccbench-{os.getpid()}.", NO_COLOR="1")
    env.pop("CORTEX_CACHE_DEBUG", None)
    cortex = entry_point()
    todo = cases(cortex)
    times: dict[str, list[float]] = {name: [] for name, _ in todo}
    for _, cmd in todo:  # warm the page cache and .pyc files; not counted
        run_once(cmd, env)
    for _ in range(rounds):
        for name, cmd in todo:
            times[name].append(run_once(cmd, env))

    base = statistics.median(times["python -c pass"])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({
            "command": name,
            "median_ms": round(med * 1e3, 1),
            "min_ms": round(min(ts) * 1e3, 1),
            "max_ms": round(max(ts) * 1e3, 1),
            "over_python_ms": round((med - base) * 1e3, 1),
            "x_python": round(med / base, 2),
        })

    help_mods = imports_of(cortex, ["--help"], env)
    cache_help_mods = imports_of(cortex, ["cache", "--help"], env)
    heavy = ("numpy", "torch")
    checks = {
        "cortex --help modules": len(help_mods),
        "cortex --help loads numpy": "numpy" in help_mods,
        "cortex --help loads torch": "torch" in help_mods,
        "cortex cache --help loads numpy or torch": any(m in cache_help_mods for m in heavy),
    }
    # Not a failure, a fact worth knowing: Typer >= 0.2x coerces parameter values
    # with pydantic, so every command below the top level pays for importing it.
    info = {
        "cortex --help loads pydantic": "pydantic" in help_mods,
        "cortex cache --help loads pydantic": "pydantic" in cache_help_mods,
    }

    print(f"cortex startup: {platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs, "
          f"entry point {cortex[0]}, median of {rounds} runs")
    w = max(len(r["command"]) for r in rows)
    print(f"{'command':<{w}}  {'median ms':>9}  {'min':>7}  {'max':>7}  {'+python':>8}  {'x python':>8}")
    for r in rows:
        print(f"{r['command']:<{w}}  {r['median_ms']:>9.1f}  {r['min_ms']:>7.1f}  {r['max_ms']:>7.1f}  "
              f"{r['over_python_ms']:>8.1f}  {r['x_python']:>8.2f}")
    for k, v in {**checks, **info}.items():
        print(f"{k}: {('yes' if v else 'no') if isinstance(v, bool) else v}")

    ok = not any(v for k, v in checks.items() if isinstance(v, bool))
    if args.json:
        doc = {
            "benchmark": "startup",
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "entry_point": cortex[0],
            "rounds": rounds,
            "rows": rows,
            "checks": checks,
            "info": info,
            "ok": ok,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if not ok:
        print("FAIL: `cortex --help` must not import numpy or torch", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
