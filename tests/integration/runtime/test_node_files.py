"""Directories moved between the driver and Ray nodes through the object store
(`eddyrl/runtime/node_files.py`), on a local Ray started as a run starts it. One machine plays
every node: what is checked is the copy, the cache's once-per-node write and the refusals,
not the network. (What cannot be shipped as files at all, refused before any Ray:
test_node_files_unshippable.py.)"""

import dataclasses
import fcntl
import os
import random
import shutil
from pathlib import Path

import pytest

from eddyrl.runtime.node_files import (DirectoryShipment, NodeFilesError, collect_directory,
                                       lock_path)

CHUNK = 1000  # small, so that one file spans several chunks
BIG = 3 * CHUNK + 500


@pytest.fixture(scope="module")
def local_ray():
    from eddyrl.config import load_config
    from eddyrl.resolved import runtime_settings
    from eddyrl.runtime.ray import start_ray, stop_ray

    start_ray(runtime_settings(load_config(overrides=["platform=cpu"])))
    yield
    stop_ray()


@pytest.fixture(scope="module")
def nodes(local_ray):
    """Two actors (two processes, as two workers on one node would be)."""
    import ray

    actors = [_node_actor().remote() for _ in range(2)]
    ray.get([actor.ready.remote() for actor in actors], timeout=300)
    yield actors
    for actor in actors:
        ray.kill(actor)


def _node_actor():
    """Defined in a function so that Ray ships the class by value (the workers do not import
    this test module). Counts the chunks it fetches, to tell a write from a cache hit."""
    import ray

    class Node:
        def __init__(self):
            from eddyrl.runtime import node_files

            self.fetched = 0
            read_chunk = node_files._read_chunk

            def counting(ref, what):
                self.fetched += 1
                return read_chunk(ref, what)

            node_files._read_chunk = counting

        def ready(self):
            return True

        def materialize(self, shipment, cache_root=None, into=None):
            self.fetched = 0
            path = shipment.materialize(cache_root, into=into)
            return path, self.fetched

        def collect(self, path, chunk_bytes):
            return collect_directory(path, chunk_bytes)

    return ray.remote(num_cpus=0)(Node)


def _model_like(root: Path) -> Path:
    """Nested files, an empty file, an empty directory and a file of several chunks."""
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "empty_dir").mkdir()
    (root / "config.json").write_text('{"model_type": "qwen3"}')
    (root / "empty.txt").write_bytes(b"")
    (root / "nested" / "deeper" / "tokenizer.json").write_text("{}" * 10)
    (root / "model.safetensors").write_bytes(random.Random(0).randbytes(BIG))
    return root


def _tree(root) -> dict:
    root = Path(root)
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


def test_a_directory_goes_to_a_node_and_comes_back_exactly(nodes, tmp_path):
    import ray

    source = _model_like(tmp_path / "model")
    shipment = DirectoryShipment.from_path(source, chunk_bytes=CHUNK)
    by_path = {f.path: f for f in shipment.files}
    assert len(by_path["model.safetensors"].chunks) == 4 and by_path["empty.txt"].chunks == ()
    assert "empty_dir" in shipment.directories

    cache = tmp_path / "cache"
    path, fetched = ray.get(nodes[0].materialize.remote(shipment, str(cache)), timeout=300)
    assert path == str(cache / shipment.fingerprint)
    assert fetched == sum(len(f.chunks) for f in shipment.files) == 6
    assert _tree(path) == _tree(source)

    back = ray.get(nodes[0].collect.remote(path, CHUNK), timeout=300)
    assert back.fingerprint == shipment.fingerprint
    back.write_into(tmp_path / "out")
    assert _tree(tmp_path / "out") == _tree(source)


