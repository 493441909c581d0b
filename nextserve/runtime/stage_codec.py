"""The wire format of step messages between pipeline stages: JSON with tagged tuples, int64 arrays and the
few step dataclasses, nothing else.

# NOTE: the stages' Gloo store listens on a local port that any local user can reach. Step messages were
# pickled, and unpickling what arrives there runs whatever it names; JSON decoding can only build the
# values below, so a forged message fails a step, never runs code.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from typing import Any

import numpy as np

_TYPES: dict[str, type] = {}


def wire_type(cls: type) -> type:
    """Registers a dataclass whose instances may travel (their fields must be wire values too)."""
    _TYPES[cls.__name__] = cls
    return cls


def _encode(v: Any) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, list):
        return [_encode(x) for x in v]
    if isinstance(v, tuple | range):
        return {"t": "tuple", "v": [_encode(x) for x in v]}
    if isinstance(v, np.ndarray):
        if v.dtype != np.int64:
            raise TypeError(f"only int64 arrays travel between stages, not {v.dtype}")
        data = base64.b64encode(np.ascontiguousarray(v).tobytes()).decode()
        return {"t": "int64", "shape": list(v.shape), "v": data}
    if dataclasses.is_dataclass(v) and _TYPES.get(type(v).__name__) is type(v):
        fields = {f.name: _encode(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return {"t": type(v).__name__, "v": fields}
    raise TypeError(f"a {type(v).__name__} cannot travel between stages")


def _decode(v: Any) -> Any:
    if isinstance(v, list):
        return [_decode(x) for x in v]
    if not isinstance(v, dict):
        return v
    tag, value = v.get("t"), v.get("v")
    if tag == "tuple":
        return tuple(_decode(x) for x in value)
    if tag == "int64":
        return np.frombuffer(base64.b64decode(value), dtype=np.int64).reshape(v["shape"]).copy()
    cls = _TYPES.get(tag)
    if cls is None or not isinstance(value, dict):
        raise ValueError(f"not a step message: unknown value tag {tag!r}")
    return cls(**{k: _decode(x) for k, x in value.items()})


def dumps(obj: Any) -> bytes:
    return json.dumps(_encode(obj), separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    return _decode(json.loads(data))
