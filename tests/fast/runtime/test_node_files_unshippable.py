"""What `DirectoryShipment.from_path` cannot ship as files is refused naming it, before
anything is sent (`eddyrl/runtime/node_files.py`): a symlink out of the directory, one to a
directory, a dangling one, a pipe. No Ray: the refusal comes from reading the directory. (The
copies themselves, on a local Ray: test_node_files.py.)"""

import os

import pytest

from eddyrl.runtime.node_files import DirectoryShipment, NodeFilesError


def test_what_cannot_be_shipped_as_files_is_refused_by_name(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (tmp_path / "secret").write_text("outside")
    os.symlink(tmp_path / "secret", source / "escape.json")
    with pytest.raises(NodeFilesError, match=r"escape.json: a symlink to .*secret, outside"):
        DirectoryShipment.from_path(source)
    (source / "escape.json").unlink()

    os.symlink("../model", source / "loop")
    with pytest.raises(NodeFilesError, match=r"loop: a symlink to .*not a regular file"):
        DirectoryShipment.from_path(source)
    (source / "loop").unlink()

    os.symlink("gone.json", source / "dangling.json")
    with pytest.raises(NodeFilesError, match=r"dangling.json: a symlink to 'gone.json', "
                                             "which does not exist"):
        DirectoryShipment.from_path(source)
    (source / "dangling.json").unlink()

    os.mkfifo(source / "pipe")
    with pytest.raises(NodeFilesError, match=r"pipe: not a regular file"):
        DirectoryShipment.from_path(source)
