"""The files osdp keeps between runs are written whole, and a cache that cannot be written is not fatal."""

import pytest

from osdp.store import write_atomically


def test_a_file_is_replaced_whole_and_no_temporary_is_left(tmp_path):
    path = tmp_path / "deep" / "entry.json"
    assert write_atomically(path, "first") and write_atomically(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in path.parent.iterdir()] == ["entry.json"]


def test_a_cache_that_cannot_be_written_warns_and_the_run_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.warns(UserWarning, match="cannot write .* OSDP_CACHE_DIR at a writable directory"):
        assert write_atomically(blocker / "calibration" / "x.json", "text") is False
