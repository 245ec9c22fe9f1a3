"""`cortex cache doctor`: what is wrong with this host's set-up, each finding with what to do.

Every check returns findings: {"check", "ok", "message", "fix"} ("fix" is
what to do, empty when all is well).  Nothing here changes anything; the
checks only read /proc, /dev/shm, the pools' headers and the directories
the pools use, and ping a remote server with a short timeout.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path
from typing import Any, Callable

from . import segment
from .errors import CortexCacheError
from .units import format_size

Finding = dict[str, Any]
CRON_PATH = "/usr/bin:/bin"  # what cron gives a job (and systemd, near enough)


def _finding(check: str, ok: bool, message: str, fix: str = "") -> Finding:
    return {"check": check, "ok": ok, "message": message, "fix": "" if ok else fix}


def _warning(check: str, message: str, fix: str) -> Finding:
    """Something to know that is not wrong (doctor still exits 0): shown as `warn`, with what to do."""
    return {"check": check, "ok": True, "warning": True, "message": message, "fix": fix}


def _pools() -> list[tuple[str, dict[str, Any] | None, str | None]]:
    """(name, configuration and stats, or None and why) of every pool under the prefix."""
    from .admin import listed_names, open_listed

    out = []
    for name in listed_names():
        try:
            with open_listed(name) as p:
                out.append((name, {"config": p.configuration(), "stats": p.stats()}, None))
        except CortexCacheError as e:
            out.append((name, None, str(e)))
    return out


def check_shm(pools) -> list[Finding]:
    if not os.path.isdir(segment.SHM_DIR):
        return [_finding("shm", False, f"{segment.SHM_DIR} does not exist",
                         "mount a tmpfs there: mount -t tmpfs -o size=50% tmpfs /dev/shm")]
    st = os.statvfs(segment.SHM_DIR)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    used_by_pools = sum(info["stats"]["segment_bytes"] for _, info, _ in pools if info)
    out = [_finding("shm", used_by_pools <= total,
                    f"{segment.SHM_DIR}: {format_size(total)}, {format_size(free)} free; this prefix's pools take "
                    f"{format_size(used_by_pools)}",
                    "make /dev/shm larger (mount -o remount,size=... /dev/shm) or the pools smaller")]
    huge = _mount_option(segment.SHM_DIR, "huge")
    out.append(_finding("shm-huge-pages", True, f"{segment.SHM_DIR} huge pages: {huge or 'never (the default)'}"))
    for name, info, why in pools:
        if info is None:
            out.append(_finding("pool", False, f"pool {name}: {why}",
                                f"`cortex cache verify {name} --repair`, or delete it: `cortex cache delete {name}`"))
    return out


def _mount_option(mountpoint: str, key: str) -> str | None:
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 4 and parts[1] == mountpoint:
                    for opt in parts[3].split(","):
                        k, _, v = opt.partition("=")
                        if k == key:
                            return v
    except OSError:
        pass
    return None


def check_directory(what: str, path: Path, need: int) -> list[Finding]:
    """A directory we write to: there (or its parent can make it), ours, private, room for `need` bytes."""
    check = f"{what}-dir"
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.stat(probe)
    except OSError as e:
        return [_finding(check, False, f"{what} directory {path}: {e.strerror}", f"create it: mkdir -p {path}")]
    out = []
    if probe != path:
        ok = os.access(probe, os.W_OK | os.X_OK)
        out.append(_finding(check, ok, f"{what} directory {path} does not exist yet" + ("" if ok else f"; {probe} is not writable"),
                            f"create it as the user that runs the pools: mkdir -p -m 700 {path}"))
    else:
        mine = st.st_uid == os.geteuid()
        out.append(_finding(check, mine, f"{what} directory {path}: owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}",
                            f"it must belong to the user that runs the pools: chown {os.geteuid()} {path}"))
        if st.st_mode & 0o022:
            out.append(_finding(check, False, f"{what} directory {path} is writable by others",
                                f"chmod go-w {path} (it holds users' prompts)"))
    free = shutil.disk_usage(probe).free
    out.append(_finding(f"{check}-space", free >= need,
                        f"{what} directory {path}: {format_size(free)} free, {format_size(need)} needed",
                        "free space there, or point it elsewhere"))
    return out


def check_snapshots(pools) -> list[Finding]:
    from .persist import snapshot_dir
    from .snapshot import SPACE_BOUND, snapshot_space

    need = sum(info["stats"]["value_bytes"] for _, info, _ in pools if info)
    out = check_directory("snapshot", snapshot_dir(), need)
    # Incremental snapshots share packs; compaction keeps what they take within SPACE_BOUND of what the kept
    # snapshots need (the one ratio `snapshots` prints too).
    over = []
    for name, _, _ in pools:
        try:
            space = snapshot_space(name)
        except (OSError, CortexCacheError):
            continue
        # (A few KiB of pack headers over: a tiny pool's snapshots are not bloated.)
        if space["waste_ratio"] is not None and space["total_bytes"] > SPACE_BOUND * space["needed_bytes"] + (64 << 10):
            over.append((name, space))
    out.append(_finding(
        "snapshot-space", not over,
        f"snapshots take at most {SPACE_BOUND}x what the kept snapshots need" if not over else
        "; ".join(f"snapshots of {n} take {format_size(sp['total_bytes'])}, {sp['waste_ratio']:.2f}x what the kept "
                  f"snapshots need (at most {SPACE_BOUND}x after a persist)" for n, sp in over),
        "; ".join(f"`cortex cache persist {n}`: it deletes what no snapshot needs and compacts the rest (a pack "
                  f"it cannot read stays until the snapshots naming it age out; `persist {n} --full` shares "
                  "nothing with them)" for n, _ in over)))
    return out


def check_fills(pools) -> list[Finding]:
    """Pools restored from a snapshot whose fill (fill.py) was interrupted or failed: they serve part of it."""
    out = []
    for name, info, _ in pools:
        fill = info["stats"].get("fill") if info else None
        if not fill or fill["state"] not in ("interrupted", "failed"):
            continue
        pct = 100.0 * fill["bytes_loaded"] / fill["bytes_total"] if fill["bytes_total"] else 100.0
        if fill["state"] == "interrupted":  # a killed filler; persist refuses (75) until it is finished
            out.append(_finding("fill", False, f"pool {name}: its fill from {fill['snapshot']} was interrupted at "
                                f"{pct:.0f}% (persist refuses until it is finished)",
                                f"`cortex cache restore {name} --if-missing` finishes it"))
        else:
            damaged = f"{fill['corrupt']} damaged values left out" if fill["corrupt"] else "the snapshot became unreadable"
            out.append(_finding("fill", False, f"pool {name}: its fill from {fill['snapshot']} failed at {pct:.0f}% "
                                f"({damaged}); it serves what was loaded",
                                f"check the snapshot's disk; `cortex cache persist {name} --full` writes a snapshot "
                                "that shares nothing with the damaged one"))
    return out


def check_disk_tiers(pools) -> list[Finding]:
    out = []
    for name, info, _ in pools:
        disk = info and info["config"]["disk"]
        if not disk:
            continue
        d = info["stats"]["disk"]
        if d is not None and not d["available"]:
            out.append(_finding("disk-tier", False, f"pool {name}: disk tier {disk['path']} unavailable: {d.get('error')}",
                                f"restore the directory, or recreate the pool: `cortex cache delete {name} --force`"))
            continue
        out.extend(check_directory(f"disk-tier({name})", Path(disk["path"]), 0))
    return out


def check_remotes(pools, ping: Callable[[str, bool], str | None] | None = None) -> list[Finding]:
    from .remote import redact, redis_missing

    out = []
    for name, info, _ in pools:
        remote = info and info["config"]["remote"]
        if not remote:
            continue
        why = redis_missing()
        if why:
            out.append(_finding("remote", False, f"pool {name}: {why}", "pip install 'cortex-cache[remote]'"))
            continue
        err = (ping or _ping)(remote["url"], remote["cluster"])
        out.append(_finding("remote", err is None, f"pool {name}: remote {redact(remote['url'])} "
                            + ("answers" if err is None else f"does not answer: {err}"),
                            "start the server, or check the URL and the network"))
    return out


def _ping(url: str, cluster: bool) -> str | None:
    try:
        import redis
        from redis.cluster import RedisCluster

        kw = {"socket_timeout": 2, "socket_connect_timeout": 2}
        client = RedisCluster.from_url(url, **kw) if cluster else redis.Redis.from_url(url, **kw)
        try:
            client.ping()
        finally:
            client.close()
        return None
    except Exception as e:  # any failure is the finding
        return f"{type(e).__name__}: {e}"


def check_staging() -> list[Finding]:
    from .persist import STAGING_PREFIX

    if not os.path.isdir(segment.SHM_DIR):
        return []
    staging = [e for e in segment.scan() if e.name.startswith(STAGING_PREFIX)]
    attached = segment.attached_map() if staging else {}
    left = [e.name for e in staging if e.ours and not attached.get(e.name)]
    # Another user's are not ours to remove (anyone can plant such a name), so they are no finding here.
    others = sum(1 for e in staging if not e.ours)
    aside = f" ({others} of other users left alone)" if others else ""
    return [_finding("staging", not left,
                     f"{len(left)} leftover restore staging segment(s)" + (f": {', '.join(left)}" if left else "") + aside,
                     "the next restore removes them (at once when the restore that made one is gone, "
                     "else after a minute); or `cortex cache delete NAME` each")]


PERSIST_TMP_STALE_AFTER = 60.0  # seconds without a write: a persist writes its temp file as it goes


def check_leftovers() -> list[Finding]:
    """What killed commands left (SIGKILL, a power cut: SIGINT and SIGTERM clean up as they go) and the
    command that sweeps each: restore --replace's temp tier directories, persist's temp files, disk tiers
    of pools whose segment is gone."""
    import time

    from .admin import orphaned_tier
    from .persist import snapshot_dir
    from .restore import stale_tmp_dirs
    from .snapshot import TEMP_RE

    out = []
    dirs = stale_tmp_dirs()
    out.append(_finding("restore-tmp", not dirs,
                        f"{len(dirs)} temp tier director(y/ies) of killed restores" + (f": {', '.join(dirs)}" if dirs else ""),
                        "the next `cortex cache restore NAME --replace` removes them; or rm -r each"))
    temps: list[tuple[str, str]] = []  # (file, pool)
    now = time.time()
    try:
        with os.scandir(snapshot_dir()) as it:
            for e in it:
                m = TEMP_RE.match(e.name)
                if not m:
                    continue
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if st.st_uid == os.geteuid() and now - st.st_mtime >= PERSIST_TMP_STALE_AFTER:
                    temps.append((e.name, _pool_of(m.group("stem"))))
    except OSError:
        pass
    pools = sorted({p for _, p in temps})
    out.append(_finding("persist-tmp", not temps,
                        f"{len(temps)} temp file(s) of killed persists in {snapshot_dir()}"
                        + (f": {', '.join(n for n, _ in temps)}" if temps else ""),
                        "the next persist of the pool removes them: "
                        + "; ".join(f"`cortex cache persist {p}`" for p in pools)))
    orphans = []
    try:
        from .persist import namespaced
        from .pool import default_disk_path

        top = os.path.dirname(default_disk_path("x"))
        stem = namespaced("")  # what the names are namespaced by ("" under the default prefix)
        with os.scandir(top) as it:
            for e in it:
                name = e.name[len(stem):] if e.name.startswith(stem) else ""
                try:
                    segment.validate_name(name)
                except CortexCacheError:
                    continue
                if orphaned_tier(name):
                    orphans.append(name)
    except (OSError, CortexCacheError):
        pass
    out.append(_finding("orphaned-tier", not orphans,
                        f"{len(orphans)} disk tier(s) at the default place whose pool is gone"
                        + (f": {', '.join(orphans)}" if orphans else ""),
                        "; ".join(f"`cortex cache delete {n} --force`" for n in orphans)))
    return out


def _pool_of(stem: str) -> str:
    """The pool name in a snapshot file's stem (namespaced by the prefix, as persist.namespaced makes it)."""
    from .persist import namespaced

    p = namespaced("")
    return stem[len(p):] if p and stem.startswith(p) else stem


