"""Nested input and output structures as JSON, so a loaded artifact rebuilds them without pickle.

A structure is a tree whose leaves are either ``{"leaf": i}`` (the i-th flat value) or
``{"const": v}`` (a JSON constant such as None). Inner nodes come from a closed vocabulary,
because an artifact's ``flatpack.json`` is data and data must never name code to run:

* ``{"tuple": [...]}``, ``{"list": [...]}``, ``{"dict": [...], "keys": [...]}``;
* a named tuple, described field by field: ``{"tuple": [...], "namedtuple": {"name", "fields"}}``,
  rebuilt as a ``collections.namedtuple`` of that name and those fields;
* a dict or tuple subclass named by ``"class"``, rebuilt as that class only when it is on the
  allowlist: classes registered with :func:`allow` (``compile`` registers the output classes
  of the models it traces in this process, which are already imported), ``OrderedDict``, and
  HuggingFace ``ModelOutput`` subclasses, found by attribute lookup below the ``transformers``
  package and checked to be ``ModelOutput`` subclasses. Anything else is an ArtifactError.

Nothing here imports a module named by a string (``tests/security/test_no_import_from_data.py``).
"""

from __future__ import annotations

import collections
import keyword
import re
from typing import Any, Callable

import torch.utils._pytree as pytree

from flatpack.errors import ArtifactError

_JSON_CONSTANTS = (type(None), bool, int, float, str)
_IDENTIFIER = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
# "module.path:Qual.Name" with public identifier parts only
_DOTTED = r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z][A-Za-z0-9_]*)*"
_CLASS_PATH = re.compile(f"{_DOTTED}:{_DOTTED}")
_ALLOWED: dict[str, type] = {"collections:OrderedDict": collections.OrderedDict}
_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def allow(cls: type) -> type:
    """Puts a dict or tuple subclass on the allowlist of output classes that structures may
    name (usable as a decorator). ``compile`` calls it for the models it traces."""
    if not isinstance(cls, type) or not issubclass(cls, (dict, tuple)):
        raise TypeError(f"only dict and tuple subclasses can rebuild outputs, not {cls!r}")
    _ALLOWED[_class_path(cls)] = cls
    return cls


def _model_output_class(path: str) -> type | None:
    """A HuggingFace ``ModelOutput`` subclass below the ``transformers`` package, by attribute
    lookup from the package (no import by name); None when transformers is not installed."""
    module_path, _, qualname = path.partition(":")
    parts = module_path.split(".")
    if parts[0] != "transformers" or any(part.startswith("_") for part in [*parts, *qualname.split(".")]):
        return None
    try:   # optional dependency: HuggingFace transformers (pip install 'flatpack[hf]')
        import transformers
        from transformers.utils.generic import ModelOutput
    except ImportError:
        return dict   # data-only fallback: the outputs come back as a plain dict
    obj: Any = transformers
    try:
        for part in [*parts[1:], *qualname.split(".")]:
            obj = getattr(obj, part)
    except (AttributeError, ImportError):
        return None
    return obj if isinstance(obj, type) and issubclass(obj, ModelOutput) else None


def resolve_class(path: object, kind: type, where: str) -> type:
    """The allowlisted class ``path`` names, which must subclass ``kind`` (dict or tuple)."""
    if not isinstance(path, str) or not _CLASS_PATH.fullmatch(path):
        raise ArtifactError(f"{where} names the output class {str(path)[:100]!r}, which is not a class path "
                            "(module:Name); the artifact is corrupted or hostile. Recompile the model.")
    cls = _ALLOWED.get(path) or (_model_output_class(path) if kind is dict else None)
    if cls is None or not issubclass(cls, kind):
        raise ArtifactError(
            f"{where} names the output class {path!r}, which flatpack will not rebuild: outputs are rebuilt only "
            f"as tuples, lists, dicts, named tuples described field by field, HuggingFace ModelOutput classes and "
            f"classes registered with flatpack.ir.structure.allow(). If this artifact is yours, register the class "
            f"before loading; otherwise do not run it (a structure naming arbitrary code is an attack).")
    return cls


def _namedtuple(description: object, where: str) -> type:
    if not isinstance(description, dict):
        raise ArtifactError(f"{where} has a malformed named tuple description; recompile the model")
    name, fields = description.get("name"), description.get("fields")
    if not (isinstance(name, str) and isinstance(fields, list) and _valid_namedtuple(name, fields)):
        raise ArtifactError(f"{where} describes a named tuple {str(name)[:60]!r} with fields {str(fields)[:120]}, "
                            "which are not distinct identifiers; the artifact is corrupted. Recompile the model.")
    key = (name, tuple(fields))
    if key not in _NAMEDTUPLES:
        _NAMEDTUPLES[key] = collections.namedtuple(name, fields)  # type: ignore[misc]
    return _NAMEDTUPLES[key]


def _valid_namedtuple(name: str, fields: list) -> bool:
    """Whether a named tuple's name and fields are distinct identifiers, none a keyword."""
    return bool(_IDENTIFIER.fullmatch(name)) and all(
        isinstance(field, str) and _IDENTIFIER.fullmatch(field) and not keyword.iskeyword(field) for field in fields
    ) and len(set(fields)) == len(fields) and not keyword.iskeyword(name)


