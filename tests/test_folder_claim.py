"""One kvd to a folder, kept so when the lock file is deleted under it."""

from __future__ import annotations

import pytest

from kvctl.daemon.folder_claim import FolderClaim, FolderTaken, claim_folder


def test_a_claim_whose_lock_file_is_deleted_claims_again_and_keeps_a_second_out(tmp_path, caplog):
    claim = FolderClaim(tmp_path, "pid 1, socket /run/kvd/a.sock")
    with pytest.raises(FolderTaken) as taken:
        claim_folder(tmp_path, "pid 2")
    assert taken.value.holder == "pid 1, socket /run/kvd/a.sock"
    (tmp_path / "kvd.lock").unlink()  # a cleanup of the folder
    with caplog.at_level("WARNING", logger="kvd"):
        assert claim.check() is True
    assert [r.getMessage() for r in caplog.records] == [f"{str(tmp_path)!r} lost its lock file under this process; "
                                                        "claimed again"]
    with pytest.raises(FolderTaken) as taken:
        claim_folder(tmp_path, "pid 2")
    assert taken.value.holder == "pid 1, socket /run/kvd/a.sock"
    assert claim.check() is True and len(caplog.records) == 1  # nothing to do: nothing said
    claim.close()
    claim_folder(tmp_path, "pid 2").close()  # let go: the folder is free


def test_a_claim_another_process_took_meanwhile_is_said_once(tmp_path, caplog):
    claim = FolderClaim(tmp_path, "pid 1")
    (tmp_path / "kvd.lock").unlink()
    second = claim_folder(tmp_path, "pid 2")  # a second kvd, started in the gap
    with caplog.at_level("ERROR", logger="kvd"):
        assert claim.check() is False and claim.check() is False
    assert [r.getMessage() for r in caplog.records] == [
        f"{str(tmp_path)!r} lost its lock file under this process and cannot be claimed again ({str(tmp_path)!r} "
        "is held by pid 2): another kvd may start on it"]
    second.close()
    claim.close()


def test_a_claim_whose_whole_folder_is_removed_makes_it_again(tmp_path, caplog):
    import shutil

    folder = tmp_path / "state"
    folder.mkdir()
    claim = FolderClaim(folder, "pid 1")
    shutil.rmtree(folder)
    with caplog.at_level("WARNING", logger="kvd"):
        assert claim.check() is True
    assert [r.levelname for r in caplog.records] == ["WARNING"]  # no error on the way
    with pytest.raises(FolderTaken):
        claim_folder(folder, "pid 2")
    claim.close()
