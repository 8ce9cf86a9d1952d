"""One bounded reader (``flatpack.safeio``) for every file someone else may have written: each
case here was reproduced on main as a hang, a memory blow-up or a traceback, and is now a
flatpack error naming the file, raised before anything large is read or decompressed and
before any artifact code runs. docs/security.md ("One bounded reader") cites these tests.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import resource
import signal
import stat
import struct
import time
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import flatpack
from flatpack import cli, safeio
from flatpack.compiler import load
from flatpack.data import MAX_SHARD_BYTES, ShardDirectory, read_shard
from flatpack.errors import ArtifactError, InputError
from flatpack.stage import integrity
from flatpack.stage.integrity import INDEX_FILE, check_safetensors
from tests.security.conftest import rewrite_index, rewrite_weights
from tests.security.fuzz_formats import _subparser, deep

GiB = 1 << 30
DEEP = 200_000


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Bounded:
    """Asserts the block takes under ``seconds`` (SIGALRM fails it instead of hanging the
    suite) and grows the peak RSS by under ``rss`` bytes."""

    def __init__(self, seconds: int = 5, rss: int = 256 << 20) -> None:
        self.seconds, self.rss = seconds, rss

    def __enter__(self) -> Bounded:
        def alarm(signum, frame):
            raise AssertionError(f"the read hung: still running after {self.seconds} s")

        self.previous = signal.signal(signal.SIGALRM, alarm)
        self.before = peak_rss()
        signal.alarm(self.seconds)
        return self

    def __exit__(self, *exc) -> None:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.previous)
        grown = peak_rss() - self.before
        assert grown < self.rss, f"peak RSS grew by {grown:,} bytes"


def sparse(path: Path, size: int = 6 * GiB) -> Path:
    """A file of ``size`` bytes that takes no disk space (and no memory unless read)."""
    with open(path, "wb") as file:
        file.truncate(size)
    return path


def framed(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body




def check_exit(out: Path, capsys, *args: str) -> tuple[int, str]:
    code = cli.main(["check", str(out), *args])
    return code, capsys.readouterr().err


# -- a FIFO, a device, a sparse file in place of a file ---------------------------------------

def test_a_fifo_in_place_of_the_index_is_refused_at_once_even_with_a_digest(out, compiled, capsys):
    (out / INDEX_FILE).unlink()
    os.mkfifo(out / INDEX_FILE)
    with Bounded(), pytest.raises(ArtifactError, match="not a regular file") as caught:
        load(out, digest=compiled.digest)
    assert str(out / INDEX_FILE) in str(caught.value)
    with Bounded():
        code, err = check_exit(out, capsys, "--digest", compiled.digest)
    assert code == 2 and INDEX_FILE in err and "Traceback" not in err


def test_a_fifo_in_place_of_a_stage_file_is_refused(out):
    weights = out / "stage_000" / "weights.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    with Bounded(), pytest.raises(ArtifactError, match="FIFO"):
        load(out)


def test_a_6_gib_sparse_file_is_refused_by_its_size_before_a_byte_is_read(out, tmp_path):
    sparse(out / "stage_001" / "weights.safetensors")
    with Bounded(), pytest.raises(ArtifactError, match="6,442,450,944 bytes but flatpack.index.json records"):
        load(out)
    sparse(out / INDEX_FILE)
    with Bounded(), pytest.raises(ArtifactError, match=f"more than the {integrity.MAX_INDEX_BYTES:,}"):
        load(out)


def test_a_6_gib_sparse_shard_or_config_is_refused_by_its_size(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for name in ("big.safetensors", "big.pt", "big.npz"):
        sparse(shards / name)
        with Bounded(), pytest.raises(InputError, match=f"shard {name}.* has 6,442,450,944 bytes"):
            read_shard(shards / name, name)
        if not name.endswith(".npz"):
            with Bounded(), pytest.raises(InputError, match="6,442,450,944 bytes"):
                ShardDirectory(shards).columns(name)
    config = sparse(tmp_path / "big.toml")
    with Bounded(), pytest.raises(InputError, match=f"--config {config}: .* has 6,442,450,944 bytes"):
        cli.config_defaults(str(config), _subparser(cli.build_parser(), "plan"))


def test_a_fifo_config_is_refused(tmp_path):
    config = tmp_path / "fifo.toml"
    os.mkfifo(config)
    with Bounded(), pytest.raises(InputError, match="not a regular file"):
        cli.config_defaults(str(config), _subparser(cli.build_parser(), "plan"))


# -- a zip bomb ------------------------------------------------------------------------------

def _npy_bomb(blocks: int) -> tuple[bytes, int]:
    """A raw deflate stream of an ``.npy`` file (a valid header, then ``blocks`` * 64 MiB of
    zero uint8) and its inflated size, about a thousandth of that: the 64 MiB blocks end in a
    full flush (no back reference across them), so one compressed block is repeated."""
    zeros = blocks * (64 << 20)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "|u1", "fortran_order": False, "shape": (zeros,)})
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    head = compressor.compress(header.getvalue()) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(b"\0" * (64 << 20)) + compressor.flush(zlib.Z_FULL_FLUSH)
    return head + block * blocks + b"\x03\x00", len(header.getvalue()) + zeros   # an empty final block


def npz_bomb(path: Path, members: int = 2, blocks: int = 48) -> Path:
    """An ``.npz`` of ``members`` zero-filled uint8 arrays of ``blocks`` * 64 MiB (3 GiB each
    by default): a few MiB on disk, 6 GiB inflated. Written by hand (zipfile would compress
    the gigabytes to write it); the CRCs are left 0, which numpy would notice only after
    inflating everything."""
    local, central = bytearray(), bytearray()
    for number in range(members):
        name = f"a{number}.npy".encode()
        stream, size = _npy_bomb(blocks)
        offset = len(local)
        fields = struct.pack("<HHHHHIII", 20, 0, 8, 0, 0, 0, len(stream), size)
        local += b"PK\x03\x04" + fields + struct.pack("<HH", len(name), 0) + name + stream
        central += (b"PK\x01\x02" + struct.pack("<H", 20) + fields
                    + struct.pack("<HHHHHI", len(name), 0, 0, 0, 0, 0o644 << 16) + struct.pack("<I", offset) + name)
    end = b"PK\x05\x06" + struct.pack("<HHHHIIH", 0, 0, members, members, len(central), len(local), 0)
    path.write_bytes(bytes(local + central + end))
    return path


def test_an_npz_bomb_is_refused_before_decompression(tmp_path):
    bomb = npz_bomb(tmp_path / "bomb.npz")
    assert bomb.stat().st_size < 8 << 20   # about 6 MiB
    with zipfile.ZipFile(bomb) as archive:   # the bomb is what it claims: 6 GiB declared, deflated
        assert sum(member.file_size for member in archive.infolist()) > 6 * GiB
    with Bounded(seconds=10, rss=64 << 20), pytest.raises(InputError, match="uncompressed") as caught:
        read_shard(bomb, "bomb.npz")
    assert "bomb.npz" in str(caught.value) and f"{MAX_SHARD_BYTES:,}" in str(caught.value)


def test_an_npy_header_claiming_more_than_its_member_is_refused(tmp_path):
    path = tmp_path / "lie.npz"
    with zipfile.ZipFile(path, "w") as archive, archive.open("x.npy", "w") as member:
        np.lib.format.write_array_header_1_0(member, {"descr": "<f8", "fortran_order": False, "shape": (1 << 40,)})
        member.write(b"\0" * 64)
    with Bounded(), pytest.raises(InputError, match="claims shape"):
        read_shard(path, "lie.npz")


def test_a_pt_shard_is_loaded_weights_only(tmp_path, sentinel):
    class Hostile:
        def __reduce__(self):
            return (os.system, (f"touch {sentinel}",))

    path = tmp_path / "hostile.pt"
    path.write_bytes(pickle.dumps({"input": Hostile()}))
    with pytest.raises(InputError, match="hostile.pt"):
        read_shard(path, "hostile.pt")
    torch.save({"input": Hostile()}, tmp_path / "zipped.pt")
    with pytest.raises(InputError, match="zipped.pt"):
        read_shard(tmp_path / "zipped.pt", "zipped.pt")
    assert not sentinel.exists()


def test_a_valid_shard_of_each_format_still_reads(tmp_path):
    tensors = {"input": torch.randn(4, 3), "target": torch.arange(4)}
    torch.save(tensors, tmp_path / "a.pt")
    np.savez_compressed(tmp_path / "b.npz", input=tensors["input"].numpy(), target=tensors["target"].numpy())
    from safetensors.torch import save_file

    save_file(tensors, tmp_path / "c.safetensors")
    for name in ("a.pt", "b.npz", "c.safetensors"):
        read = read_shard(tmp_path / name, name)
        assert torch.equal(read["input"], tensors["input"]) and torch.equal(read["target"], tensors["target"])
        assert ShardDirectory(tmp_path).columns(name)[0] == 4


# -- deep JSON in every file ------------------------------------------------------------------

def test_deep_json_in_the_index_is_an_artifact_error(out):
    (out / INDEX_FILE).write_text(deep(DEEP, __import__("random").Random(0)))
    with pytest.raises(ArtifactError, match=f"{out / INDEX_FILE} nests 200000 levels deep"):
        load(out)


@pytest.mark.parametrize("name", ["flatpack.json", "stage_000/manifest.json"])
def test_deep_json_in_flatpack_json_or_a_manifest_is_an_artifact_error(out, name):
    (out / name).write_text('{"a":' + "[" * DEEP + "]" * DEEP + "}")
    rewrite_index(out)
    with pytest.raises(ArtifactError, match=f"{out / name} nests"):
        load(out)


def test_deep_json_in_a_safetensors_header_is_an_artifact_error(out):
    header = ('{"a":' * DEEP + "0" + "}" * DEEP).encode()
    weights = rewrite_weights(out, struct.pack("<Q", len(header)) + header)
    with pytest.raises(ArtifactError, match="safetensors header nests"):
        load(out)
    assert weights.exists()


def test_deep_json_in_a_calibration_is_an_input_error(tmp_path):
    from flatpack.platform.calibration import Calibration

    path = tmp_path / "calibration.json"
    path.write_text("[" * DEEP + "]" * DEEP)
    with pytest.raises(InputError, match="calibration"):
        Calibration.load(path)


def test_duplicate_keys_nan_and_overflowing_numbers_are_refused_in_the_index(out):
    raw = (out / INDEX_FILE).read_text()
    (out / INDEX_FILE).write_text('{"kind": "x", ' + raw[1:])
    with pytest.raises(ArtifactError, match="the key 'kind' appears twice"):
        load(out)
    (out / INDEX_FILE).write_text(raw.replace('"schema_version":1', '"schema_version":NaN'))
    with pytest.raises(ArtifactError, match="NaN is not a JSON number"):
        load(out)
    (out / INDEX_FILE).write_text(raw.replace('"schema_version":1', '"schema_version":1e999'))
    with pytest.raises(ArtifactError, match="1e999 is too large for a float"):
        load(out)


# -- safetensors framing ----------------------------------------------------------------------

F32 = {"dtype": "F32", "shape": [2]}


@pytest.mark.parametrize(("header", "body", "cause"), [
    ({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}}, 12, "overlaps"),
    ({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [0, 8]}}, 8, "overlaps"),
    ({"a": {**F32, "data_offsets": [8, 16]}}, 16, "leaves bytes 0..8 unused"),
    ({"a": {**F32, "data_offsets": [0, 8]}}, 12, "trailing bytes"),
    ({"a": {**F32, "data_offsets": [8, 0]}}, 8, "claims bytes 8..0"),
    ({"__metadata__": [1], "a": {**F32, "data_offsets": [0, 8]}}, 8, "__metadata__ is a JSON list"),
    ({"__metadata__": {"k": 1}, "a": {**F32, "data_offsets": [0, 8]}}, 8, r"__metadata__\['k'\] is a JSON int"),
    ({"a": {"dtype": "F32", "shape": [2**40, 2**40, 0], "data_offsets": [0, 0]}}, 0, "64 bits"),
    ({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}}, 8, "dtype 'Q4'"),
    ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, 4, "whole numbers"),
])
def test_safetensors_framing_refuses_what_the_parser_would_raise_on(header, body, cause):
    with pytest.raises(ArtifactError, match=cause):
        check_safetensors(framed(header, b"\0" * body), "w.safetensors")


def test_out_of_order_ranges_that_tile_the_data_are_accepted():
    """The parser sorts by offset: order in the header is not an error, overlap is."""
    check_safetensors(framed({"b": {**F32, "data_offsets": [8, 16]}, "a": {**F32, "data_offsets": [0, 8]}},
                             b"\0" * 16), "w.safetensors")


@pytest.mark.parametrize("header", [
    {"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}},
    {"__metadata__": {"stage": 1}, "a": {**F32, "data_offsets": [0, 8]}},
])
def test_overlapping_ranges_or_bad_metadata_in_the_weights_are_refused_by_load(out, sentinel, header):
    body = max(entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__")
    weights = rewrite_weights(out, framed(header, b"\0" * body))
    with pytest.raises(ArtifactError) as caught:
        load(out)
    assert str(weights) in str(caught.value)
    assert not sentinel.exists()


def test_a_shard_with_overlapping_ranges_is_an_input_error(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(framed({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}},
                            b"\0" * 12))
    with pytest.raises(InputError, match="shard bad.safetensors: the tensor 'b'.*overlaps"):
        read_shard(path, "bad.safetensors")
    with pytest.raises(InputError, match="overlaps"):
        ShardDirectory(tmp_path).columns("bad.safetensors")


# -- the directory's shape --------------------------------------------------------------------

def test_an_index_entry_that_is_a_directory_on_disk_is_refused(out):
    index = json.loads((out / INDEX_FILE).read_text())
    index["files"]["stage_000"] = {"bytes": 0, "sha256": hashlib.sha256(b"").hexdigest()}
    (out / INDEX_FILE).write_text(json.dumps(index, sort_keys=True, separators=(",", ":")) + "\n")
    with pytest.raises(ArtifactError, match=f"{out / 'stage_000'}: stage_000 is a directory"):
        load(out)


def test_a_missing_stage_file_is_named_with_the_fix(out):
    (out / "stage_001" / "stage.py").unlink()
    with pytest.raises(ArtifactError, match=f"{out / 'stage_001' / 'stage.py'} is missing.*Recompile"):
        load(out)


def test_a_parent_swapped_for_a_symlink_between_the_scan_and_the_open_is_refused(out, sentinel, tmp_path,
                                                                               monkeypatch):
    """The race, made deterministic: the stage directory is swapped for a link to a copy
    holding hostile code right after the scan found no link. Every file is opened below the
    artifact's directory descriptor with O_NOFOLLOW at each component, so the swap is seen."""
    stage = out / "stage_001"
    hostile = tmp_path / "hostile_stage"
    hostile.mkdir()
    for path in stage.iterdir():
        (hostile / path.name).write_bytes(path.read_bytes())
    (hostile / "stage.py").write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    scan = integrity._scan

    def scan_then_swap(*args, **kwargs):
        found = scan(*args, **kwargs)
        stage.rename(tmp_path / "original_stage")
        stage.symlink_to(hostile, target_is_directory=True)
        return found

    monkeypatch.setattr(integrity, "_scan", scan_then_swap)
    with pytest.raises(ArtifactError, match="'stage_001' in 'stage_001/.*' is a symbolic link"):
        load(out)
    assert not sentinel.exists()


