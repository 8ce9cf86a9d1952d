"""Container images for function platforms: one build context per image, with a Dockerfile,
pinned requirements, the flatpack runtime, the stage artifacts baked in, and the handler.

torch alone is past Lambda's 250 MB unzipped limit for zip packages (slsML stripped
TensorFlow by hand; BentoML#614 and gluonts#2845 hit the same wall), so every stage ships as
a container image (10 GB on Lambda and on Function Compute). Stages share an image while
their artifacts together stay under ``share_below_bytes``: a small model is one image that
every function runs (one build, one push), and a large one gets an image per stage, so a
function pulls only its own weights. A function finds its stage under
``$FLATPACK_ARTIFACTS/stage_XXX``.

No Docker engine runs where flatpack is tested, so a context is checked statically
(:func:`check_context`): every COPY source exists, the base image is pinned by digest, pip
installs a hash-locked ``requirements.txt`` with ``--require-hashes``, the image runs as a
non-root user and its files are root's, the handler the CMD names exists and every Python
file compiles.

Hardening (issue 17): the base is ``catalog.BASE_IMAGES[target]`` by digest (or the user's
``name:tag@sha256:...``), the requirements are the committed lock
(``flatpack/backends/locks/function.txt``, :mod:`flatpack.backends.lock`), everything is
installed and copied as root and made read-only for others, and ``USER`` drops to an
unprivileged uid before ``CMD``. Lambda runs functions as its own unprivileged user whatever
the image says; the USER line makes the image safe to run anywhere else too.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from flatpack.backends.lock import TORCH_CPU_INDEX, committed_lock, lock_problems
from flatpack.compiler import Compiled
from flatpack.errors import InputError
from flatpack.stage.artifact import stage_dirname
from flatpack.platform.catalog import BaseImage, base_image, get_platform
from flatpack.sources import source_files
from flatpack.version import __version__
from flatpack.stage.artifact import serialize
from flatpack.stage.integrity import INDEX_FILE
from flatpack.units import MIB

GIB = 1 << 30
# the modules a function image starts from: the handler its CMD names (aws-lambda: handler.py
# imports it) and the HTTP server around it (alibaba-fc); an image ships these and what they import
FUNCTION_ENTRIES = ("flatpack.runtime.handler", "flatpack.runtime.fc_server")
TORCH_REQUIREMENT = "torch==2.13.0"
# the CPU wheels: the default index's torch pulls gigabytes of CUDA libraries
TORCH_INDEX = TORCH_CPU_INDEX
# what the function's runtime imports; the rest of flatpack's dependencies (solvers) are not needed
RUNTIME_DISTRIBUTIONS = ("numpy", "safetensors", "boto3")
SHARE_IMAGE_BELOW_BYTES = 512 * MIB


@dataclass(frozen=True)
class Flavor:
    """How one platform builds and starts a function image."""

    platform: str
    base_image_bytes: int      # uncompressed, with its source below
    task_root: str
    command: tuple[str, ...]
    pip_target: bool           # install into the task root (Lambda's base image convention)


# Base image sizes are what `docker image ls` reports for these tags (uncompressed); the
# estimate errs high so that an image it passes fits.
FLAVORS = {
    "aws-lambda": Flavor("aws-lambda", 600 * MIB, "/var/task", ("handler.handler",), pip_target=True),
    "alibaba-fc": Flavor("alibaba-fc", 160 * MIB, "/code", ("python", "-m", "flatpack.runtime.fc_server"),
                         pip_target=False),
}
# pip's flags in every image: only the locked files (each checked against its sha256), never an sdist built
PIP_INSTALL = "pip install --no-cache-dir --require-hashes --only-binary=:all:"


@dataclass(frozen=True)
class ImageContext:
    """One image's build context: files by path relative to the context root."""

    stages: tuple[int, ...]
    files: dict[str, bytes]
    estimated_bytes: int

    @property
    def tag(self) -> str:
        """A content hash: equal contexts get equal tags, so an unchanged image is not pushed again."""
        digest = hashlib.sha256()
        for path in sorted(self.files):
            digest.update(path.encode() + b"\0" + hashlib.sha256(self.files[path]).digest())
        return digest.hexdigest()[:20]

    @property
    def name(self) -> str:
        first, last = self.stages[0], self.stages[-1]
        return f"stages-{first:03d}-{last:03d}" if len(self.stages) > 1 else f"stage-{first:03d}"

    def write(self, directory: str | Path) -> Path:
        return write_files(self.files, directory)


