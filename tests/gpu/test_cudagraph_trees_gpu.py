"""torch.compile(mode="reduce-overhead") (CUDA graph trees) under vramledger's torch-native mode:
a small MLP's training steps and a generation loop whose shapes change (graphs recorded again
after others were replayed, so the pool is set back to a checkpoint), each equal to eager, with
torch's own checks of the pool's live blocks and deleters turned on.

Every test runs in its own interpreter, because install() must precede CUDA's initialisation and
can happen once per process. Skipped where torch or CUDA is missing.
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
import torch._inductor.config as inductor_config
assert torch.cuda.get_allocator_backend() == "vramledger", torch.cuda.get_allocator_backend()
# torch's slow-path asserts: after each checkpoint restore, the pool's live blocks must be exactly
# the live storages (checkPoolLiveAllocations) and their deleters raw_deleter().
inductor_config.triton.slow_path_cudagraph_asserts = True
inductor_config.triton.cudagraph_trees = True

# Counts of the allocator calls graph trees make, to show the checkpoint path ran.
calls = {}
def counting(name):
    real = getattr(torch._C, name)
    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return real(*args, **kwargs)
    setattr(torch._C, name, wrapper)
for name in ("_cuda_getCheckpointState", "_cuda_setCheckpointPoolState",
             "_cuda_checkPoolLiveAllocations"):
    counting(name)
"""


def run_snippet(body: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Runs PRELUDE plus `body` in a fresh interpreter; the body must print OK last. Fails the
    test with both streams otherwise."""
    code = PRELUDE + textwrap.dedent(body)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["PYTHONUNBUFFERED"] = "1"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("OK"), (
        f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-6000:]}")
    return r


def test_mlp_training_steps_equal_eager():
    run_snippet("""
        import copy
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                    torch.nn.Linear(512, 512), torch.nn.GELU(),
                                    torch.nn.Linear(512, 10)).cuda()
        eager = copy.deepcopy(model)
        compiled = torch.compile(model, mode="reduce-overhead")
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        opt_eager = torch.optim.SGD(eager.parameters(), lr=0.05)
        gen = torch.Generator(device="cuda").manual_seed(0)
        for step in range(8):
            x = torch.randn(64, 256, device="cuda", generator=gen)
            y = torch.randint(0, 10, (64,), device="cuda", generator=gen)
            loss = torch.nn.functional.cross_entropy(compiled(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss_eager = torch.nn.functional.cross_entropy(eager(x), y)
            loss_eager.backward()
            opt_eager.step()
            opt_eager.zero_grad(set_to_none=True)
            torch.testing.assert_close(loss.detach(), loss_eager.detach(), rtol=1e-4, atol=1e-5)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
        assert calls.get("_cuda_getCheckpointState", 0) > 0, calls
        stats = torch.cuda.memory_stats()
        assert stats["allocated_bytes.all.current"] > 0, stats
        print(calls)
        print("OK")
    """)


def test_generation_loop_with_changing_shapes_equals_eager():
    run_snippet("""
        torch._dynamo.config.recompile_limit = 64  # one graph per length, none left to eager
        torch.manual_seed(0)
        vocab, width = 97, 128
        # float64: compiled and eager argmax agree without near-ties deciding a token.
        emb = torch.nn.Embedding(vocab, width).cuda().double()
        mix = torch.nn.Linear(width, width).cuda().double()
        head = torch.nn.Linear(width, vocab).cuda().double()

        @torch.no_grad()
        def next_token(tokens):
            # A causal mean over the sequence so far: each length is a new shape (a new graph).
            h = emb(tokens)
            h = torch.cumsum(h, dim=1) / torch.arange(1, tokens.shape[1] + 1,
                                                      device=tokens.device)[None, :, None]
            h = torch.tanh(mix(h))
            return head(h[:, -1]).argmax(-1, keepdim=True)

        compiled = torch.compile(next_token, mode="reduce-overhead", dynamic=False)

        def generate(fn, prompt, steps):
            tokens = prompt
            for _ in range(steps):
                tokens = torch.cat([tokens, fn(tokens)], dim=1)
            return tokens

        prompt = torch.randint(0, vocab, (4, 3), device="cuda",
                               generator=torch.Generator(device="cuda").manual_seed(1))
        # A length's first call runs eagerly in the pool (warm-up), its second records its graph,
        # later ones replay it. Each round repeats the last one's lengths and adds new ones, so a
        # new length's warm-up comes right after replays: graph trees then set the pool back to
        # the last replayed graph's checkpoint (setCheckpointPoolState) and, with the slow-path
        # asserts, check the live blocks exactly (checkPoolLiveAllocations).
        for steps in (4, 4, 6, 6, 8, 8, 9):
            out = generate(compiled, prompt, steps)
            ref = generate(next_token, prompt, steps)
            assert torch.equal(out, ref), (steps, out, ref)
        assert calls.get("_cuda_getCheckpointState", 0) > 0, calls
        assert calls.get("_cuda_setCheckpointPoolState", 0) > 0, calls
        assert calls.get("_cuda_checkPoolLiveAllocations", 0) > 0, calls
        print(calls)
        print("OK")
    """)
