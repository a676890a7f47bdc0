"""The one reader of JSON-object files (config.json, manifests, metrics). Depends on json alone, so the
stand-alone trace recorder can use it too."""

from __future__ import annotations

import json
from pathlib import Path


def read_object(path: Path, error: type[Exception]) -> dict:
    """The JSON object in `path`; `error` (the caller's user-facing exception) with one line naming the file when
    it cannot be read, is not JSON, or holds something other than an object."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise error(f"{path} cannot be read ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise error(f"{path} must hold a JSON object")
    return obj


class _Unreadable(Exception):
    pass


def read_object_or_none(path: Path) -> dict | None:
    """The JSON object in `path`, or None when it is missing, unreadable or not an object (optional files)."""
    try:
        return read_object(path, _Unreadable)
    except _Unreadable:
        return None


__all__ = ["read_object", "read_object_or_none"]
