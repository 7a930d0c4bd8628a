"""A FileOps that records: real file operations, plus a model of what a power cut would keep of
each file (its content at the last fsync; its directory entry once created before or fsynced since;
an unlinked file whose unlink is not durable yet), and a state callback before and after each.

Used by the crash-state enumeration (reliability_crash.py), which takes a state at each callback.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ...store import FileOps


@dataclass
class FileModel:
    durable: bytes      # content at the last fsync (b"" if never synced)
    entry: bool         # the directory entry survived a power cut (created before, or a dir fsync since)


class RecordingFS(FileOps):
    """Real file operations, plus a model of what is durable and a state callback around each."""

    def __init__(self, on_state) -> None:
        self.on_state = on_state
        self.fd_path: dict[int, str] = {}
        self.model: dict[str, FileModel] = {}
        self.ghosts: dict[str, bytes] = {}     # unlinked, but the unlink is not durable yet
        self.ops = 0

    def _around(self, label: str, fn):
        self.on_state(f"before {label}")
        out = fn()
        self.ops += 1
        self.on_state(f"after {label}")
        return out

    def open(self, path, flags, mode=0o600):
        def do():
            existed = os.path.exists(path)
            fd = FileOps.open(self, path, flags, mode)
            self.fd_path[fd] = path
            if not existed:
                self.model[path] = FileModel(b"", False)
            elif path not in self.model:
                self.model[path] = FileModel(Path(path).read_bytes(), True)
            return fd
        return self._around(f"open {Path(path).name}", do)

    def write(self, fd, data):
        return self._around(f"write {len(data)} B to {Path(self.fd_path.get(fd, '?')).name}",
                            lambda: FileOps.write(self, fd, data))

    def fsync(self, fd):
        def do():
            FileOps.fsync(self, fd)
            path = self.fd_path.get(fd)
            if path in self.model:
                self.model[path].durable = Path(path).read_bytes()
        return self._around(f"fsync {Path(self.fd_path.get(fd, '?')).name}", do)

    def fsync_dir(self, path):
        def do():
            FileOps.fsync_dir(self, path)
            for p, m in self.model.items():
                if os.path.dirname(p) == str(path).rstrip("/"):
                    m.entry = True
            for p in [g for g in self.ghosts if os.path.dirname(g) == str(path).rstrip("/")]:
                del self.ghosts[p]
        return self._around("fsync_dir", do)

    def truncate(self, fd, length):
        return self._around(f"truncate {Path(self.fd_path.get(fd, '?')).name} to {length}",
                            lambda: FileOps.truncate(self, fd, length))

    def unlink(self, path):
        def do():
            FileOps.unlink(self, path)
            m = self.model.pop(path, None)
            if m is not None and m.entry:
                self.ghosts[path] = m.durable
        return self._around(f"unlink {Path(path).name}", do)

    def close(self, fd):
        def do():
            FileOps.close(self, fd)
            self.fd_path.pop(fd, None)
        return self._around("close", do)
