"""The user's own code, named on the command line: ``MODEL`` and ``--data`` as
``path/to/file.py:name`` or ``package.module:name``. The one place flatpack imports a module a
user names; what it imports is never read from an artifact or a run record
(docs/security.md, ``tests/security/test_no_import_from_data.py``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable

from flatpack.errors import InputError


def import_factory(spec: str, flag: str) -> Callable[..., Any]:
    """The callable ``spec`` names; ``flag`` (``MODEL``, ``--data``) names the option in errors.
    A file's directory goes on ``sys.path`` so that it can import its neighbours."""
    source, colon, attribute = spec.rpartition(":")
    if not colon or not source or not attribute:
        raise InputError(f"{flag} {spec!r} must be path/to/file.py:name or package.module:name")
    if source.endswith(".py"):
        path = Path(source)
        if not path.is_file():
            raise InputError(f"{flag} {spec}: no such file {path}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise InputError(f"{flag} {spec}: {path} cannot be imported as a Python module; name a .py file")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.parent.resolve()))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as err:
            raise InputError(f"{flag} {spec}: cannot import {source!r} ({err})") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise InputError(f"{flag} {spec}: {source} has no callable {attribute!r}")
    return factory
