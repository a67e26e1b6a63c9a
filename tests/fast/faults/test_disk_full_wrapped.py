"""A full disk (ENOSPC) or quota (EDQUOT) is found however it was wrapped (issue 32: on Ray it
read "CheckpointException" with no word of ENOSPC): a plain OSError, the CheckpointException of
torch.distributed.checkpoint, safetensors' message, a Ray traceback's text, each under another
error (`eddyrl/disk_full.py`). (A run ending in one line on a full disk: test_disk_full.py.)"""

import errno

import pytest

from eddyrl import disk_full

from disk_full_cases import ENOSPC, checkpoint_exception


@pytest.mark.parametrize("made, found", [
    pytest.param(lambda: OSError(errno.ENOSPC, "No space left on device", "/r/m.safetensors"),
                 (errno.ENOSPC, "/r/m.safetensors"), id="oserror"),
    pytest.param(lambda: checkpoint_exception(ENOSPC), (errno.ENOSPC, None),
                 id="checkpoint-exception"),
    pytest.param(lambda: RuntimeError("Error while serializing: I/O error: Disk quota exceeded "
                                      "(os error 122)"), (errno.EDQUOT, None), id="safetensors"),
    pytest.param(lambda: RuntimeError("ray::TrainerRank.save()\nOSError: [Errno 28] No space "
                                      "left on device: '/r/x'"), (errno.ENOSPC, "/r/x"),
                 id="traceback-text"),
])
def test_a_full_disk_is_found_however_it_was_wrapped(made, found):
    try:
        try:
            raise made()
        except BaseException as inner:
            raise RuntimeError("cleanup failed too") from inner
    except RuntimeError as outer:
        full = disk_full.find(outer)
    assert (full.code, full.path) == found
    assert disk_full.find(RuntimeError("a different error")) is None
