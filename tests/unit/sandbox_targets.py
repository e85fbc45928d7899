"""Sandbox targets for tests: each one misbehaves in a specific way inside the child."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def echo(payload, workdir):
    return {"payload": payload, "cwd": os.getcwd(), "uid": os.getuid()}


def environment(payload, workdir):
    return {"env": dict(os.environ)}


def affinity(payload, workdir):
    return {"cpus": sorted(os.sched_getaffinity(0))}


def raises(payload, workdir):
    raise ValueError("bad value from user code")


def exits(payload, workdir):
    sys.exit(3)


def hard_exit(payload, workdir):
    os._exit(7)


def segfault(payload, workdir):
    import ctypes

    ctypes.string_at(0)


def spin(payload, workdir):
    while True:
        pass


def sleepy(payload, workdir):
    time.sleep(600)


def chatty(payload, workdir):
    line = "x" * 1023 + "\n"
    for _ in range(1_000_000):
        sys.stdout.write(line)
    return {"done": True}


def allocate(payload, workdir):
    data = bytearray(int(payload["bytes"]))
    return {"allocated": len(data)}


def fork_many(payload, workdir):
    """Fork at most payload['n'] sleeping children; report how many forks succeeded."""
    made, error = 0, None
    for _ in range(int(payload["n"])):
        try:
            pid = os.fork()
        except OSError as exc:
            error = exc.strerror
            break
        if pid == 0:
            time.sleep(60)
            os._exit(0)
        made += 1
    return {"forked": made, "error": error}


def orphan(payload, workdir):
    """Leave a grandchild in its own session behind, then return."""
    pidfile = Path("grandchild.pid").resolve()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        pidfile.write_text(str(os.getpid()))
        time.sleep(120)
        os._exit(0)
    for _ in range(200):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.01)
    return {"grandchild": int(pidfile.read_text())}


def write_file(payload, workdir):
    Path("inside.txt").write_text("ok")
    return {"files": os.listdir(".")}


def read_path(payload, workdir):
    return {"text": Path(payload["path"]).read_bytes()[:16].hex()}


def import_fresh(payload, workdir):
    """Import a module this process has not imported; say where its bytecode came from."""
    import importlib
    import sys

    before = {m for m in sys.modules}
    module = importlib.import_module(payload["module"])
    return {
        "prefix": sys.pycache_prefix,
        "dont_write": sys.flags.dont_write_bytecode,
        "new": payload["module"] not in before,
        "cached": module.__spec__.cached,
    }


def touch(payload, workdir):
    Path(payload["path"]).write_text("ran")
    return {}


def cache_probe(payload, workdir):
    """Read what the build cache at payload['cache'] holds, then write payload['text'] into it."""
    triton = Path(payload["cache"]) / "triton"
    seen = sorted(p.read_text() for p in triton.iterdir())
    if payload["text"]:
        (triton / f"kernel-{len(seen)}").write_text(payload["text"])
    return {"seen": seen}


def leave_links(payload, workdir):
    """Leave symlinks (to payload['targets']), a FIFO and a plain file in the child's folder."""
    for i, target in enumerate(payload["targets"]):
        os.symlink(target, f"link-{i}")
    os.mkfifo("fifo")
    Path("plain.txt").write_text("ok")
    return {}


def serve_echo(payload, workdir, channel):
    """A session target: answers each request with its own content, then reports how many it saw."""
    seen = 0
    while (message := channel.receive()) is not None:
        seen += 1
        if message.get("die"):
            os._exit(9)
        if message.get("close_then_die"):  # the channel closes a moment before the process ends
            os.close(channel._reply_fd)
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGKILL)
        if message.get("forge"):  # user code writing a reply of its own, out of turn
            os.write(channel._reply_fd, b'{"forged": true, "seq": 0}\n')
        channel.reply({"echo": message["value"], "pid": os.getpid()})
    return {"requests": seen}
