"""The torch calls a CUDAPluggableAllocator cannot serve, made to say what to do instead.

torch routes only malloc, free and a few hooks to a pluggable allocator; memory pools
(torch.cuda.MemPool), CUDA graph trees' checkpoints (torch.compile(mode="reduce-overhead")), CUDA
IPC (torch.multiprocessing) and torch's own snapshot and history raise there with torch's
"... does not yet support ..." RuntimeError. Under install(mode="pluggable") each such entry
point is wrapped so that the same RuntimeError also names vramledger's torch-native mode, which
serves all of them (docs/design/torch-native-mode.md).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

_HINT = ("vramledger is installed through torch's CUDAPluggableAllocator (mode='pluggable'), "
         "which torch does not route {what} to; vramledger.install(mode='native') (the default "
         "when its library matches this torch) serves it")

# (owner path from torch, attribute, what it is) of each entry point wrapped.
_ENTRY_POINTS = (
    ("cuda.memory.MemPool", "__init__", "torch.cuda.MemPool"),
    ("_C", "_cuda_getCheckpointState", "CUDA graph trees (torch.compile reduce-overhead)"),
    ("_C", "_cuda_setCheckpointPoolState", "CUDA graph trees (torch.compile reduce-overhead)"),
    ("_C", "_cuda_checkPoolLiveAllocations", "CUDA graph trees (torch.compile reduce-overhead)"),
    ("UntypedStorage", "_share_cuda_", "CUDA IPC (sending a CUDA tensor to another process)"),
    ("cuda.memory", "_snapshot", "torch.cuda.memory._snapshot (use vramledger.snapshot())"),
    ("cuda.memory", "_record_memory_history",
     "torch.cuda.memory._record_memory_history (use vramledger.record_memory_history())"),
)

# Originals, by (owner path, attribute), so that wrapping twice wraps once.
_originals: dict[tuple[str, str], Any] = {}


def explains(error: BaseException) -> bool:
    """True for torch's refusal of a call its pluggable allocator cannot serve."""
    text = str(error)
    return "does not yet support" in text or "not supported" in text or "CUDAPluggable" in text


def wrap(function: Callable[..., Any], what: str) -> Callable[..., Any]:
    """`function`, re-raising torch's pluggable-allocator refusal as a RuntimeError that names
    the native mode (chained to torch's error); every other outcome passes unchanged."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except RuntimeError as e:
            if not explains(e):
                raise
            raise RuntimeError(f"{e}\n{_HINT.format(what=what)}") from e

    wrapper.__vramledger_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _owner(torch: Any, path: str) -> Any:
    owner = torch
    for part in path.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def install(torch: Any) -> list[str]:
    """Wraps every entry point of _ENTRY_POINTS that this torch has; returns their names."""
    wrapped = []
    for path, name, what in _ENTRY_POINTS:
        owner = _owner(torch, path)
        original = getattr(owner, name, None) if owner is not None else None
        if original is None:
            continue
        if not getattr(original, "__vramledger_wrapped__", False):
            _originals[(path, name)] = original
            setattr(owner, name, wrap(original, what))
        wrapped.append(f"torch.{path}.{name}")
    return wrapped
