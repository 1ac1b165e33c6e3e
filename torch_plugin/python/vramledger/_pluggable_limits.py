"""The torch calls a CUDAPluggableAllocator cannot serve, made to say what to do instead.

torch routes only malloc, free and a few hooks to a pluggable allocator; memory pools
(torch.cuda.MemPool), CUDA graph trees' checkpoints (torch.compile(mode="reduce-overhead")), CUDA
IPC (torch.multiprocessing) and torch's own snapshot and history raise there with torch's
"... does not yet support ..." RuntimeError. Under install(mode="pluggable") each such entry
point is wrapped so that the same RuntimeError also names vramledger's torch-native mode, which
serves all of them (docs/design/torch-native-mode.md).

One call torch does not refuse but ends the process on: ProcessGroupNCCL with
TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK on attaches a trace tracker to the allocator, the
pluggable allocator refuses it while the process group's threads are running, and the process
ends with "terminate called without an active exception". Under the pluggable route, creating a
NCCL process group with that variable on is therefore refused before torch starts it.
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

# (owner path, attribute, position of `backend`) of each function that creates process groups.
_GROUP_MAKERS = (("distributed", "init_process_group", 0), ("distributed", "new_group", 2))
_HOOK_VARIABLE = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"

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


def _register_hook_on() -> bool:
    import os
    return os.environ.get(_HOOK_VARIABLE, "0").strip().lower() in ("1", "true", "yes", "y", "on")


def _may_use_nccl(args: tuple, kwargs: dict, position: int) -> bool:
    backend = kwargs.get("backend", args[position] if len(args) > position else None)
    # No backend: torch picks NCCL for CUDA devices.
    return backend is None or "nccl" in str(backend).lower()


def refuse_register_hook(function: Callable[..., Any], position: int) -> Callable[..., Any]:
    """`function` (a process-group maker), refusing with a RuntimeError before it runs when the
    group may use NCCL and NCCL's allocator register hook is on; otherwise unchanged."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _register_hook_on() and _may_use_nccl(args, kwargs, position):
            raise RuntimeError(
                f"{_HOOK_VARIABLE}=1 makes ProcessGroupNCCL attach a trace tracker to the CUDA "
                "allocator, which torch cannot route to a pluggable allocator (torch would end "
                "the process); unset it, or " + _HINT.format(what="allocator trace trackers"))
        return function(*args, **kwargs)

    wrapper.__vramledger_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def _owner(torch: Any, path: str) -> Any:
    owner = torch
    for part in path.split("."):
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    return owner


def _replace(torch: Any, path: str, name: str,
             make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replaces torch.<path>.<name> by make(original) once; False when this torch lacks it."""
    owner = _owner(torch, path)
    original = getattr(owner, name, None) if owner is not None else None
    if original is None:
        return False
    if not getattr(original, "__vramledger_wrapped__", False):
        _originals[(path, name)] = original
        setattr(owner, name, make(original))
    return True


def install(torch: Any) -> list[str]:
    """Wraps every entry point of _ENTRY_POINTS and _GROUP_MAKERS that this torch has; returns
    their names."""
    wrapped = []
    for path, name, what in _ENTRY_POINTS:
        if _replace(torch, path, name, lambda f, what=what: wrap(f, what)):
            wrapped.append(f"torch.{path}.{name}")
    for path, name, position in _GROUP_MAKERS:
        if _replace(torch, path, name, lambda f, p=position: refuse_register_hook(f, p)):
            wrapped.append(f"torch.{path}.{name}")
    return wrapped
