"""Pausable regions on a real GPU with vramledger as torch's allocator (install(mode="native")):
tensors survive a pause with CPU backup at the same addresses, a CUDA graph captured in a region
replays after pause and resume, a pause during a capture is refused, and a resume the card cannot
hold raises torch.OutOfMemoryError and leaves the region paused with its backups. The same calls
in a program under the LD_PRELOAD shim (no install()) reach the shim's allocator.

Every test runs in its own interpreter (install() must precede CUDA's initialisation). Skipped
where torch, CUDA or the native library is missing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device (torch.cuda.is_available() is False)", allow_module_level=True)

PRELUDE = """
import vramledger
vramledger.install(mode="native")
import torch
MiB, GiB = 1 << 20, 1 << 30
assert torch.cuda.get_allocator_backend() == "vramledger", torch.cuda.get_allocator_backend()

def region_info(name):
    (info,) = [r for r in vramledger.regions() if r["name"] == name]
    return info
"""


def run_snippet(body: str, timeout: int = 300, prelude: str = PRELUDE,
                **env_extra: str) -> subprocess.CompletedProcess:
    """Runs `prelude` plus `body` in a fresh interpreter; the body must print OK last."""
    code = prelude + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               PYTHONUNBUFFERED="1", **env_extra)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0 and "torch-native" in r.stderr and "not beside" in r.stderr:
        pytest.skip("libvramledger_native.so is not built for this torch")
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), (
        f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")
    return r


def test_tensors_round_trip_through_a_cpu_backup_at_the_same_addresses():
    run_snippet("""
        gen = torch.Generator(device="cuda").manual_seed(0)
        with vramledger.region("train"):
            a = torch.randn(64 * MiB // 4, device="cuda", generator=gen)       # 64 MiB
            b = torch.randint(0, 255, (300 * MiB,), dtype=torch.uint8, device="cuda", generator=gen)
            c = torch.randn(3, 5, device="cuda", generator=gen)                # small pool
        outside = torch.ones(8 * MiB, device="cuda")
        expect = [t.cpu() for t in (a, b, c)]
        ptrs = [t.data_ptr() for t in (a, b, c)]
        torch.cuda.synchronize()
        info = region_info("train")
        free_before, _ = torch.cuda.mem_get_info()
        r = paused = vramledger.pause("train", backup="cpu")
        free_paused, _ = torch.cuda.mem_get_info()
        assert r["already_paused"] is False, r
        assert r["released_bytes"] == info["mapped_bytes"], (r, info)
        assert r["backed_up_bytes"] >= sum(t.numel() * t.element_size() for t in (a, b, c)), r
        assert free_paused - free_before >= 0.98 * info["mapped_bytes"], (
            free_paused - free_before, info)
        assert region_info("train")["paused"] is True
        assert vramledger.pause("train", backup="cpu")["already_paused"] is True
        assert float(outside.sum()) == 8 * MiB  # other memory untouched
        r = vramledger.resume("train")
        assert r["restored_bytes"] == paused["backed_up_bytes"], (r, paused)
        assert r["mapped_bytes"] == paused["released_bytes"], (r, paused)
        assert [t.data_ptr() for t in (a, b, c)] == ptrs
        for t, e in zip((a, b, c), expect):
            assert torch.equal(t.cpu(), e)
        a.add_(1)  # usable again
        assert torch.equal(a.cpu(), expect[0] + 1)
        assert vramledger.resume("train")["already_running"] is True
        print("OK")
    """)


def test_a_graph_captured_in_a_region_replays_after_pause_and_resume():
    run_snippet("""
        with vramledger.region("graphs"):
            x = torch.zeros(4 * MiB, device="cuda")
            w = torch.full((4 * MiB,), 3.0, device="cuda")
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # warm up on a side stream, as torch asks
                y = x * w + 1
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                y = x * w + 1
        x.fill_(2.0)
        g.replay()
        torch.cuda.synchronize()
        assert float(y[0]) == 7.0 and float(y[-1]) == 7.0
        reserved = region_info("graphs")["mapped_bytes"]
        free_before, _ = torch.cuda.mem_get_info()
        released = vramledger.pause("graphs", backup="cpu")["released_bytes"]
        free_paused, _ = torch.cuda.mem_get_info()
        # The graph's private pool belongs to the region: its pages are released too, and the
        # card's free memory rises by them (nothing the driver makes during the pause stays).
        assert released == reserved, (released, reserved)
        assert free_paused - free_before >= 0.98 * reserved, (free_paused - free_before, reserved)
        vramledger.resume("graphs")
        assert float(y[0]) == 7.0  # the graph's output came back with the backup
        x.fill_(5.0)
        g.replay()
        torch.cuda.synchronize()
        assert torch.all(y == 16.0)
        print("OK")
    """)


def test_pause_during_a_capture_is_refused():
    run_snippet("""
        with vramledger.region("r"):
            x = torch.ones(MiB, device="cuda")
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            y = x * 2
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        error = None
        with torch.cuda.graph(g):
            y = x * 2
            try:
                vramledger.pause("r", backup="none")
            except RuntimeError as e:
                error = str(e)
        assert error is not None and "'r'" in error and "captur" in error, error
        assert region_info("r")["paused"] is False
        g.replay()
        torch.cuda.synchronize()
        assert float(y.sum()) == 2 * MiB
        print("OK")
    """)


def test_a_resume_the_card_cannot_hold_is_refused_and_leaves_the_region_intact():
    run_snippet("""
        with vramledger.region("big"):
            t = torch.arange(2 * GiB // 4, dtype=torch.int32, device="cuda")  # 2 GiB
        expect = t[:: 1 << 20].cpu()
        torch.cuda.synchronize()
        vramledger.pause("big", backup="cpu")
        before = region_info("big")
        free, _ = torch.cuda.mem_get_info()
        filler = torch.empty(free - 1 * GiB, dtype=torch.uint8, device="cuda")  # leaves < 2 GiB
        try:
            vramledger.resume("big")
            raise AssertionError("the resume should have been refused")
        except torch.OutOfMemoryError as e:
            assert "big" in str(e), str(e)
        after = region_info("big")
        assert after == before, (before, after)
        del filler
        torch.cuda.empty_cache()
        vramledger.resume("big")
        assert torch.equal(t[:: 1 << 20].cpu(), expect)
        print("OK")
    """)


def _shim() -> str | None:
    """The LD_PRELOAD shim: $VRAMLEDGER_PRELOAD, else beside $VRAMLEDGER_PLUGIN (the GPU
    runner's .devbuild/lib), else the one in the installed package."""
    candidates = [os.environ.get("VRAMLEDGER_PRELOAD")]
    if os.environ.get("VRAMLEDGER_PLUGIN"):
        candidates.append(os.path.join(os.path.dirname(os.environ["VRAMLEDGER_PLUGIN"]),
                                       "libvramledger_preload.so"))
    try:
        from vramledger import _run_cli
        candidates.append(_run_cli.preload_path(RuntimeError))
    except (ImportError, RuntimeError):
        pass
    return next((c for c in candidates if c and os.path.isfile(c)), None)


def test_a_program_under_the_shim_pauses_and_resumes_its_region():
    shim = _shim()
    if shim is None:
        pytest.skip("the LD_PRELOAD shim is not built")
    prelude = """
import torch
import vramledger  # no install(): the shim serves torch, and the calls go to it
MiB, GiB = 1 << 20, 1 << 30
assert not vramledger.is_installed()

def region_info(name):
    (info,) = [r for r in vramledger.regions() if r["name"] == name]
    return info
"""
    run_snippet("""
        gen = torch.Generator(device="cuda").manual_seed(0)
        with vramledger.region("rollout"):
            a = torch.randn(256 * MiB // 4, device="cuda", generator=gen)  # 256 MiB
            b = torch.randn(7, 3, device="cuda", generator=gen)
        outside = torch.ones(4 * MiB, device="cuda")
        expect, ptrs = [t.cpu() for t in (a, b)], [t.data_ptr() for t in (a, b)]
        torch.cuda.synchronize()
        info = region_info("rollout")
        free_before, _ = torch.cuda.mem_get_info()
        paused = vramledger.pause("rollout", backup="cpu")
        free_paused, _ = torch.cuda.mem_get_info()
        assert paused["released_bytes"] == info["mapped_bytes"] > 0, (paused, info)
        assert free_paused - free_before >= 0.98 * info["mapped_bytes"], (
            free_paused - free_before, info)
        assert float(outside.sum()) == 4 * MiB
        resumed = vramledger.resume("rollout")
        assert resumed["restored_bytes"] == paused["backed_up_bytes"], (resumed, paused)
        assert [t.data_ptr() for t in (a, b)] == ptrs
        for t, e in zip((a, b), expect):
            assert torch.equal(t.cpu(), e)
        print(torch.cuda.get_allocator_backend())
        print("OK")
    """, prelude=prelude, LD_PRELOAD=shim, VRAMLEDGER_PRELOAD_QUIET="1",
        VRAMLEDGER_PRELOAD_NO_EXIT_DUMP="1")
