"""flatpack.atomic.write_atomic: the run record, calibrations, caches and rank reports are
replaced whole or not at all, by any number of writers at once."""

from __future__ import annotations

import multiprocessing
import os
import stat

import pytest

from flatpack.atomic import write_atomic


def _write_repeatedly(path: str, tag: int, times: int) -> None:
    for index in range(times):
        write_atomic(path, f"{tag}:{index}:" + "x" * 50_000)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks the writers")
def test_writers_racing_on_one_path_all_succeed_and_a_reader_only_sees_whole_files(tmp_path):
    path = tmp_path / "record.json"
    write_atomic(path, "0:0:" + "x" * 50_000)
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_repeatedly, args=(str(path), tag, 200)) for tag in (1, 2, 3)]
    for writer in writers:
        writer.start()
    torn = 0
    while any(writer.is_alive() for writer in writers):
        text = path.read_text()
        torn += not text.endswith("x" * 50_000) or len(text.split(":")[2]) != 50_000
    for writer in writers:
        writer.join(timeout=60)
    assert [writer.exitcode for writer in writers] == [0, 0, 0]
    assert torn == 0
    assert path.read_text().split(":")[1] == "199"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["record.json"]     # no temporary left


class _FillsTheDisk:
    """A file whose write stops after one byte, as on a full disk."""

    def __init__(self, file):
        self.file = file

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.file.close()

    def write(self, data):
        self.file.write(data[:1])
        self.file.flush()
        raise OSError(28, "No space left on device")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    write_atomic(path, b"old")
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda handle, mode: _FillsTheDisk(real_fdopen(handle, mode)))
    with pytest.raises(OSError, match="No space left"):
        write_atomic(path, b"new and longer")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["run.json"]


def test_the_file_gets_the_modes_open_would_give_and_the_prefix_names_the_temporary(tmp_path, monkeypatch):
    previous = os.umask(0o022)
    try:
        written = write_atomic(tmp_path / "calibration.json", "{}\n")
    finally:
        os.umask(previous)
    assert written == tmp_path / "calibration.json" and written.read_text() == "{}\n"
    # a calibration or run record others on the machine may read, not mkstemp's 0o600
    assert stat.S_IMODE(written.stat().st_mode) == 0o644
    assert stat.S_IMODE(write_atomic(tmp_path / "private", b"", mode=0o600).stat().st_mode) == 0o600
    seen = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda source, target: (seen.append(os.path.basename(source)),
                                                                real_replace(source, target)))
    write_atomic(tmp_path / "key", b"data", prefix=".fp-tmp-key.")
    assert len(seen) == 1 and seen[0].startswith(".fp-tmp-key.") and seen[0].endswith(".tmp")