def write_files(files: Mapping[str, bytes], directory: str | os.PathLike) -> Path:
    """Writes a build context (files by relative path) under ``directory``; returns it."""
    root = Path(directory)
    for path, data in files.items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return root


def function_images(compiled: Compiled, target: str, *, share_below_bytes: int = SHARE_IMAGE_BELOW_BYTES,
                    base: str | None = None, lock: str | None = None) -> list[ImageContext]:
    """The images a deployment of ``compiled`` on ``target`` needs, checked against the
    platform's image limit before anything is built or pushed.

    ``base``: ``name:tag@sha256:<digest>`` instead of the catalog's base image. ``lock``: a
    hash-locked requirements file's text instead of the committed one; a pin without a hash is
    refused here, before anything is written.
    """
    if target not in FLAVORS:
        raise InputError(f"no function image flavour for target {target!r}; known: {', '.join(FLAVORS)}")
    flavor = FLAVORS[target]
    pinned = base_image(target, base)
    lock_text = committed_lock("function") if lock is None else lock
    check_lock(lock_text)
    artifacts = {artifact.index: {f"artifacts/{stage_dirname(artifact.index)}/{name}": data
                                  for name, data in serialize(artifact).items()}
                 for artifact in compiled.artifacts}
    groups = _share(artifacts, share_below_bytes)
    common = _common_files(flavor, lock_text)
    images = []
    for stages in groups:
        # the index of the whole artifact: a function checks it against the digest in its
        # invocation, then its stage's files against it (runtime/worker.py, docs/security.md)
        files = {**common, f"artifacts/{INDEX_FILE}": compiled.index.raw}
        for index in stages:
            files.update(artifacts[index])
        files["Dockerfile"] = dockerfile(flavor, stages, model_label(compiled), pinned).encode()
        images.append(ImageContext(tuple(stages), files, estimate_image_bytes(flavor, files)))
    check_image_sizes(images, target)
    return images


def image_of(images: Sequence[ImageContext], stage: int | None) -> ImageContext:
    """The image holding the stage's artifact; a profiler function's (stage None) holds them all."""
    return images[0] if stage is None else next(image for image in images if stage in image.stages)


def docker_build_and_push(context: Path, uri: str, *build_flags: str) -> None:
    """``docker build`` for the functions' x86-64 platform, then ``docker push``."""
    subprocess.run(["docker", "build", "--platform", "linux/amd64", *build_flags, "-t", uri, str(context)], check=True)
    subprocess.run(["docker", "push", uri], check=True)


def model_label(compiled: Compiled) -> str:
    """The model's class name, as the generated files name what they deploy."""
    return compiled.info.model_class.rsplit(".", 1)[-1]


def _share(artifacts: dict[int, dict[str, bytes]], share_below_bytes: int) -> list[list[int]]:
    total = sum(len(data) for files in artifacts.values() for data in files.values())
    if total <= share_below_bytes:
        return [sorted(artifacts)]
    return [[index] for index in sorted(artifacts)]


def check_image_sizes(images: Sequence[ImageContext], target: str) -> None:
    limit = get_platform(target).image_limit_bytes
    if limit is None:
        return
    for image in images:
        if image.estimated_bytes > limit:
            baked = sum(len(data) for path, data in image.files.items() if path.startswith("artifacts/"))
            raise InputError(
                f"the image for stage(s) {', '.join(map(str, image.stages))} would be about "
                f"{image.estimated_bytes / GIB:.2f} GB ({baked / GIB:.2f} GB of them stage weights), over "
                f"{target}'s {limit / GIB:.0f} GB container image limit. Cut the model into more stages "
                f"(compile with a larger stages= or a plan whose stages hold less than "
                f"{(limit - (image.estimated_bytes - baked)) / GIB:.1f} GB of weights each). Nothing was deployed")


def estimate_image_bytes(flavor: Flavor, files: dict[str, bytes]) -> int:
    """Base image + installed runtime dependencies + the context's own files."""
    return flavor.base_image_bytes + runtime_dependency_bytes() + sum(len(data) for data in files.values())


