"""Directories moved between the driver and Ray nodes through Ray's object store, for clusters
whose nodes share no filesystem.

- Driver -> nodes (the model, a checkpoint to resume from): `DirectoryShipment.from_path` puts
  each file in chunks of at most `chunk_bytes` (a multi-GB model is never one object, and the
  reader holds one chunk at a time) and records a manifest: every file's relative path, size
  and sha256, and a fingerprint of the whole. The shipment itself is small (ObjectRefs and the
  manifest) and goes to actors as an argument. On a node, `materialize` writes an exact copy
  once per node into a node-local cache (or into a directory the caller names), verified
  against the manifest and renamed into place whole.
- Nodes -> driver (checkpoints): `collect_directory` on the node, `write_into` on the driver,
  which merges several shipments (one per trainer rank) into the caller's temporary directory
  and leaves the atomic rename to the caller (`checkpoints.write`).
- `shared=True`: the caller says the path is on a filesystem every node sees; nothing is
  shipped and `materialize` returns the path itself.

Ray frees an object when its owner dies: the process that made a shipment must outlive every
`materialize` / `write_into` of it (the driver does; a trainer rank is alive until the driver
has written its checkpoint files).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

from ..errors import EddyError

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 64 << 20
CACHE_ENV = "EDDY_NODE_CACHE"


class NodeFilesError(EddyError, RuntimeError):
    """A directory cannot be shipped, or its copy does not match what was shipped; the
    message names the file."""


@dataclass(frozen=True)
class ShippedFile:
    path: str  # relative to the shipped directory, '/'-separated
    size: int
    sha256: str
    chunks: tuple[Any, ...] = ()  # ObjectRefs of its bytes in order (numpy uint8 arrays)


@dataclass(frozen=True)
class DirectoryShipment:
    source: str  # the directory it was made from, on `origin`
    origin: str  # the node (IP) that made it, for errors
    files: tuple[ShippedFile, ...]
    directories: tuple[str, ...]  # every subdirectory, so empty ones are copied too
    fingerprint: str  # sha256 over the manifest: the cache's name for this content
    shared: bool = False

    @classmethod
    def from_path(cls, path: str | os.PathLike, chunk_bytes: int = DEFAULT_CHUNK_BYTES, *,
                  shared: bool = False) -> DirectoryShipment:
        """Ship the directory at `path` (regular files and directories; a symlink is shipped
        as the file it points to, if that is inside `path`). `shared=True`: every node sees
        `path` itself; nothing is shipped."""
        if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be a positive integer, got {chunk_bytes!r}")
        if not Path(path).expanduser().is_dir():
            raise NodeFilesError(f"cannot ship {path}: not a directory")
        if shared:  # as given, links unresolved: a node may mount the same path differently
            where = str(Path(path).expanduser().absolute())
            return cls(source=where, origin=_node_ip(), files=(), directories=(),
                       fingerprint=_fingerprint((), [("shared", 0, where)]), shared=True)
        root = Path(path).expanduser().resolve()
        directories, sources = _walk(root)  # everything refused before anything is put
        files = tuple(_put_file(rel, file, chunk_bytes) for rel, file in sources)
        return cls(source=str(root), origin=_node_ip(), files=files,
                   directories=tuple(directories),
                   fingerprint=_fingerprint(directories,
                                            [(f.path, f.size, f.sha256) for f in files]))

    @property
    def local_source(self) -> str | None:
        """The path every node reads directly when it was declared shared; else None."""
        return self.source if self.shared else None

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def manifest(self) -> list[dict]:
        return [{"path": f.path, "bytes": f.size, "sha256": f.sha256} for f in self.files]

    def __repr__(self) -> str:  # not every ObjectRef
        return (f"DirectoryShipment({self.source!r} from {self.origin}: {len(self.files)} "
                f"files, {self.total_bytes} bytes, {self.fingerprint[:12]}"
                f"{', shared' if self.shared else ''})")

    # ---- on a node -------------------------------------------------------------------------

    def materialize(self, cache_root: str | os.PathLike | None = None, *,
                    into: str | os.PathLike | None = None) -> str:
        """A local directory holding an exact copy; written once per node however many
        processes ask at once. Default: `<cache_root>/<fingerprint>` (cache_root: the
        argument, else $EDDY_NODE_CACHE, else `<tmp>/eddy-node-cache`). `into`: exactly
        there instead (absent or empty; for a checkpoint, read once). Shared: the path
        itself."""
        if self.shared:
            if not os.path.isdir(self.source):
                raise NodeFilesError(f"{self.source} was declared shared but not present on "
                                     f"this node {_node_ip()}")
            return self.source
        if into is not None:
            final, ours = Path(into).expanduser().absolute(), False
        else:
            root = Path(cache_root or os.environ.get(CACHE_ENV)
                        or Path(tempfile.gettempdir()) / "eddy-node-cache")
            final, ours = _private_dir(root.expanduser().absolute()) / self.fingerprint, True
        if self._problem_at(final) is None:  # finished before: it only appears by a rename
            return str(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        with _locked(lock_path(final)):
            problem = self._problem_at(final)  # another process may have just finished it
            if problem is None:
                return str(final)
            if final.exists() and not _is_empty_dir(final):
                if not ours:  # the caller's directory: never delete what this did not write
                    raise NodeFilesError(f"cannot materialize {self!r} into {final}: it "
                                         f"already holds other files ({problem}); give an "
                                         "absent or empty directory")
                # Eddy's own cache, and the right bytes are in hand: writing it again costs
                # one transfer, where refusing would stop a run over a cache file
                log.warning("node cache %s is damaged (%s); writing it again", final, problem)
                _discard(final)
            partial = final.with_name(f".{final.name}.partial")
            _discard(partial)  # what a killed writer left: only a lock holder writes there
            try:
                partial.mkdir()
                self._write_files(partial)
                os.rename(partial, final)  # also replaces an empty `into`
            except BaseException:
                _discard(partial)
                raise
            _fsync_dir(final.parent)
        log.info("materialized %r into %s", self, final)
        return str(final)

    # ---- on the driver ---------------------------------------------------------------------

    def write_into(self, target_dir: str | os.PathLike) -> None:
        """Write the files into `target_dir` (created if absent), verified and fsynced, beside
        what is there already: several shipments merge into one directory. A file already
        there with other content is refused before anything is written. Nothing is renamed:
        the caller renames its temporary directory into place."""
        if self.shared:
            raise NodeFilesError(f"{self!r} was declared shared: it carries no files to write")
        target = Path(target_dir)
        target.mkdir(parents=True, exist_ok=True)
        present = set()
        for rel in map(_safe_relative, self.directories):
            if (target / rel).exists() and not (target / rel).is_dir():
                raise NodeFilesError(f"cannot write {rel}/ from {self.origin} into {target}: "
                                     f"{target / rel} is a file there")
        for shipped in self.files:
            there = target / _safe_relative(shipped.path)
            if there.exists():
                if (there.is_file() and there.stat().st_size == shipped.size
                        and _sha256(there) == shipped.sha256):
                    present.add(shipped.path)  # the same file from another rank
                    continue
                raise NodeFilesError(f"two shipments carry {shipped.path} with different "
                                     f"content: {there} is already there, and the one from "
                                     f"{self.origin} ({self.source}) differs (sha256 "
                                     f"{shipped.sha256})")
        self._write_files(target, skip=present)

    # ---- both ------------------------------------------------------------------------------

    def _problem_at(self, final: Path) -> str | None:
        """What is wrong with `final` as a copy of this shipment, or None. Sizes only: every
        byte was checked against its sha256 when written, and hashing a multi-GB model again
        on every start would cost more than the transfer saved."""
        if not final.is_dir():
            return f"{final} is absent" if not final.exists() else f"{final} is not a directory"
        for shipped in self.files:
            file = final / shipped.path
            if not file.is_file():
                return f"{file} is missing"
            if (size := file.stat().st_size) != shipped.size:
                return f"{file} is {size} bytes, the manifest says {shipped.size}"
        return None

    def _write_files(self, target: Path, skip: set[str] = frozenset()) -> None:
        made = []
        for rel in self.directories:
            (target / _safe_relative(rel)).mkdir(parents=True, exist_ok=True)
            made.append(target / rel)
        for shipped in self.files:
            if shipped.path not in skip:
                self._write_file(shipped, target / _safe_relative(shipped.path))
        for directory in sorted(made, key=lambda p: len(p.parts), reverse=True) + [target]:
            _fsync_dir(directory)  # the files' names, deepest first

    def _write_file(self, shipped: ShippedFile, dest: Path) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        with open(dest, "xb") as out:  # "x": never over a file another writer made
            for chunk in _chunks_of(shipped, self):
                out.write(chunk)
                digest.update(chunk)
                size += len(chunk)
                del chunk  # unpins it in the object store
            out.flush()
            os.fsync(out.fileno())
        if size != shipped.size or digest.hexdigest() != shipped.sha256:
            dest.unlink(missing_ok=True)
            raise NodeFilesError(f"{shipped.path} does not match its manifest: received "
                                 f"{size} bytes with sha256 {digest.hexdigest()}, "
                                 f"{self.source} on {self.origin} had {shipped.size} bytes "
                                 f"with sha256 {shipped.sha256}")


def collect_directory(path: str | os.PathLike,
                      chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> DirectoryShipment:
    """On a node (inside an actor): ship a directory it wrote (a checkpoint) back to the
    driver, which calls `write_into`. The calling process owns the chunks: it must stay alive
    until the driver has written them."""
    return DirectoryShipment.from_path(path, chunk_bytes)


def lock_path(final: Path) -> Path:
    """The lock file that serializes the writers of `final` on a node (left in place: removing
    a lock file that another process may be about to take is a race)."""
    return final.with_name(f".{final.name}.lock")


# ---- reading and putting (the shipping side) ---------------------------------------------

def _walk(root: Path) -> tuple[list[str], list[tuple[str, Path]]]:
    """(every subdirectory, (relative path, file to read) for every file), sorted; refuses
    what cannot be shipped as plain bytes, naming it."""
    directories, files, pending = [], [], [PurePosixPath()]
    while pending:
        rel_dir = pending.pop()
        with os.scandir(root / rel_dir) as listing:
            entries = sorted(listing, key=lambda e: e.name)
        for entry in entries:
            rel, where = rel_dir / entry.name, Path(entry.path)
            if entry.is_symlink():
                files.append((rel.as_posix(), _link_target(where, root)))
            elif entry.is_dir(follow_symlinks=False):
                directories.append(rel.as_posix())
                pending.append(rel)
            elif entry.is_file(follow_symlinks=False):
                files.append((rel.as_posix(), where))
            else:
                raise NodeFilesError(f"cannot ship {where}: not a regular file (a FIFO, socket "
                                     "or device); only files and directories can be shipped")
    return sorted(directories), sorted(files)


def _link_target(link: Path, root: Path) -> Path:
    try:
        target = link.resolve(strict=True)
    except (OSError, RuntimeError):  # dangling, or a loop
        raise NodeFilesError(f"cannot ship {link}: a symlink to {os.readlink(link)!r}, which "
                             "does not exist") from None
    if not target.is_relative_to(root):
        raise NodeFilesError(f"cannot ship {link}: a symlink to {target}, outside {root}; "
                             "copy the file in, or ship the directory it is in")
    if not stat.S_ISREG(target.stat().st_mode):
        # a link to a directory inside would copy it twice, or forever (a link to a parent)
        raise NodeFilesError(f"cannot ship {link}: a symlink to {target}, which is not a "
                             "regular file; only links to files are shipped (as copies)")
    return target


def _put_file(rel: str, file: Path, chunk_bytes: int) -> ShippedFile:
    import numpy as np
    import ray

    digest, size, chunks = hashlib.sha256(), 0, []
    with open(file, "rb") as source:
        while data := source.read(chunk_bytes):
            digest.update(data)
            size += len(data)
            # a numpy view goes into the store without a pickled copy, and comes out of it on
            # the node without one (read-only, straight from shared memory)
            chunks.append(ray.put(np.frombuffer(data, dtype=np.uint8)))
            del data
    return ShippedFile(path=rel, size=size, sha256=digest.hexdigest(), chunks=tuple(chunks))


def _fingerprint(directories, files) -> str:
    text = json.dumps({"directories": sorted(directories), "files": sorted(files)})
    return hashlib.sha256(b"eddy-directory-v1\n" + text.encode("utf-8", "surrogateescape")
                          ).hexdigest()


# ---- fetching and writing (the receiving side) --------------------------------------------

def _chunks_of(shipped: ShippedFile, shipment: DirectoryShipment) -> Iterator[memoryview]:
    for index, ref in enumerate(shipped.chunks):
        yield _read_chunk(ref, f"chunk {index + 1}/{len(shipped.chunks)} of {shipped.path} "
                               f"from {shipment.source} on {shipment.origin}")


def _read_chunk(ref: Any, what: str) -> memoryview:
    import ray

    try:
        return memoryview(ray.get(ref)).cast("B")
    except ray.exceptions.RayError as exc:  # its owner died, or the node holding it
        raise NodeFilesError(f"could not fetch {what}: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


def _safe_relative(rel: str) -> str:
    """A shipment's path, refused if it would land outside the directory it is written to
    (shipments come from Eddy's own actors, but a path is checked where it is written)."""
    parts = PurePosixPath(rel).parts
    if not parts or PurePosixPath(rel).is_absolute() or any(p in ("..", ".") for p in parts):
        raise NodeFilesError(f"refusing to write {rel!r}: not a plain relative path")
    return rel


def _private_dir(root: Path) -> Path:
    """The node cache, made if absent; refused unless owned by this user and writable by no
    one else: the cache is trusted by size, so another user must not be able to plant a
    model's files in it."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.stat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
        raise NodeFilesError(f"node cache {root} must be a directory owned by this user and "
                             f"writable only by it (owner uid {info.st_uid}, mode "
                             f"{stat.filemode(info.st_mode)}); set {CACHE_ENV} to another")
    return root


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process is killed
        yield
    finally:
        os.close(fd)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _discard(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        aside = path.with_name(f".{path.name}.discarded")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(path, aside)  # gone from its name at once, then deleted
        shutil.rmtree(aside, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # only for messages: never the reason a shipment fails
        pass
    return socket.gethostname()