def check_cron_cortex(running: str | None = None) -> list[Finding]:
    """Which `cortex` a cron job (PATH=/usr/bin:/bin) would run, against the one running now."""
    found = shutil.which("cortex", path=CRON_PATH)
    here = running or shutil.which("cortex") or ""
    if found is None:
        # Not wrong: the recipes (docs/operating.md) name `cortex` by its absolute path, as they should.
        return [_warning("cron-cortex", f"a cron job (PATH={CRON_PATH}) finds no `cortex` by name",
                         f"name it by its absolute path in crontab and units: {here or 'see `command -v cortex`'}")]
    same = bool(here) and os.path.realpath(found) == os.path.realpath(here)
    return [_finding("cron-cortex", same or not here, f"a cron job runs {found}" + ("" if same or not here else f", not {here}"),
                     f"use the absolute path {here} in crontab and units")]


def diagnose(running: str | None = None, ping: Callable[[str, bool], str | None] | None = None) -> list[Finding]:
    """Every check's findings, in a stable order."""
    pools = _pools() if os.path.isdir(segment.SHM_DIR) else []
    return (check_shm(pools) + check_snapshots(pools) + check_fills(pools) + check_disk_tiers(pools) + check_remotes(pools, ping)
            + check_staging() + check_leftovers() + check_cron_cortex(running))


__all__ = ["diagnose", "Finding"]