@functools.cache
def runtime_dependency_bytes() -> int:
    """What torch and the runtime's other dependencies occupy once installed, measured from
    this interpreter's installation of the same versions (the CPU build of torch is what
    both this machine and the image install). Measured once a process: the sum stats every
    file torch installed (~1 s), and each image of a deployment asked for it again."""
    total = 0
    names = ["torch", *RUNTIME_DISTRIBUTIONS, "botocore", "s3transfer", "jmespath", "urllib3", "python-dateutil"]
    for name in names:
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in files:
            try:
                total += Path(file.locate()).stat().st_size
            except OSError:
                continue
    return total


def check_lock(text: str) -> None:
    """Refuses a requirements file pip's ``--require-hashes`` would refuse, naming each pin."""
    problems = lock_problems(text)
    if problems:
        raise InputError("the image requirements are not hash-locked, so pip --require-hashes would refuse them:\n  "
                         + "\n  ".join(problems) + "\nGenerate a lock with `python -m flatpack.backends.lock "
                         "function` (or pass lock= a file where every pin has --hash=sha256:...). Nothing was written")


def handler_source(flavor: Flavor) -> str:
    return (f'"""Generated by flatpack {__version__}: the {flavor.platform} entry point. The body is the\n'
            'local function\'s (flatpack.runtime.worker), so a stage computes the same on every backend."""\n\n'
            "from flatpack.runtime.handler import handle as handler\n\n"
            '__all__ = ["handler"]\n')


def base_comment(base: BaseImage) -> list[str]:
    """The Dockerfile lines that say which base image, read where and when, and how to refresh it."""
    return [f"# base: {base.name}, digest as of {base.observed} from {base.source}",
            f"# refresh: docker buildx imagetools inspect {base.name}  (then --base-image {base.name}@sha256:...)"]


def dockerfile(flavor: Flavor, stages: Sequence[int], model: str, base: BaseImage) -> str:
    root = flavor.task_root
    pip_target = f' --target "{root}"' if flavor.pip_target else ""
    lines = [
        f"# generated by flatpack {__version__}: {flavor.platform} image for stage(s) "
        f"{', '.join(map(str, stages))} of {model}",
        *base_comment(base),
        f"FROM {base.reference}",
    ]
    if not flavor.pip_target:
        lines.append(f"WORKDIR {root}")
    lines += [
        f"COPY requirements.txt {root}/",
        f"RUN {PIP_INSTALL} -r {root}/requirements.txt{pip_target}",
        f"COPY flatpack/ {root}/flatpack/",
        f"COPY artifacts/ {root}/artifacts/",
        f"COPY handler.py {root}/",
        # COPY makes root the owner; whatever mode the context had, nobody else may write
        f"RUN chmod -R go-w {root}",
        # HOME: a writable place for anything that caches (the root filesystem may be read-only)
        f"ENV FLATPACK_ARTIFACTS={root}/artifacts PYTHONPATH={root} HOME=/tmp",
        f"USER {base.user}",
    ]
    if not flavor.pip_target:
        lines.append("EXPOSE 9000")
    lines.append("CMD [" + ", ".join(f'"{part}"' for part in flavor.command) + "]")
    return "\n".join(lines) + "\n"


def _common_files(flavor: Flavor, lock_text: str) -> dict[str, bytes]:
    return {"requirements.txt": lock_text.encode(), "handler.py": handler_source(flavor).encode(),
            **runtime_sources()}


def runtime_sources(entries: Sequence[str] = FUNCTION_ENTRIES) -> dict[str, bytes]:
    """flatpack's Python source an image needs, by ``flatpack/...`` path: the modules its
    entry points import, directly or not (:func:`flatpack.sources.closure`), and no other, so
    the compiler, the solvers and the backends stay out of every function. Pure Python, so a
    copy runs wherever torch does."""
    return source_files(entries)


