"""The hash-lock generator against a local fake index (PEP 691 JSON and PEP 503 HTML on
127.0.0.1), and pip's own --require-hashes accepting what it writes."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import subprocess
import sys
import threading
import zipfile
from typing import Iterator

import pytest

from flatpack.backends import lock as locking
from flatpack.backends.lock import Index, LockError, Target, lock, lock_problems

X86 = "manylinux_2_17_x86_64"


def _wheel(name: str, version: str, tag: str, requires: list[str]) -> tuple[str, bytes, bytes]:
    """(file name, wheel bytes, METADATA bytes) of a minimal valid wheel."""
    dist = f"{name.replace('-', '_')}-{version}"
    filename = f"{dist}-{tag}.whl"
    metadata = "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                          *(f"Requires-Dist: {r}" for r in requires)]).encode() + b"\n"
    wheel = f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n".encode()
    module = f"{name.replace('-', '_')}.py"
    files = {module: b"", f"{dist}.dist-info/METADATA": metadata, f"{dist}.dist-info/WHEEL": wheel}
    record = "".join(f"{path},,\n" for path in files) + f"{dist}.dist-info/RECORD,,\n"
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in {**files, f"{dist}.dist-info/RECORD": record.encode()}.items():
            archive.writestr(path, data)
    return filename, buffer.getvalue(), metadata


# project -> [(version, tag, requires, metadata served?)]
PYPI_PROJECTS = {
    "app": [("1.0", "py3-none-any", ["lib>=2", "helper[fast]", "optional; extra == 'gui'",
                                     "winonly; sys_platform == 'win32'"], True)],
    "lib": [("1.0", "py3-none-any", [], True), ("2.0", "py3-none-any", [], True), ("2.1", "py3-none-any", [], True),
            ("2.2", "cp312-cp312-macosx_14_0_arm64", [], True), ("3.0rc1", "py3-none-any", [], True)],
    "helper": [("1.0", "py3-none-any", ["speedup; extra == 'fast'"], False)],   # METADATA read by range requests
    "speedup": [("1.0", f"cp312-cp312-{X86}", [], True), ("1.0", f"cp311-cp311-{X86}", [], True),
                ("1.0", "cp312-cp312-win_amd64", [], True)],
    "winonly": [("1.0", "py3-none-any", [], True)],
    "optional": [("1.0", "py3-none-any", [], True)],
    "needs-old-lib": [("1.0", "py3-none-any", ["lib<2"], True)],
}
SECOND_PROJECTS = {"fast": [("1.0+cpu", f"cp312-cp312-{X86}", ["lib"], False)]}


class FakeIndex:
    """Two indexes on one server: /pypi/ (PEP 691 JSON, PEP 658 metadata) and /second/ (PEP 503
    HTML with #sha256= fragments, no metadata); files served with byte ranges."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.pages: dict[str, tuple[bytes, str]] = {}
        self.digests: dict[str, str] = {}
        for root, projects in (("pypi", PYPI_PROJECTS), ("second", SECOND_PROJECTS)):
            for project, versions in projects.items():
                entries = []
                for version, tag, requires, with_metadata in versions:
                    filename, data, metadata = _wheel(project, version, tag, requires)
                    self.files[f"/files/{filename}"] = data
                    self.digests[filename] = hashlib.sha256(data).hexdigest()
                    entry = {"filename": filename, "url": f"/files/{filename}",
                             "hashes": {"sha256": self.digests[filename]}}
                    if with_metadata:
                        self.files[f"/files/{filename}.metadata"] = metadata
                        entry["core-metadata"] = {"sha256": hashlib.sha256(metadata).hexdigest()}
                    entries.append(entry)
                if root == "pypi":
                    body = json.dumps({"meta": {"api-version": "1.1"}, "name": project, "files": entries})
                    self.pages[f"/pypi/{project}/"] = (body.encode(), locking._JSON)
                else:
                    links = "".join(f'<a href="{e["url"]}#sha256={e["hashes"]["sha256"]}">{e["filename"]}</a>'
                                    for e in entries)
                    self.pages[f"/second/{project}/"] = (f"<html><body>{links}</body></html>".encode(), "text/html")
        self.requests: list[str] = []

    def handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, head: bool) -> None:
                index.requests.append(self.path)
                if self.path in index.pages:
                    body, content_type = index.pages[self.path]
                elif self.path in index.files:
                    body, content_type = index.files[self.path], "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                status, start, end = 200, 0, len(body)
                if "Range" in self.headers:
                    first, _, last = self.headers["Range"].removeprefix("bytes=").partition("-")
                    status, start, end = 206, int(first), int(last) + 1
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(end - start))
                self.end_headers()
                if not head:
                    self.wfile.write(body[start:end])

            def do_GET(self) -> None:
                self._send(head=False)

            def do_HEAD(self) -> None:
                self._send(head=True)

        return Handler


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeIndex, str]]:
    index = FakeIndex()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), index.handler())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield index, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _indexes(url: str) -> list[Index]:
    return [Index(f"{url}/pypi"), Index(f"{url}/second")]


