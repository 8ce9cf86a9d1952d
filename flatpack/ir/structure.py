"""Nested input and output structures as JSON, so a loaded artifact rebuilds them without pickle.

A structure is a tree whose leaves are either ``{"leaf": i}`` (the i-th flat value) or
``{"const": v}`` (a JSON constant such as None). Inner nodes are tuples, lists and dicts;
a dict subclass (a HuggingFace ``ModelOutput``) or a namedtuple remembers its class path
and is rebuilt as that class when it can be imported, else as a plain dict or tuple.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch.utils._pytree as pytree

_JSON_CONSTANTS = (type(None), bool, int, float, str)


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _import_class(path: str | None) -> type | None:
    if not path:
        return None
    module_name, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        return None
    return obj if isinstance(obj, type) else None


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
        if isinstance(node.context, type) and issubclass(node.context, tuple) and hasattr(node.context, "_fields"):
            return {"tuple": children, "class": _class_path(node.context)}  # pytree's namedtuple node
        if isinstance(node.type, type) and issubclass(node.type, dict):
            keys = list(node.context) if not isinstance(node.context, type) else []
            cls = None if node.type is dict else _class_path(node.type)
            return {"dict": children, "keys": keys, "class": cls}
        if isinstance(node.type, type) and issubclass(node.type, tuple):
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


def rebuild(structure: dict, leaf: Callable[[int], Any]) -> Any:
    """Rebuilds the nested value; ``leaf(i)`` supplies the i-th flat value."""
    if "leaf" in structure:
        return leaf(structure["leaf"])
    if "const" in structure:
        return structure["const"]
    if "list" in structure:
        return [rebuild(child, leaf) for child in structure["list"]]
    if "dict" in structure:
        values = [rebuild(child, leaf) for child in structure["dict"]]
        as_dict = dict(zip(structure["keys"], values))
        cls = _import_class(structure.get("class"))
        return cls(**as_dict) if cls is not None else as_dict
    items = [rebuild(child, leaf) for child in structure["tuple"]]
    cls = _import_class(structure.get("class"))
    if cls is not None and hasattr(cls, "_fields"):
        return cls(*items)
    return tuple(items)
