"""The files a server instance leaves in the file system, and their removal (docs/design.md, "Processes and lifecycle"):
names start with the launcher's pid, so dead instances' files can be swept."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

_PREFIX = "pipeline-"
# pipeline-<pid>-..., as a socket directory or (after an optional "sem.") a ring name in /dev/shm.
_NAME = re.compile(r"^(?:sem\.)?pipeline-(\d+)-")
_SHM_DIR = "/dev/shm"


def make_ipc_dir() -> str:
    """Create this process's private socket directory (mode 0700, ``pipeline-<pid>-...``); raises ``OSError`` if it
    cannot."""
    return tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-")


def lora_adapter_file(ipc_dir: str, lora_id: int) -> str:
    """The prepared copy of LoRA adapter ``lora_id`` in the socket directory (``lora_checkpoint.save_weights``):
    io_proc writes those it loads at run time, the worker those of ``--lora-modules``."""
    return os.path.join(ipc_dir, f"lora-{lora_id}.safetensors")


def pid_alive(pid: int) -> bool:
    """True if a process ``pid`` exists (of any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_files_of(pid: int, *, only_if_dead: bool = False) -> list[str]:
    """Remove this user's socket directories and ring names left by ``pid`` (``only_if_dead``: while it runs no more);
    returns the paths removed, ignoring errors."""
    removed = []
    for base in (tempfile.gettempdir(), _SHM_DIR):
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in names:
            m = _NAME.match(name)
            if m is None or int(m.group(1)) != pid:
                continue
            path = os.path.join(base, name)
            if base != _SHM_DIR and (name.startswith("sem.") or not os.path.isdir(path)):
                continue  # in the temp directory only socket directories are ours
            if _remove_own(path, pid, only_if_dead):
                removed.append(path)
    return removed


def sweep_dead_instances() -> list[str]:
    """Remove every socket directory and ring name of this user whose launcher is gone; returns the paths removed."""
    removed = []
    owners = set()
    for base in (tempfile.gettempdir(), _SHM_DIR):
        try:
            owners.update(int(m.group(1)) for m in map(_NAME.match, os.listdir(base)) if m)
        except OSError:
            continue
    for pid in sorted(owners):
        if pid != os.getpid() and not pid_alive(pid):
            removed += remove_files_of(pid, only_if_dead=True)
    return removed


def _remove_own(path: str, pid: int, only_if_dead: bool) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if st.st_uid != os.getuid() or (only_if_dead and pid_alive(pid)):
        return False
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)  # on Linux, the same as shm_unlink / sem_unlink of the name
    except OSError:
        return False
    return True