def test_lock_resolves_the_closure_for_the_target_with_every_wheels_hash(fake):
    index, url = fake
    result = lock(["app", "fast==1.0+cpu"], _indexes(url), Target((3, 12)), prefer={"lib": "2.0"})
    by_name = {package.name: package for package in result.packages}
    # markers are the target's (Linux, CPython 3.12): winonly (win32) and optional (extra) stay out
    assert set(by_name) == {"app", "lib", "helper", "speedup", "fast"}
    assert str(by_name["lib"].version) == "2.0"                  # the preferred version satisfies lib>=2
    assert by_name["fast"].index == f"{url}/second"             # only the second index has it
    # speedup: only the cp312 manylinux wheel fits the target; its hash is the served bytes' sha256
    assert by_name["speedup"].hashes == (index.digests[f"speedup-1.0-cp312-cp312-{X86}.whl"],)
    # helper's dependencies came out of the wheel itself (no PEP 658 file): a range request, not the whole wheel
    assert "speedup" in by_name and "/files/helper-1.0-py3-none-any.whl" in index.requests
    text = result.text()
    assert lock_problems(text) == []
    assert f"--extra-index-url {url}/second" in text


def test_without_a_preference_the_newest_final_compatible_version_wins(fake):
    _, url = fake
    result = lock(["lib"], _indexes(url), Target((3, 12)), prefer={})
    assert [str(p.version) for p in result.packages] == ["2.1"]   # not 2.2 (macOS only), not 3.0rc1


def test_contradicting_requirements_name_both_sides(fake):
    _, url = fake
    with pytest.raises(LockError, match=r"needs-old-lib==1.0 needs lib<2, but lib 2.1 was already chosen"):
        lock(["lib", "needs-old-lib"], _indexes(url), Target((3, 12)), prefer={})


def test_a_package_without_a_wheel_for_the_target_is_refused(fake):
    _, url = fake
    with pytest.raises(LockError, match="no wheel of speedup.*CPython 3.10"):
        lock(["speedup"], _indexes(url), Target((3, 10)), prefer={})


def test_a_file_listed_without_a_hash_needs_a_known_digest(fake):
    index, url = fake

    def no_hashes(page: str, accept: str) -> tuple[bytes, str]:
        body, content_type = locking.http_fetch(page, accept)
        return body.replace(b"#sha256=", b"#md5="), content_type

    with pytest.raises(LockError, match="without a sha256; give its digest in known_hashes"):
        lock(["fast==1.0+cpu"], [Index(f"{url}/second", no_hashes)], Target((3, 12)), prefer={})
    wheel = f"fast-1.0+cpu-cp312-cp312-{X86}.whl"
    digest = index.digests[wheel]
    result = lock(["fast==1.0+cpu"], [Index(f"{url}/second", no_hashes), Index(f"{url}/pypi")], Target((3, 12)),
                  prefer={}, known_hashes={wheel: digest})
    assert {p.name: p.hashes for p in result.packages}["fast"] == (digest,)


def test_pip_installs_the_lock_in_hash_checking_mode_and_refuses_a_wrong_hash(fake, tmp_path):
    _, url = fake
    text = lock(["app"], _indexes(url), Target((3, 12)), prefer={}).text()
    (tmp_path / "lock.txt").write_text(text)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-cache-dir",
               "--require-hashes", "--only-binary=:all:", "--platform", X86, "--python-version", "3.12",
               "--index-url", f"{url}/pypi", "-d", str(tmp_path / "wheels"), "-r", str(tmp_path / "lock.txt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(list((tmp_path / "wheels").glob("*.whl"))) == 4        # app, lib, helper, speedup
    first = text.index("--hash=sha256:") + len("--hash=sha256:")
    (tmp_path / "lock.txt").write_text(text[:first] + "0" * 64 + text[first + 64:])
    done = subprocess.run([*command[:-4], "-d", str(tmp_path / "again"), "-r", str(tmp_path / "lock.txt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "DO NOT MATCH" in done.stderr


@pytest.mark.parametrize("text, problem", [
    ("numpy\n", "is not pinned with =="),
    ("numpy>=1\n    --hash=sha256:" + "a" * 64 + "\n", "is not pinned with =="),
    ("numpy==2.0\n", "has no --hash"),
    ("# only a comment\n", "pins nothing"),
])
def test_lock_problems_name_what_require_hashes_would_refuse(text, problem):
    assert any(problem in found for found in lock_problems(text))


@pytest.mark.parametrize("kind", ["function", "gpu"])
def test_the_committed_locks_hash_every_pin(kind):
    text = locking.committed_lock(kind)
    assert lock_problems(text) == []
    if kind == "function":
        assert "torch==2.13.0+cpu \\\n    --hash=sha256:" + locking.TORCH_CPU_SHA256 in text
        assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text
    else:
        assert "torch==2.13.0 \\" in text and "nvidia-nccl-cu13==" in text