def test_two_workers_on_a_node_write_its_cache_once(nodes, tmp_path):
    import ray

    shipment = DirectoryShipment.from_path(_model_like(tmp_path / "model"), chunk_bytes=CHUNK)
    cache = tmp_path / "cache"
    final = cache / shipment.fingerprint
    cache.mkdir(mode=0o700)
    with open(lock_path(final), "a") as held:  # both must wait for it: they run at once after
        fcntl.flock(held, fcntl.LOCK_EX)
        calls = [node.materialize.remote(shipment, str(cache)) for node in nodes]
        ready, _ = ray.wait(calls, num_returns=2, timeout=1.0)
        assert ready == [], "materialize went on while another process held the lock"
    answers = ray.get(calls, timeout=300)
    assert {path for path, _ in answers} == {str(final)}
    assert sorted(fetched for _, fetched in answers) == [0, 6]  # one wrote, one found it
    assert sorted(p.name for p in cache.iterdir()) == sorted([final.name, lock_path(final).name])
    # and a later caller returns at once, without the lock: none is needed to read a rename
    with open(lock_path(final), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert ray.get(nodes[1].materialize.remote(shipment, str(cache)), timeout=300) == (
            str(final), 0)


def test_a_half_written_copy_left_by_a_killed_writer_is_discarded(local_ray, tmp_path):
    shipment = DirectoryShipment.from_path(_model_like(tmp_path / "model"), chunk_bytes=CHUNK)
    cache = tmp_path / "cache"
    partial = cache / f".{shipment.fingerprint}.partial"
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("half")
    path = shipment.materialize(cache)
    assert _tree(path) == _tree(tmp_path / "model") and not partial.exists()


def test_a_damaged_cache_is_written_again(local_ray, tmp_path):
    # Written again, not refused: the cache is Eddy's own derived copy and the right bytes are
    # in hand, so repairing it costs one transfer; refusing would stop a run until a person
    # deleted a cache directory. (A directory the caller owns is refused instead: next test.)
    source = _model_like(tmp_path / "model")
    shipment = DirectoryShipment.from_path(source, chunk_bytes=CHUNK)
    path = Path(shipment.materialize(tmp_path / "cache"))
    with open(path / "model.safetensors", "r+b") as file:
        file.truncate(10)
    (path / "config.json").unlink()
    assert shipment.materialize(tmp_path / "cache") == str(path)
    assert _tree(path) == _tree(source)


def test_a_checkpoint_is_materialized_into_the_directory_given(nodes, tmp_path):
    import ray

    source = _model_like(tmp_path / "step_000004")
    shipment = DirectoryShipment.from_path(source, chunk_bytes=CHUNK)
    into = tmp_path / "load" / "ckpt"
    into.mkdir(parents=True)  # as tempfile.mkdtemp leaves it: empty
    path, _ = ray.get(nodes[1].materialize.remote(shipment, into=str(into)), timeout=300)
    assert path == str(into) and _tree(into) == _tree(source)
    assert not (tmp_path / "cache").exists()

    with open(into / "model.safetensors", "r+b") as file:  # the caller's: refused, kept
        file.truncate(10)
    with pytest.raises(NodeFilesError, match=r"model.safetensors is 10 bytes, the manifest "
                                             rf"says {BIG}.*absent or empty directory"):
        shipment.materialize(into=into)
    assert (into / "model.safetensors").stat().st_size == 10


def test_bytes_that_do_not_match_the_manifest_name_the_file_and_both_hashes(local_ray,
                                                                          tmp_path):
    shipment = DirectoryShipment.from_path(_model_like(tmp_path / "model"), chunk_bytes=CHUNK)
    files = [dataclasses.replace(f, sha256="0" * 64) if f.path == "config.json" else f
             for f in shipment.files]
    wrong = dataclasses.replace(shipment, files=tuple(files))
    real = next(f.sha256 for f in shipment.files if f.path == "config.json")
    with pytest.raises(NodeFilesError) as raised:
        wrong.materialize(tmp_path / "cache")
    message = str(raised.value)
    assert "config.json does not match its manifest" in message
    assert real in message and "0" * 64 in message
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        lock_path(tmp_path / "cache" / wrong.fingerprint).name]  # no copy, no partial one


def test_a_symlink_to_a_file_inside_is_shipped_as_a_copy(local_ray, tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text('{"a": 1}')
    os.symlink("config.json", source / "alias.json")
    path = Path(DirectoryShipment.from_path(source).materialize(tmp_path / "cache"))
    assert not (path / "alias.json").is_symlink()
    assert (path / "alias.json").read_text() == '{"a": 1}'


def test_shipments_from_two_ranks_merge_and_a_conflict_names_the_path(local_ray, tmp_path):
    ranks = []
    for rank in range(2):
        shard = tmp_path / f"rank{rank}"
        (shard / "optim").mkdir(parents=True)
        (shard / "config.json").write_text("same on every rank")
        (shard / "optim" / f"shard_{rank}.bin").write_bytes(bytes([rank]) * BIG)
        ranks.append(collect_directory(shard, CHUNK))
    target = tmp_path / ".step_000002.tmp"
    for shipment in ranks:
        shipment.write_into(target)
    assert sorted(_tree(target)) == ["config.json", "optim", "optim/shard_0.bin",
                                     "optim/shard_1.bin"]
    assert (target / "optim" / "shard_1.bin").read_bytes() == bytes([1]) * BIG

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("different")
    (other / "extra.bin").write_text("not written either")
    with pytest.raises(NodeFilesError, match=r"two shipments carry config.json with "
                                             "different content"):
        collect_directory(other, CHUNK).write_into(target)
    assert not (target / "extra.bin").exists()  # refused before anything is written
    assert (target / "config.json").read_text() == "same on every rank"


def test_a_shared_directory_ships_nothing(nodes, tmp_path):
    import ray

    source = _model_like(tmp_path / "model")
    shipment = DirectoryShipment.from_path(source, shared=True)
    assert shipment.files == () and shipment.local_source == str(source)
    assert ray.get(nodes[0].materialize.remote(shipment), timeout=300) == (str(source), 0)
    shutil.rmtree(source)  # as on a node that does not see it
    with pytest.raises(NodeFilesError, match=r"model was declared shared but not present on "
                                             r"this node 127\.0\.0\.1"):
        shipment.materialize()


def test_a_path_that_would_leave_the_target_is_refused(local_ray, tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    shipment = DirectoryShipment.from_path(source)
    escaping = dataclasses.replace(shipment, files=(
        dataclasses.replace(shipment.files[0], path="../config.json"),))
    with pytest.raises(NodeFilesError, match=r"refusing to write '../config.json'"):
        escaping.write_into(tmp_path / "out")
    assert not (tmp_path / "config.json").exists()


def test_a_node_cache_other_users_could_write_is_refused(local_ray, tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(NodeFilesError, match=r"node cache .*cache must be a directory owned by "
                                             "this user and writable only by it"):
        DirectoryShipment.from_path(source).materialize(cache)


def test_the_default_cache_is_eddy_node_cache(local_ray, tmp_path, monkeypatch):
    source = _model_like(tmp_path / "model")
    monkeypatch.setenv("EDDY_NODE_CACHE", str(tmp_path / "node-cache"))
    shipment = DirectoryShipment.from_path(source, chunk_bytes=CHUNK)
    assert shipment.materialize() == str(tmp_path / "node-cache" / shipment.fingerprint)
