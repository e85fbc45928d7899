"""One bytecode cache for every sandboxed child, filled once per machine by a trusted process.

Each sandboxed child is a fresh interpreter that imports torch (and often Triton, dynamo and
inductor). Where the installed packages carry no bytecode (an environment installed without
compiling it), every child would compile about 1600 modules of torch from source, seconds each time
(a measurement, see docs/benchmarks.md). Children may not write bytecode
(``PYTHONDONTWRITEBYTECODE``: a candidate must not leave code for the next child to run), so the
cost would come back in every child, about ten per run.

:func:`child_prefix` returns a cache tree (``PYTHONPYCACHEPREFIX``) after filling it once: a
trusted child, with bytecode writes on, imports what the sandboxed children import. The children
then read it and still write nothing. The tree belongs to the parent's user and is not writable by
others, so a child that runs as the sandbox user cannot change it; a tree that another user could
write is not used. A marker per environment records the interpreter and package versions its files
were filled for; Python checks each cached file against its source's size and modification time
anyway.

``KERNELCREW_BYTECODE_CACHE`` decides: ``auto`` (the default) uses the tree only where torch was
installed without bytecode, since a tree is slower than the installer's own files for any module it
lacks; ``always``; ``off``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import stat
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from kernelcrew.config import Settings, get_settings

#: What the sandboxed children import (the harness, timing and profiling children, the compilers).
WARM_MODULES = (
    "torch",
    "numpy",
    "triton",
    "triton.language",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "kernelcrew.tools.sandbox",
    "kernelcrew.tools.harness",
    "kernelcrew.tools.timing",
    "kernelcrew.tools.anticheat",
    "kernelcrew.tools.ncu",
)
#: torch's modules whose bytecode says whether the install compiled it (any missing: use the tree).
PROBES = (
    "__init__.py",
    "_tensor.py",
    "nn/modules/module.py",
    "_dynamo/__init__.py",
    "_inductor/compile_fx.py",
)
WARM_TIMEOUT_S = 600.0
_WARM_SCRIPT = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:  # a package this machine lacks (triton on some CPUs) warms nothing
        pass
"""

_ready: dict[Path, Path | None] = {}


def reachable_by_others(path: Path) -> bool:
    """Whether every existing ancestor of ``path`` lets other users through (o+x)."""
    for parent in [path, *path.parents]:
        if parent.exists() and not parent.stat().st_mode & stat.S_IXOTH:
            return False
    return True


def cache_root(settings: Settings | None = None) -> Path:
    """``<cache_dir>/pycache/<interpreter tag>``, or one under the system temp dir when run as root
    and the sandbox user could not reach the configured one (a cache under ``/root`` is private)."""
    base = (settings or get_settings()).cache_dir.expanduser() / "pycache"
    if os.geteuid() == 0 and not reachable_by_others(base):
        base = Path(tempfile.gettempdir()) / "kernelcrew-pycache"
    return base / sys.implementation.cache_tag


def stamp() -> dict[str, str]:
    """The interpreter, environment and package versions a filled tree is good for (environments
    share a tree, each warms its own files)."""
    import kernelcrew

    versions = {"python": sys.version, "executable": sys.executable, "prefix": sys.prefix}
    versions["source"] = str(Path(kernelcrew.__file__).resolve().parent)
    for package in ("torch", "triton", "numpy", "kernelcrew"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = ""
    return versions


def _owned_and_closed(path: Path) -> bool:
    """A folder of ours that nobody else may write."""
    try:
        info = path.lstat()
    except OSError:
        return False
    return (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.geteuid()
        and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    )


def wanted(settings: Settings | None = None) -> bool:
    """Whether to use the tree: ``always``, ``off``, or (``auto``) where torch was installed without
    its bytecode. Where it has it, a tree would only be slower for any module it lacks."""
    mode = (settings or get_settings()).bytecode_cache
    if mode != "auto":
        return mode == "always"
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return False
    package = Path(spec.origin).parent
    saved = sys.pycache_prefix
    sys.pycache_prefix = None  # where the installer would have put them
    try:
        own = [importlib.util.cache_from_source(str(package / name)) for name in PROBES]
    finally:
        sys.pycache_prefix = saved
    return not all(os.path.exists(path) for path in own)


def _usable(root: Path) -> bool:
    """The tree exists (made if not) and only this user may write it and its parent."""
    try:
        for folder in (root.parent, root):
            folder.mkdir(mode=0o755, exist_ok=True)
    except OSError:
        return False
    return _owned_and_closed(root.parent) and _owned_and_closed(root)


def use_in_this_process(settings: Settings | None = None) -> Path | None:
    """Read and write this trusted process's bytecode in the children's tree (the command line
    calls it before its heavy imports: the parent imports torch too); not where the user chose a
    prefix or turned bytecode writes off, nor where the tree is not usable."""
    if sys.pycache_prefix is not None or sys.flags.dont_write_bytecode or not wanted(settings):
        return None
    root = cache_root(settings)
    if not _usable(root):
        return None
    sys.pycache_prefix = str(root)
    return root


def child_prefix(settings: Settings | None = None) -> Path | None:
    """The bytecode cache for sandboxed children, filled if it is not yet; None where none is usable
    (it could not be made, or another user could write it). Filled once per process and machine."""
    if not wanted(settings):
        return None
    root = cache_root(settings)
    if root in _ready:
        return _ready[root]
    prefix: Path | None = None
    try:
        if _usable(root):
            want = stamp()
            digest = hashlib.sha256(f"{want['executable']}\0{want['source']}".encode()).hexdigest()[:16]
            marker = root / f"stamp-{digest}.json"
            if not marker.exists() or json.loads(marker.read_text()) != want:
                env = {**os.environ, "PYTHONPYCACHEPREFIX": str(root)}
                env.pop("PYTHONDONTWRITEBYTECODE", None)
                subprocess.run(
                    [sys.executable, "-c", _WARM_SCRIPT, *WARM_MODULES],
                    env=env,
                    cwd="/",
                    capture_output=True,
                    timeout=WARM_TIMEOUT_S,
                    check=False,
                )
                marker.write_text(json.dumps(want))
            prefix = root
    except (OSError, ValueError, subprocess.SubprocessError):
        prefix = None
    _ready[root] = prefix
    return prefix


__all__ = [
    "WARM_MODULES",
    "cache_root",
    "child_prefix",
    "reachable_by_others",
    "stamp",
    "use_in_this_process",
    "wanted",
]