def check_context(files: dict[str, bytes]) -> list[str]:
    """What would make ``docker build`` of this context fail or build the wrong thing; empty
    when the context is sound. Checked statically: no Docker engine is needed."""
    problems = []
    if "Dockerfile" not in files:
        return ["the context has no Dockerfile"]
    lines = [line.strip() for line in files["Dockerfile"].decode().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    if not lines or not lines[0].startswith("FROM "):
        problems.append("the Dockerfile does not start with FROM")
    problems += hardening_problems(lines)
    problems += copy_problems(files)
    command = [line for line in lines if line.startswith("CMD ")]
    if not command:
        problems.append("the Dockerfile has no CMD")
    else:
        problems += _check_command(command[-1], files)
    requirements_text = files.get("requirements.txt", b"").decode()
    problems += [f"requirements.txt: {problem}" for problem in lock_problems(requirements_text)]
    if not any(pin.split("+")[0] == TORCH_REQUIREMENT for pin in requirements_text.split()):
        problems.append(f"requirements.txt does not pin {TORCH_REQUIREMENT}")
    for path, data in files.items():
        if path.endswith(".py"):
            problem = _compile_problem(data, path)
            if problem is not None:
                problems.append(problem)
    return problems


@functools.lru_cache(maxsize=1024)
def _compile_problem(source: bytes, path: str) -> str | None:
    """Why ``source`` would not compile as the module at ``path``; None when it compiles.
    Keyed by the bytes themselves: every context checked ships the same ~100 flatpack files,
    and compiling them again was a second or more of each check."""
    try:
        compile(source, path, "exec", dont_inherit=True)
    except SyntaxError as err:
        return f"{path} does not compile: {err}"
    return None


_DIGEST_REF = re.compile(r"^\S+@sha256:[0-9a-f]{64}$")


def hardening_problems(lines: Sequence[str]) -> list[str]:
    """What in a Dockerfile's instructions (comments dropped) breaks the image hardening:
    a base not pinned by digest, pip without ``--require-hashes``, files handed to the runtime
    user (``--chown``), or a final user that is root (or none: Docker's default is root)."""
    problems = []
    for line in lines:
        words = line.split()
        keyword = words[0].upper() if words else ""
        if keyword == "FROM":
            image = next((word for word in words[1:] if not word.startswith("--")), "")
            if not _DIGEST_REF.match(image):
                problems.append(f"the base image {image} is not pinned by digest (name@sha256:<64 hex>)")
        if keyword == "RUN" and re.search(r"\bpip3? install\b", line) and "--require-hashes" not in line:
            problems.append(f"pip installs without --require-hashes: {line}")
        if keyword in ("COPY", "ADD") and any(word.startswith("--chown") for word in words):
            problems.append(f"{line}: files must stay root's (no --chown), so the runtime user cannot change them")
    users = [line.split(None, 1)[1].strip() if len(line.split()) > 1 else "" for line in lines
             if line.split()[0].upper() == "USER"]
    if not users:
        problems.append("the Dockerfile sets no USER: the image would run as root")
    elif users[-1].split(":")[0] in ("root", "0", ""):
        problems.append(f"the image's final USER is {users[-1]!r}: it must be an unprivileged user")
    return problems


def copy_problems(files: Mapping[str, bytes]) -> list[str]:
    """The sources the Dockerfile's COPY instructions name (any number per instruction, flags
    such as ``--chown`` aside) that the context lacks. A source ending in ``/`` must be a
    directory; any other may be a file or a directory, as Docker takes either."""
    if "Dockerfile" not in files:
        return ["the context has no Dockerfile"]
    problems = []
    for line in files["Dockerfile"].decode().splitlines():
        words = line.split()
        if not words or words[0].upper() != "COPY":
            continue
        for source in (word for word in words[1:-1] if not word.startswith("--")):
            directory = source.rstrip("/") + "/"
            if source.endswith("/"):
                if not any(path.startswith(directory) for path in files):
                    problems.append(f"COPY {source}: the context has no such directory")
            elif source not in files and not any(path.startswith(directory) for path in files):
                problems.append(f"COPY {source}: the context has no such file or directory")
    return problems


def _check_command(line: str, files: dict[str, bytes]) -> list[str]:
    try:
        parts = ast.literal_eval(line[4:].strip())
    except (ValueError, SyntaxError):
        return [f"CMD is not an exec-form JSON list: {line}"]
    if len(parts) == 1:   # Lambda: "module.function"
        module, _, function = parts[0].rpartition(".")
        source = files.get(f"{module.replace('.', '/')}.py")
        if source is None:
            return [f"CMD names handler {parts[0]} but the context has no {module}.py"]
        if function not in source.decode():
            return [f"CMD names handler {parts[0]} but {module}.py defines no {function}"]
        return []
    if parts[:2] == ["python", "-m"]:
        module_path = f"{parts[2].replace('.', '/')}.py"
        if module_path not in files:
            return [f"CMD runs module {parts[2]} but the context has no {module_path}"]
    return []
