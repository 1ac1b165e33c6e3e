"""The route install() takes: the torch-native library's torch version and the default mode it
gives, and the pluggable route's refusals that name mode='native'. No GPU needed: torch and the
native library are stood in for where a test says so.
"""

from __future__ import annotations

import pytest


def test_native_library_from_another_torch_minor_is_refused_naming_both():
    from vramledger import _native
    _native.check_torch_version("2.11", "2.11")
    with pytest.raises(RuntimeError, match=r"built against torch 2\.10, but torch 2\.11 is running"):
        _native.check_torch_version("2.10", "2.11")
    assert _native.torch_version().count(".") == 1


class _FakeNativeLibrary:
    def __init__(self, version: bytes):
        self.vramledger_native_torch_version = lambda: version


def test_default_mode_is_native_when_the_library_matches_this_torch(monkeypatch):
    import warnings
    from vramledger import _native
    monkeypatch.setattr(_native, "native_path", lambda: "/lib/libvramledger_native.so")
    monkeypatch.setattr(_native, "torch_version", lambda: "2.11")
    monkeypatch.setattr(_native, "_load", lambda path: _FakeNativeLibrary(b"2.11"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning at all
        assert _native.default_mode() == "native"
    assert _native.unavailable_reason() is None


def test_default_mode_falls_back_to_pluggable_with_one_warning_naming_both_versions(monkeypatch):
    from vramledger import _native
    monkeypatch.setattr(_native, "native_path", lambda: "/lib/libvramledger_native.so")
    monkeypatch.setattr(_native, "torch_version", lambda: "2.12")
    monkeypatch.setattr(_native, "_load", lambda path: _FakeNativeLibrary(b"2.11"))
    with pytest.warns(RuntimeWarning) as caught:
        assert _native.default_mode() == "pluggable"
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "built against torch 2.11, but torch 2.12 is running" in message
    assert message.endswith("vramledger.install() uses mode='pluggable' instead")
    assert "\n" not in message


def test_default_mode_falls_back_when_the_native_library_is_absent(monkeypatch):
    from vramledger import _native

    def absent():
        raise RuntimeError("vramledger: the torch-native mode's libvramledger_native.so is not "
                           "beside the plugin /x/libvramledger_plugin.so")
    monkeypatch.setattr(_native, "native_path", absent)
    with pytest.warns(RuntimeWarning, match="is not beside the plugin .*mode='pluggable' instead"):
        assert _native.default_mode() == "pluggable"


def test_pluggable_refusals_name_the_native_mode():
    """torch's "does not yet support" from its pluggable allocator gains a line naming
    mode='native', chained to torch's error; other errors and results pass unchanged."""
    from vramledger import _pluggable_limits

    def refused(*args):
        raise RuntimeError("CUDAPluggableAllocator does not yet support createOrIncrefPool. "
                           "If you need it, please file an issue describing your use case.")

    def other(x):
        if x < 0:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 2 * x

    with pytest.raises(RuntimeError) as info:
        _pluggable_limits.wrap(refused, "torch.cuda.MemPool")(1)
    text = str(info.value)
    assert text.startswith("CUDAPluggableAllocator does not yet support createOrIncrefPool")
    assert "does not route torch.cuda.MemPool to" in text
    assert "vramledger.install(mode='native')" in text
    assert isinstance(info.value.__cause__, RuntimeError)
    wrapped = _pluggable_limits.wrap(other, "x")
    assert wrapped(3) == 6 and wrapped.__name__ == "other"
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        wrapped(-1)
    assert "mode='native'" not in str(info.value)


def test_pluggable_limits_wrap_each_entry_point_of_torch_once():
    import types
    from vramledger import _pluggable_limits

    class MemPool:
        def __init__(self):
            raise RuntimeError("CUDAPluggableAllocator does not yet support createOrIncrefPool")

    def checkpoint(*args):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getCheckpointState")

    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(memory=types.SimpleNamespace(MemPool=MemPool)),
        _C=types.SimpleNamespace(_cuda_getCheckpointState=checkpoint))
    first = _pluggable_limits.install(fake)
    assert first == ["torch.cuda.memory.MemPool.__init__", "torch._C._cuda_getCheckpointState"]
    init = MemPool.__init__
    assert _pluggable_limits.install(fake) == first and MemPool.__init__ is init  # once
    with pytest.raises(RuntimeError, match="torch.cuda.MemPool to; vramledger.install"):
        MemPool()
    with pytest.raises(RuntimeError, match="CUDA graph trees"):
        fake._C._cuda_getCheckpointState(0, (1, 0))


def test_pluggable_route_refuses_nccl_register_hook_before_torch_aborts(monkeypatch):
    """torch ends the process when ProcessGroupNCCL's register hook meets a pluggable allocator;
    under the pluggable route the group's creation raises first, naming the variable and the
    native mode; without the variable, or with gloo, the call passes unchanged."""
    import types
    from vramledger import _pluggable_limits

    calls = []

    def init_process_group(backend=None, **kwargs):
        calls.append(backend)
        return "group"

    def new_group(ranks=None, timeout=None, backend=None):
        calls.append(backend)
        return "subgroup"

    fake = types.SimpleNamespace(distributed=types.SimpleNamespace(
        init_process_group=init_process_group, new_group=new_group))
    names = _pluggable_limits.install(fake)
    assert "torch.distributed.init_process_group" in names
    assert "torch.distributed.new_group" in names
    monkeypatch.setenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "1")
    for call in (lambda: fake.distributed.init_process_group("nccl"),
                 lambda: fake.distributed.init_process_group(),
                 lambda: fake.distributed.init_process_group(backend="cpu:gloo,cuda:nccl"),
                 lambda: fake.distributed.new_group([0], backend="nccl"),
                 lambda: fake.distributed.new_group([0])):
        with pytest.raises(RuntimeError) as info:
            call()
        assert "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1" in str(info.value)
        assert "vramledger.install(mode='native')" in str(info.value)
    assert calls == []
    assert fake.distributed.init_process_group("gloo") == "group"
    monkeypatch.setenv("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK", "0")
    assert fake.distributed.init_process_group("nccl") == "group"
    assert fake.distributed.new_group([0]) == "subgroup"
    assert calls == ["gloo", "nccl", None]


def test_a_native_library_without_its_version_guard_falls_back(monkeypatch):
    """A library that loads but does not say which torch it was built for (an older build) is a
    reason to take the pluggable route, not an AttributeError out of install()."""
    import ctypes
    from vramledger import _native
    monkeypatch.setattr(_native, "native_path", lambda: "/lib/libvramledger_native.so")
    monkeypatch.setattr(ctypes, "CDLL", lambda path: object())
    with pytest.warns(RuntimeWarning, match="does not say which torch it was built against"):
        assert _native.default_mode() == "pluggable"
