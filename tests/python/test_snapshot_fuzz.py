# Property-based tests (hypothesis) of the snapshot reader (vramledger/_snapshot.py): a malformed,
# truncated or foreign file gives SnapshotFormatError (a ValueError naming the file), never a
# traceback from inside; a file it accepts is one `vramledger inspect` and diff can read.
"""Malformed snapshots: a clear error, or a snapshot every reader of the package can use."""

from __future__ import annotations

import copy
import gzip
import json
import os
import pickle
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vramledger import _inspect, _snapshot

# VRAMLEDGER_HYPOTHESIS_EXAMPLES raises the count for a long run; CI runs a fixed sequence.
EXAMPLES = int(os.environ.get("VRAMLEDGER_HYPOTHESIS_EXAMPLES", "150"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=EXAMPLES <= 150,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MIB = 1 << 20

FRAME = {"filename": "train.py", "line": 12, "name": "forward"}
BASE = {
    "segments": [{
        "device": 0, "address": 0x7F0000000000, "total_size": 20 * MIB, "allocated_size": 2 * MIB,
        "active_size": 2 * MIB, "requested_size": 2 * MIB - 5, "stream": 0,
        "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
        "frames": [FRAME],
        "blocks": [
            {"address": 0x7F0000000000, "size": 2 * MIB, "requested_size": 2 * MIB - 5,
             "state": "active_allocated", "frames": [FRAME]},
            {"address": 0x7F0000200000, "size": 18 * MIB, "requested_size": 0,
             "state": "inactive", "frames": []},
        ],
    }],
    "device_traces": [[
        {"action": "segment_alloc", "addr": 0x7F0000000000, "size": 20 * MIB, "stream": 0,
         "time_us": 1, "frames": [FRAME]},
        {"action": "alloc", "addr": 0x7F0000000000, "size": 2 * MIB - 5, "stream": 0,
         "time_us": 2, "frames": [FRAME]},
        {"action": "oom", "addr": 0, "size": 1 << 40, "stream": 0, "device_free": 3 * MIB,
         "time_us": 3, "frames": []},
    ]],
    "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    "external_annotations": [],
    "vramledger": {"history": {"enabled": "all"},
                   "devices": [{"device": 0, "stats": {"allocated_bytes.all.peak": 2 * MIB,
                                                        "utilization": 0.5}}]},
}

# Any value a pickle of plain types or a JSON document can hold, odd numbers included.
LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
          | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                      | st.tuples(inner, inner)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


def _paths(value, prefix=()):
    """Every path (sequence of keys and indices) to a value inside `value`."""
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


@st.composite
def mutated(draw):
    """BASE with a few values replaced or keys deleted, anywhere in it."""
    snap = copy.deepcopy(BASE)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p in _paths(snap) if p]
        path = draw(st.sampled_from(paths))
        parent = snap
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, tuple):
            continue  # a tuple is replaced as a whole through its own parent
        if isinstance(parent, dict) and draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = draw(VALUES)
    return snap


def _encode(snap, fmt: str) -> bytes:
    if fmt == "json":
        return json.dumps(snap, default=list, allow_nan=True).encode()
    return pickle.dumps(snap, protocol=4)


def _check(data: bytes) -> None:
    """load_snapshot accepts `data` and the readers use it, or refuses it with a clear error."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snap.pickle")
        with open(path, "wb") as f:
            f.write(data)
        try:
            snap = _snapshot.load_snapshot(path)
        except _snapshot.SnapshotFormatError as e:
            assert isinstance(e, ValueError)
            assert str(e).startswith(path + ": "), str(e)
            return
    # Accepted: every reader of a loaded snapshot works on it.
    summary = _inspect.summarize(snap)
    _inspect.format_summary(summary, "snap.pickle")
    for device in _inspect.devices_of(snap):
        _inspect.timeline(snap, device)
    _inspect.format_diff(_inspect.diff(snap, snap), "a", "b")


@SETTINGS
@given(snap=mutated(), fmt=st.sampled_from(["pickle", "json"]), compress=st.booleans())
def test_mutated_snapshot_loads_or_is_refused_clearly(snap, fmt, compress):
    data = _encode(snap, fmt)
    _check(gzip.compress(data, mtime=0) if compress else data)


@SETTINGS
@given(fmt=st.sampled_from(["pickle", "json"]), compress=st.booleans(), cut=st.floats(0, 1))
def test_truncated_snapshot_is_refused_clearly(fmt, compress, cut):
    data = _encode(BASE, fmt)
    if compress:
        data = gzip.compress(data, mtime=0)
    _check(data[:int(len(data) * cut)])


@SETTINGS
@given(data=st.binary(max_size=300), prefix=st.sampled_from([b"", b"\x80\x04", b"{", b"[",
                                                                b"\x1f\x8b", b"\x80\x05"]))
def test_arbitrary_bytes_are_refused_clearly(data, prefix):
    _check(prefix + data)


@SETTINGS
@given(value=VALUES)
def test_any_plain_value_at_the_top_loads_or_is_refused_clearly(value):
    _check(pickle.dumps(value, protocol=4))
