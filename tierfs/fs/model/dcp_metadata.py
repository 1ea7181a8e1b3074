"""Which files a PyTorch DCP checkpoint consists of, read from its `.metadata` without torch.

`.metadata` is a pickle that other processes wrote, so it is read with an allowlist unpickler:
only the classes DCP's metadata is made of are accepted, and each is replaced by an inert
stand-in that records its arguments and state and runs no code. From the stand-ins, the
`storage_data` map gives every shard file's relative path.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

ALLOWED_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed.checkpoint.filesystem",
    "torch.distributed.checkpoint.planner",
    "torch.distributed.checkpoint._extension",
    "torch.serialization",
    "torch",
    "pathlib",
    "collections",
)
ALLOWED_BUILTINS = {"set", "frozenset", "tuple", "list", "dict", "bytes", "bytearray"}
MAX_METADATA = 256 << 20


class MetadataError(Exception):
    """Not DCP metadata we can read; the step commits with the files at hand."""


class Inert:
    """Stands in for any allowed class: keeps what pickle hands it, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Inert:
        instance = super().__new__(cls)
        instance.__dict__["_args"] = args
        return instance

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.__dict__["_state"] = state

    def __hash__(self) -> int:
        return id(self)

    def state(self) -> dict[str, Any]:
        state = self.__dict__.get("_state")
        if isinstance(state, tuple) and state and isinstance(state[-1], dict):
            state = {**(state[0] or {}), **state[-1]} if isinstance(state[0], dict) \
                else state[-1]
        return state if isinstance(state, dict) else {}


class _Unpickler(pickle.Unpickler):
    _classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in ALLOWED_BUILTINS:
            return __builtins__[name] if isinstance(__builtins__, dict) else getattr(
                __builtins__, name)
        if not module.startswith(ALLOWED_MODULES):
            raise MetadataError(f"{module}.{name} is not part of DCP metadata")
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = type(name, (Inert,), {"__module__": "tierfs.inert"})
        return self._classes[key]


def shard_files(data: bytes) -> set[str]:
    """Relative paths of every file DCP's metadata says the checkpoint stores data in."""
    if len(data) > MAX_METADATA:
        raise MetadataError("metadata too large")
    try:
        metadata = _Unpickler(io.BytesIO(data)).load()
    except MetadataError:
        raise
    except Exception as exc:  # a truncated or foreign pickle fails in many ways
        raise MetadataError(f"unreadable metadata: {exc}") from None
    if not isinstance(metadata, Inert):
        raise MetadataError("not a DCP Metadata object")
    storage = metadata.state().get("storage_data")
    if not isinstance(storage, dict):
        raise MetadataError("DCP metadata without storage_data")
    paths = set()
    for info in storage.values():
        path = info.state().get("relative_path") if isinstance(info, Inert) else None
        if not isinstance(path, str):
            raise MetadataError("storage_data entry without a relative path")
        paths.add(path)
    return paths