def from_treespec(spec: pytree.TreeSpec, leaves: list[Any] | None = None) -> dict:
    """Converts a torch pytree spec to the JSON structure, numbering leaves in order.

    ``leaves`` (optional) are the flat values; a JSON-able constant among them becomes a
    ``const`` and the remaining leaves are numbered consecutively.
    """
    positions = iter(range(spec.num_leaves))
    numbers = iter(range(spec.num_leaves))

    def walk(node: pytree.TreeSpec) -> dict:
        if node.is_leaf():
            position = next(positions)
            if leaves is not None and is_constant(leaves[position]):
                return {"const": leaves[position]}
            return {"leaf": next(numbers)}
        children = [walk(child) for child in node.children()]
        if node.type in (tuple, list):
            return {node.type.__name__: children}
        named = node.context if isinstance(node.context, type) else node.type
        fields = getattr(named, "_fields", None)
        if isinstance(named, type) and issubclass(named, tuple) and fields is not None:
            # pytree's namedtuple node: described field by field; the class itself is
            # already imported (the model returned it), so this process may rebuild it as such
            allow(named)
            return {"tuple": children, "namedtuple": {"name": named.__name__, "fields": list(fields)},
                    "class": _class_path(named)}
        if isinstance(node.type, type) and issubclass(node.type, dict):
            keys = list(node.context) if not isinstance(node.context, type) else []
            if node.type is dict:
                return {"dict": children, "keys": keys, "class": None}
            if _model_output_class(_class_path(node.type)) is None:
                allow(node.type)
            return {"dict": children, "keys": keys, "class": _class_path(node.type)}
        if isinstance(node.type, type) and issubclass(node.type, tuple):
            allow(node.type)
            return {"tuple": children, "class": _class_path(node.type)}
        return {"tuple": children, "class": None, "was": _class_path(node.type)}

    return walk(spec)


def is_constant(value: Any) -> bool:
    return isinstance(value, _JSON_CONSTANTS)


def leaf_indices(structure: dict) -> list[int]:
    found: list[int] = []

    def walk(node: dict) -> None:
        if "leaf" in node:
            found.append(node["leaf"])
        for key in ("tuple", "list", "dict"):
            for child in node.get(key, ()):
                walk(child)

    walk(structure)
    return found


def check(structure: object, where: str) -> None:
    """Raises ArtifactError unless ``structure`` uses only the closed vocabulary (every class
    it names resolves on the allowlist). ``load`` calls it before any stage is built."""
    # resolve and validate only: constructing a class with placeholder values proves nothing
    _rebuild(structure, lambda index: None, where, build=False)


def rebuild(structure: dict, leaf: Callable[[int], Any], where: str = "the output structure") -> Any:
    """Rebuilds the nested value; ``leaf(i)`` supplies the i-th flat value. ``where`` names
    the structure's origin in errors."""
    return _rebuild(structure, leaf, where, build=True)


def _rebuild(structure: object, leaf: Callable[[int], Any], where: str, build: bool) -> Any:
    if not isinstance(structure, dict):
        raise ArtifactError(f"{where} has a node {str(structure)[:80]!r} that is not an object; recompile the model")
    if "leaf" in structure:
        if not isinstance(structure["leaf"], int) or isinstance(structure["leaf"], bool):
            raise ArtifactError(f"{where} has a leaf {structure['leaf']!r} that is not an index; recompile the model")
        return leaf(structure["leaf"])
    if "const" in structure:
        if not is_constant(structure["const"]):
            raise ArtifactError(f"{where} has a constant that is not a JSON scalar; recompile the model")
        return structure["const"]
    if "list" in structure:
        return [_rebuild(child, leaf, where, build) for child in _children(structure, "list", where)]
    if "dict" in structure:
        values = [_rebuild(child, leaf, where, build) for child in _children(structure, "dict", where)]
        keys = structure.get("keys")
        if not isinstance(keys, list) or len(keys) != len(values) or not all(is_constant(k) for k in keys):
            raise ArtifactError(f"{where} has a dict whose keys do not match its values; recompile the model")
        as_dict = dict(zip(keys, values))
        if structure.get("class") is None:
            return as_dict
        cls = resolve_class(structure["class"], dict, where)
        return _construct(cls, where, build, **as_dict) if cls is not dict else as_dict
    if "tuple" in structure:
        items = [_rebuild(child, leaf, where, build) for child in _children(structure, "tuple", where)]
        if "namedtuple" in structure:
            described = _namedtuple(structure["namedtuple"], where)
            path = structure.get("class")
            live = _ALLOWED.get(path) if isinstance(path, str) else None
            # the model's own class when this process traced it, else one rebuilt from the description
            same = live is not None and getattr(live, "_fields", None) == described._fields
            return _construct(live if live is not None and same else described, where, build, *items)
        if structure.get("class") is None:
            return tuple(items)
        cls = resolve_class(structure["class"], tuple, where)
        # a named tuple takes its fields as arguments; a structseq (torch.return_types) one sequence
        return _construct(cls, where, build, *items) if hasattr(cls, "_fields") else _construct(cls, where, build,
                                                                                                 items)
    raise ArtifactError(f"{where} has a node with keys {sorted(structure)[:5]}, which is none of leaf, const, "
                        "tuple, list or dict; recompile the model")


def _construct(cls: type, where: str, build: bool, *args: Any, **kwargs: Any) -> Any:
    """An allowlisted class built from the structure's values; wrong fields are the artifact's fault."""
    if not build:
        return None
    try:
        return cls(*args, **kwargs)
    except (TypeError, ValueError) as err:
        raise ArtifactError(f"{where}: the output class {cls.__qualname__} cannot be rebuilt from the recorded "
                            f"fields ({err}); the artifact is corrupted or from another version. Recompile.") from None


def _children(structure: dict, kind: str, where: str) -> list:
    children = structure[kind]
    if not isinstance(children, list):
        raise ArtifactError(f"{where} has a {kind} node whose children are not a list; recompile the model")
    return children