def test_open_beneath_refuses_a_link_at_any_component(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    fd = safeio.open_directory(tmp_path, what="test")
    try:
        assert safeio.read_beneath(fd, "real/f", limit=10, what="f") == b"x"
        with pytest.raises(InputError, match="symbolic link"):
            safeio.read_beneath(fd, "link/f", limit=10, what="f")
    finally:
        os.close(fd)


# -- check runs what load runs ----------------------------------------------------------------

def _break_manifest(out: Path) -> None:
    manifest = json.loads((out / "stage_000" / "manifest.json").read_text())
    manifest["inputs"] = [{"name": 1}]
    (out / "stage_000" / "manifest.json").write_text(json.dumps(manifest))


def _break_plan(out: Path) -> None:
    document = json.loads((out / "flatpack.json").read_text())
    document["plan"]["stages"] = "two"
    (out / "flatpack.json").write_text(json.dumps(document))


def _break_weights(out: Path) -> None:
    (out / "stage_001" / "weights.safetensors").write_bytes(
        framed({"a": {**F32, "data_offsets": [0, 8]}, "b": {**F32, "data_offsets": [4, 12]}}, b"\0" * 12))


def _break_structure(out: Path) -> None:
    document = json.loads((out / "flatpack.json").read_text())
    document["output_structure"] = {"tuple": [], "class": "subprocess:Popen"}
    (out / "flatpack.json").write_text(json.dumps(document))


@pytest.mark.parametrize("breakage", [_break_manifest, _break_plan, _break_weights, _break_structure])
def test_check_fails_exactly_where_load_fails(out, capsys, breakage):
    breakage(out)
    rewrite_index(out)
    with pytest.raises(ArtifactError) as caught:
        load(out)
    code, err = check_exit(out, capsys)
    assert code == 2
    assert str(caught.value).splitlines()[0] in err and "Traceback" not in err


def test_check_passes_where_load_passes(out, compiled, capsys):
    code, err = check_exit(out, capsys, "--digest", compiled.digest)
    assert code == 0, err


# -- saving ------------------------------------------------------------------------------------

def test_save_stages_in_a_fresh_private_directory_whatever_was_planted(compiled, tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    target = tmp_path / "out"
    # the names the old save used, planted as a link into another user's directory and as a file
    (tmp_path / f".out.flatpack-tmp-{os.getpid()}").symlink_to(victim, target_is_directory=True)
    (tmp_path / f".out.flatpack-old-{os.getpid()}").write_text("planted")
    compiled.save(target)
    assert not any(victim.iterdir())
    assert load(target, digest=compiled.digest).digest == compiled.digest
    assert not [path for path in tmp_path.iterdir() if ".flatpack-tmp-" in path.name and not path.is_symlink()]
    compiled.save(target)   # replacing a previous output goes through a fresh directory too
    assert not any(victim.iterdir())
    modes = {path.relative_to(target).as_posix(): stat.S_IMODE(path.stat().st_mode) for path in target.rglob("*")}
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    assert {mode for name, mode in modes.items() if (target / name).is_dir()} == {0o700}
    assert {mode for name, mode in modes.items() if (target / name).is_file()} == {0o600}


def test_save_private_false_makes_the_artifact_readable_by_others(compiled, tmp_path):
    target = compiled.save(tmp_path / "shared", private=False)
    assert stat.S_IMODE(target.stat().st_mode) == 0o755
    assert stat.S_IMODE((target / "stage_000").stat().st_mode) == 0o755
    assert stat.S_IMODE((target / INDEX_FILE).stat().st_mode) == 0o644


def test_save_refuses_to_overwrite_a_fifo_flatpack_json_without_hanging(compiled, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    os.mkfifo(target / "flatpack.json")
    with Bounded(), pytest.raises(ArtifactError, match="not written by flatpack"):
        compiled.save(target)


# -- TOML configs -----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "cause"), [
    ('batch = 8\nsolver = "dp"\nsolver = "miqp"\n', "line 3"),
    ("batch = [" * 50_000 + "\n", "line 1"),
    ("batch = " + "[" * 100_000 + "1" + "]" * 100_000 + "\n", "nests"),
])
def test_a_malformed_toml_config_names_the_file_and_line(tmp_path, text, cause):
    config = tmp_path / "bad.toml"
    config.write_text(text)
    with Bounded(), pytest.raises(InputError, match=cause) as caught:
        cli.config_defaults(str(config), _subparser(cli.build_parser(), "plan"))
    assert str(config) in str(caught.value)


def test_a_non_utf8_toml_config_is_an_input_error(tmp_path):
    config = tmp_path / "latin.toml"
    config.write_bytes(b'solver = "d\xe9p"\n')
    with pytest.raises(InputError, match="not UTF-8 text"):
        cli.config_defaults(str(config), _subparser(cli.build_parser(), "plan"))


def test_the_timing_guard_itself_fails_a_hang():
    """The guard the tests above rely on turns a blocked read into a failure, not a hang."""
    with pytest.raises(AssertionError, match="hung"), Bounded(seconds=1):
        time.sleep(3)


def test_the_reader_of_record_is_safeio_for_flatpack_load(out, monkeypatch):
    """Every file load reads goes through open_beneath below one directory descriptor."""
    opened: list[str] = []
    original = safeio.open_beneath

    def spy(root_fd, relative, **kwargs):
        opened.append(relative)
        return original(root_fd, relative, **kwargs)

    monkeypatch.setattr(safeio, "open_beneath", spy)
    flatpack.load(out)
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(opened) == {INDEX_FILE, *index["files"]}
