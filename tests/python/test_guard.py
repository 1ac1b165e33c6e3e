# Tests of the budget guard and planner from Python: `vramledger plan` on the GPT-2-medium and Llama-1B shapes (against the
# measured H200 peaks), the 7B and LoRA lines, `vramledger report` on synthetic step logs, plan file
# errors through the Python loader, and tags / steps through the plugin on a simulated device.
"""Budget guard, planner and report tests (CPU only; plugin tests skip without the library)."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from vramledger import _guard, _plan, _plugin, _report

ROOT = pathlib.Path(__file__).resolve().parents[2]
GB = 1e9
GIB = 1 << 30
# Measured on the H200 (the runs behind traces/, native allocator, bf16 autocast,
# AdamW): peak allocated bytes; the runs' longest sequences were 977 (GPT-2) and 1955 (Llama).
GPT2M_PARAMS, GPT2M_PEAK = 354_823_168, 27_129_146_368
LLAMA1B_PARAMS, LLAMA1B_PEAK, LLAMA1B_CKPT_PEAK = 1_100_048_384, 37_032_076_800, 22_090_008_064

GPT2M_CONFIG = {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16,
                "n_positions": 1024, "vocab_size": 50257, "activation_function": "gelu_new"}
LLAMA1B_CONFIG = {"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 22,
                  "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
                  "vocab_size": 32000, "hidden_act": "silu", "tie_word_embeddings": False}
LLAMA7B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--intermediate", "11008",
           "--vocab", "32000", "--mlp", "gated"]


def run_cli(*args, env=None):
    full_env = dict(os.environ)
    full_env.pop("VRAMLEDGER_CONF", None)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "vramledger", *map(str, args)],
                          capture_output=True, text=True, env=full_env, timeout=300)


def plan_json(*args):
    proc = run_cli("plan", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.fixture
def gpt2_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2M_CONFIG))
    return path


@pytest.fixture
def llama_config(tmp_path):
    path = tmp_path / "llama.json"
    path.write_text(json.dumps(LLAMA1B_CONFIG))
    return path


def plugin_available():
    try:
        _plugin.plugin_path()
        import torch  # noqa: F401
    except (RuntimeError, ImportError):
        return False
    return True


needs_plugin = pytest.mark.skipif(not plugin_available(),
                                  reason="the torch plugin library or torch is not available")


# ---- vramledger plan ----

def test_plan_gpt2_medium_config_matches_the_measured_peak(gpt2_config):
    est = plan_json("--config", gpt2_config, "--batch", 8, "--seq", 977)
    p = GPT2M_PARAMS
    assert est["params"] == p  # counted from the shape, as Hugging Face counts it
    assert est["weights"] == 6 * p  # fp32 weights + bf16 autocast copies
    assert est["gradients"] == 4 * p
    assert est["optimizer"] == 8 * p
    assert est["model_states_bytes"] == 18 * p
    assert est["communication"] == 0
    assert est["peak_phase"] == "forward_end"
    # (31.5 h + 16 f) B/token/layer x 24 layers x 7,816 tokens + 10 V B/token
    assert est["activations"] == 24 * (31.5 * 1024 + 16 * 4096) * 7816 + 10 * 50257 * 7816
    assert est["total_bytes"] == 27_306_934_864
    assert abs(est["total_bytes"] / GPT2M_PEAK - 1) < 0.01


def test_plan_llama_1b_with_and_without_checkpointing(llama_config):
    est = plan_json("--config", llama_config, "--batch", 4, "--seq", 1955)
    assert est["params"] == LLAMA1B_PARAMS
    assert abs(est["total_bytes"] / LLAMA1B_PEAK - 1) < 0.01
    ckpt = plan_json("--config", llama_config, "--batch", 4, "--seq", 1955, "--checkpointing")
    assert ckpt["peak_phase"] == "optimizer_step"  # 20 B/param with AdamW's foreach temporaries
    assert abs(ckpt["total_bytes"] / LLAMA1B_CKPT_PEAK - 1) < 0.01
    assert ckpt["activations"] < est["activations"] / 4


def test_plan_text_names_each_category_with_its_formula(gpt2_config, tmp_path):
    out = tmp_path / "plan.json"
    proc = run_cli("plan", "--config", gpt2_config, "--batch", 8, "--seq", 1024, "--out", out)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("vramledger plan: gpt2 (24 layers, hidden 1024, 16 heads, vocab "
                               "50257, gelu-tanh MLP of width 4096), 354.82M params")
    for category in (*_plan.CATEGORIES, "model states"):
        assert any(line.startswith(f"  {category:<15} ") for line in lines), category
    assert "AdamW m, v: 8 B/param x 354.82M trainable" in proc.stdout
    assert "card 150.11 GB (139.80 GiB): fits" in proc.stdout
    doc = json.loads(out.read_text())
    est = doc["estimate"]
    assert doc["vramledger_plan"] == 1
    assert doc["limit"] % (256 << 20) == 0
    assert doc["limit"] >= est["total_bytes"] * 1.1 / 0.9
    assert doc["headroom"] == int(doc["limit"] * 0.1)
    assert doc["warn_at"] == 0.9


def test_plan_7b_mixed_adamw_model_states_and_zero3():
    est = plan_json("--params", "7B", *LLAMA7B, "--precision", "bf16-mixed", "--seq", 2048)
    assert est["model_states_bytes"] == 126 * GB  # 18 B/param
    assert "18.00 B/param" in est["formulas"]["model states"]
    z3 = plan_json("--params", "7B", *LLAMA7B, "--zero-stage", 3, "--gpus", 4, "--seq", 2048)
    assert z3["model_states_bytes"] == 31.5 * GB
    assert z3["communication"] > 0
    fp32 = plan_json("--params", "7e9", "--precision", "fp32")
    assert fp32["model_states_bytes"] == 16 * 7e9
    assert fp32["activations"] == 0 and fp32["notes"]  # no shape: activations unknown


def test_plan_7b_lora_and_qlora():
    lora = plan_json("--params", "7B", *LLAMA7B, "--lora-rank", 16, "--seq", 2048)
    trainable = 32 * 16 * (6 * 4096 + 2 * 4096)  # q, k, v, o adapters of rank 16
    assert lora["trainable_params"] == trainable
    assert lora["gradients"] == 4 * trainable
    assert lora["optimizer"] == 8 * trainable
    assert lora["weights"] == round(2 * (7e9 - trainable) + 6 * trainable)  # bf16 frozen base
    qlora = plan_json("--params", "7B", *LLAMA7B, "--qlora", "--seq", 2048)
    assert qlora["weights"] < lora["weights"] / 3
    assert qlora["workspace"] > lora["workspace"] - 4 * trainable  # dequantisation buffer


def test_plan_errors_are_cli_errors(tmp_path):
    proc = run_cli("plan")
    assert proc.returncode == 2
    assert "give --config, or --params" in proc.stderr
    proc = run_cli("plan", "--layers", 24, "--hidden", 1024)  # says which one is missing
    assert "(--layers, --hidden, --vocab; missing: --vocab)" in proc.stderr, proc.stderr
    proc = run_cli("report", "/nonexistent-dir")
    assert "vramledger: error: /nonexistent-dir: no such directory" in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    proc = run_cli("plan", "--config", bad)
    assert proc.returncode == 2 and "cannot read the model config" in proc.stderr
    proc = run_cli("plan", "--params", "lots")
    assert proc.returncode == 2 and "--params: expected a count" in proc.stderr


def assert_cli_error(proc, message):
    """Exit status 2 and one `vramledger: error:` holding `message`, no traceback."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("vramledger: error: "), proc.stderr
    assert message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


GPT2M_FLAGS = ["--layers", "24", "--hidden", "1024", "--heads", "16", "--vocab", "50257"]


@pytest.mark.parametrize("config, args, peak", [
    ("gpt2-medium.json", ["--seq", 977, "--batch", 8], 27_306_934_864),
    ("llama-1b.json", ["--seq", 1955, "--batch", 4], 36_820_264_960),
    ("llama-1b.json", ["--seq", 1955, "--batch", 4, "--checkpointing"], 22_068_076_544),
])
def test_the_bundled_configs_plan_the_traced_runs(config, args, peak):
    """traces/configs/ (the README's plan example) gives memory-planner.md's planned peaks."""
    path = ROOT / "traces" / "configs" / config
    assert plan_json("--config", path, *args)["total_bytes"] == peak
    assert json.loads(path.read_text()) == (GPT2M_CONFIG if "gpt2" in config else LLAMA1B_CONFIG)


def test_a_plan_that_does_not_fit_exits_1_and_still_writes(tmp_path, gpt2_config):
    """A plan that DOES NOT FIT exits 1, so `vramledger plan ... && train` stops instead of
    training into an out-of-memory error."""
    out = tmp_path / "p.json"
    proc = run_cli("plan", "--config", gpt2_config, "--batch", 8, "--seq", 1024,
                   "--card-gib", 8, "--out", out)
    assert proc.returncode == 1, proc.stderr
    assert "DOES NOT FIT" in proc.stdout
    assert "vramledger: warning: the planned peak does not fit the card" in proc.stderr
    assert_cli_error(run_cli("plan", "--config", gpt2_config, "--out", tmp_path / "no" / "p.json"),
                     f"--out {tmp_path / 'no' / 'p.json'}: no such directory: {tmp_path / 'no'}")
    assert json.loads(out.read_text())["limit"] == 8 * GIB  # capped at the card
    proc = run_cli("plan", "--config", gpt2_config, "--batch", 8, "--card-gib", 8, "--json")
    assert proc.returncode == 1 and json.loads(proc.stdout)["fits"] is False
    assert run_cli("plan", "--config", gpt2_config, "--batch", 1, "--seq", 128).returncode == 0


@pytest.mark.parametrize("args, message", [
    (["--card-gib", "nan"], "--card-gib must be a positive number of GiB, at most 1000000, got nan"),
    (["--card-gib", "inf"], "--card-gib must be a positive number of GiB"),
    (["--card-gib", "0"], "--card-gib must be a positive number of GiB, at most 1000000, got 0.0"),
    (["--card-gib", "-1"], "--card-gib must be a positive number of GiB"),
    (["--params", "1e400"], "--params must be a finite count of at least 1, got '1e400'"),
    (["--params", "0"], "--params must be a finite count of at least 1, got '0'"),
    (["--seq", "0"], "--seq must be at least 1, got 0"),
    (["--batch", "0"], "--batch must be at least 1, got 0"),
    (["--heads", "0"], "--heads must be at least 1, got 0"),
    (["--kv-heads", "0"], "--kv-heads must be at least 1, got 0"),
    (["--kv-heads", "5"], "the key/value heads (--kv-heads, or num_key_value_heads in --config) "
                          "must divide the 16 attention heads, got 5"),
    (["--intermediate", "0"], "--intermediate must be at least 1, got 0"),
    (["--lora-rank", "-1"], "--lora-rank must be at least 0, got -1"),
    (["--headroom", "1.5"], "--headroom must be in [0, 1), got 1.5"),
    (["--headroom", "nan"], "--headroom must be in [0, 1), got nan"),
    (["--fragmentation", "nan"], "--fragmentation must be a finite number of at least 1, got nan"),
    (["--fragmentation", "0"], "--fragmentation must be a finite number of at least 1, got 0.0"),
    (["--warn-at", "5"], "--warn-at must be in (0, 1], got 5.0"),
    (["--warn-at", "nan"], "--warn-at must be in (0, 1], got nan"),
])
@pytest.mark.parametrize("out", [False, True], ids=["no-out", "out"])
def test_plan_refuses_bad_numbers_with_or_without_out(tmp_path, args, message, out):
    plan_file = tmp_path / "p.json"
    proc = run_cli("plan", *GPT2M_FLAGS, *args, *(["--out", plan_file] if out else []))
    assert_cli_error(proc, message)
    assert not plan_file.exists()


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", "x", "'num_hidden_layers' must be an integer of at least 1, got 'x'"),
    ("n_embd", 0, "'n_embd' must be an integer of at least 1, got 0"),
    ("n_head", True, "'n_head' must be an integer of at least 1, got True"),
    ("n_positions", 1.5, "'n_positions' must be an integer of at least 0, got 1.5"),
    ("num_key_value_heads", 5, "must divide the 16 attention heads, got 5"),
])
def test_plan_config_fields_must_be_integers(tmp_path, field, value, message):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(GPT2M_CONFIG, **{field: value})))
    assert_cli_error(run_cli("plan", "--config", config), message)


# ---- vramledger report ----

def write_rank_log(directory, rank, peaks_gib, reserved_extra=1.1, warnings=0):
    path = directory / f"vramledger-steps-rank{rank}.jsonl"
    with open(path, "w") as f:
        for step, peak in enumerate(peaks_gib):
            f.write(json.dumps({"step": step, "rank": rank, "device": 0,
                                "peak_allocated_bytes": int(peak * GIB),
                                "peak_reserved_bytes": int(peak * reserved_extra * GIB),
                                "allocated_bytes": 0, "reserved_bytes": 0, "warnings": warnings,
                                "tags": {}}) + "\n")
    return path


def test_report_flags_the_rank_8_percent_above_the_median(tmp_path):
    for rank, top in enumerate([10.0, 10.0, 10.0, 10.8]):
        write_rank_log(tmp_path, rank, [top - 1, top, top - 0.5])
    proc = run_cli("report", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr
    s = json.loads(proc.stdout)
    assert [r["rank"] for r in s["ranks"]] == [0, 1, 2, 3]
    assert s["flagged_ranks"] == [3]
    assert s["peak_allocated_bytes"]["median"] == 10 * GIB
    assert s["peak_allocated_bytes"]["spread"] == int(10.8 * GIB) - 10 * GIB
    assert s["ranks"][3]["peak_allocated_vs_median"] == pytest.approx(0.08, abs=1e-6)
    assert s["ranks"][3]["flags"] == ["peak_allocated", "peak_reserved"]
    assert all(r["steps"] == 3 for r in s["ranks"])
    text = run_cli("report", tmp_path)
    assert text.returncode == 0
    assert "flagged: rank(s) 3 more than 5% above the median" in text.stdout
    assert "+8.0%" in text.stdout
    assert run_cli("report", tmp_path, "--fail-on-flag").returncode == 1
    assert "guard warnings" not in text.stdout


def test_report_table_shows_each_ranks_guard_warnings(tmp_path):
    write_rank_log(tmp_path, 0, [10.0, 10.0])
    write_rank_log(tmp_path, 1, [10.0, 10.0], warnings=1)
    proc = run_cli("report", tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith("     ")]
    assert [row[0] for row in rows] == ["0", "1"]
    assert [row[-1] for row in rows] == ["0", "2"]  # two steps with a warning each
    assert ("guard warnings (the plan's warn_at crossed, at most one a step): 2 in all, on "
            "rank(s) 1") in proc.stdout


def test_report_without_flags_and_errors(tmp_path):
    for rank in range(4):
        write_rank_log(tmp_path, rank, [10.0 + 0.1 * rank])
    s = _report.summarise(_report.load_logs(str(tmp_path)))
    assert s["flagged_ranks"] == []
    (tmp_path / "vramledger-steps-rank9.jsonl").write_text('{"rank": 9}\nnot json\n')
    proc = run_cli("report", tmp_path)
    assert proc.returncode == 2
    assert "vramledger-steps-rank9.jsonl:1: missing integer field 'peak_allocated_bytes'" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no step logs" in run_cli("report", empty).stderr


# ---- plan files through the Python loader (the allocator's own C++ parser) ----

def test_configured_plan_from_keywords_and_environment():
    assert _guard.configured_plan({"plan": "a.json"}, "plan:b.json") == "a.json"
    assert _guard.configured_plan({}, "max_split_size_mb:200,plan:/x/b.json") == "/x/b.json"
    assert _guard.configured_plan({}, "roundup_power2_divisions:[256:1,>:4],plan:c.json") == "c.json"
    assert _guard.configured_plan({}, "max_split_size_mb:200") is None


@needs_plugin
@pytest.mark.parametrize("text, expected", [
    ('{\n  "limit": "40GiB",\n  "headroom" 4\n}', ":3: syntax error: "),
    ('{\n  "devices": {\n    "3": {"limit": 1}\n  }\n}',
     ":3: field 'devices.3': unknown device 3: this process sees 2 CUDA devices (0-1)"),
    ('{\n  "category_limits": {\n    "activation": "1GiB"\n  }\n}',
     ":3: field 'category_limits.activation': unknown category 'activation'"),
    ('{\n  "limit": "200GiB"\n}', ":2: field 'limit': limit 200GiB = 200.00 GiB (214748364800 "
                                  "bytes) exceeds the card's total memory, 139.80 GiB"),
    ('{\n  "limit": "40 gigs"\n}', ":2: field 'limit': expected bytes (an integer)"),
    ('{\n  "limt": 1\n}', ":2: field 'limt': unknown key 'limt'"),
])
def test_plan_file_errors_name_file_line_and_field(tmp_path, text, expected):
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        _guard.check_plan(str(path), device_count=2, card_bytes=_plan.H200_BYTES)
    assert str(e.value).startswith(f"{path}{expected}"), str(e.value)


@needs_plugin
def test_planner_output_loads_in_the_guard(tmp_path, gpt2_config):
    out = tmp_path / "plan.json"
    assert run_cli("plan", "--config", gpt2_config, "--batch", 8, "--category-limits",
                   "--out", out).returncode == 0
    summary = _guard.check_plan(str(out), device_count=1, card_bytes=_plan.H200_BYTES)
    device = summary["devices"][0]
    doc = json.loads(out.read_text())
    assert device["limit"] == doc["limit"]
    assert device["cap"] == doc["limit"] - doc["headroom"]
    assert device["warn_bytes"] == int(0.9 * device["cap"])
    assert set(device["category_limits"]) == {"weights", "gradients", "optimizer", "activations",
                                              "workspace"}
    with pytest.raises(FileNotFoundError):
        _guard.check_plan(str(tmp_path / "missing.json"))


# ---- tags, steps and stats through the plugin on a simulated device ----

@needs_plugin
def test_tags_steps_and_report_through_the_plugin(tmp_path):
    code = textwrap.dedent(f"""
        import ctypes, json, threading
        import vramledger
        from vramledger import _guard, _plugin
        lib = _plugin.load()
        lib.vramledger_testing_use_sim_backend.argtypes = [ctypes.c_int, ctypes.c_size_t]
        assert lib.vramledger_testing_use_sim_backend(1, 8 << 30) == 0
        _plugin.configure("step_log:{tmp_path / 'steps'}")
        MiB = 1 << 20
        with vramledger.tag("activations"):
            a = lib.vramledger_malloc(64 * MiB, 0, None)
            with vramledger.tag("workspace"):
                w = lib.vramledger_malloc(2 * MiB, 0, None)
            b = lib.vramledger_malloc(32 * MiB, 0, None)
        with vramledger.phase("backward"):
            seen = []
            t = threading.Thread(target=lambda: seen.append(lib.vramledger_malloc(8 * MiB, 0, None)))
            t.start(); t.join()
        u = lib.vramledger_malloc(MiB, 0, None)
        stats = _guard.tag_stats(0)
        print(json.dumps(stats))
        for p, n in ((a, 64), (b, 32), (w, 2), (seen[0], 8), (u, 1)):
            lib.vramledger_free(p, n * MiB, 0, None)
        first = vramledger.step()
        with vramledger.step_scope():
            c = lib.vramledger_malloc(16 * MiB, 0, None)
            lib.vramledger_free(c, 16 * MiB, 0, None)
        print(json.dumps(first))
        buf = ctypes.create_string_buffer(4096)
        n = _guard._python_stack(ctypes.addressof(buf), 4096)
        print(json.dumps(buf.raw[:n].decode()))
    """)
    env = dict(os.environ, RANK="3")
    env.pop("VRAMLEDGER_CONF", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    stats_line, step_line, stack_line = proc.stdout.strip().splitlines()[-3:]
    stats = json.loads(stats_line)
    MiB = 1 << 20
    assert stats["tags.activations.current"] == 96 * MiB
    assert stats["tags.workspace.current"] == 2 * MiB
    assert stats["tags.backward.current"] == 8 * MiB  # another thread: the phase
    assert stats["tags.untagged.current"] == MiB
    assert stats["guard.refusals"] == 0 and stats["guard.limit_bytes"] == 0
    record = json.loads(step_line)[0]
    assert record["step"] == 0 and record["rank"] == 3 and record["device"] == 0
    assert record["tags"]["activations"] == 96 * MiB
    assert record["peak_allocated_bytes"] == (64 + 2 + 32 + 8 + 1) * MiB
    log = tmp_path / "steps" / "vramledger-steps-rank3.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["peak_allocated_bytes"] == 16 * MiB
    assert run_cli("report", tmp_path / "steps").returncode == 0
    # The stack provider's format: user frames innermost first ("F", file, line, function).
    stack = json.loads(stack_line).splitlines()
    assert stack[0].startswith("F\t<string>\t")


# ---- a refusal raised from Python through the plugin names the model code's frames ----

MODEL_CODE = textwrap.dedent("""
    import ctypes


    def forward(lib):
        message = ctypes.c_void_p()
        ptr = lib.vramledger_testing_malloc(2 << 30, 0, ctypes.byref(message))
        assert not ptr
        text = ctypes.string_at(message.value).decode()
        lib.vramledger_string_free(message)
        return text
""")


@needs_plugin
def test_refusal_from_python_lists_the_python_frames_innermost_first(tmp_path):
    """ctypes.CDLL releases the GIL around the call, as torch's operators do before they allocate:
    the refusal must still list the model code's frames, with and without the package's stack
    provider (the H200 run showed native frames only), from the main thread and another one."""
    (tmp_path / "model.py").write_text(MODEL_CODE)
    (tmp_path / "plan.json").write_text('{\n  "vramledger_plan": 1,\n  "limit": "1GiB"\n}\n')
    code = textwrap.dedent(f"""
        import ctypes, json, sys, threading
        import torch  # noqa: F401 - the plugin needs torch's libc10
        sys.path.insert(0, {str(tmp_path)!r})
        import model
        from vramledger import _guard, _plugin
        lib = ctypes.CDLL(_plugin.plugin_path())
        lib.vramledger_testing_use_sim_backend.argtypes = [ctypes.c_int, ctypes.c_size_t]
        assert lib.vramledger_testing_use_sim_backend(1, 8 << 30) == 0
        conf = "plan:{tmp_path / 'plan.json'},dump_dir:{tmp_path / 'dumps'}"
        assert lib.vramledger_configure(conf.encode()) == 0
        lib.vramledger_testing_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int,
                                                  ctypes.POINTER(ctypes.c_void_p)]
        lib.vramledger_testing_malloc.restype = ctypes.c_void_p
        lib.vramledger_string_free.argtypes = [ctypes.c_void_p]

        def train_step():
            return model.forward(lib)

        texts = [train_step()]  # no stack provider: frames read through the C API
        seen = []
        t = threading.Thread(target=lambda: seen.append(train_step()))
        t.start(); t.join()
        texts += seen
        lib.vramledger_set_python_stack_fn(_guard._stack_callback)  # the package's provider
        texts.append(train_step())
        print(json.dumps(texts))
    """)
    env = dict(os.environ)
    env.pop("VRAMLEDGER_CONF", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    texts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(texts) == 3
    model_file = str(tmp_path / "model.py")
    for text in texts:
        assert text.startswith(f"vramledger plan violation: {tmp_path / 'plan.json'}:3: limit: ")
        stack = text.split("  stack (innermost first), captured at the refusal:\n", 1)[1]
        frames = stack.splitlines()
        # Innermost user frame first: the line of model.py that asked, then its caller.
        assert frames[0] == f"    {model_file}:7 in forward", stack
        assert frames[1].startswith("    <string>:") and frames[1].endswith(" in train_step")
        assert any(f.startswith("    [native] ") for f in frames)
        assert "forensic snapshot: " + str(tmp_path / "dumps") in text


@pytest.mark.parametrize("record, message", [
    ({"peak_allocated_bytes": -5}, "field 'peak_allocated_bytes' must be a non-negative integer, "
                                   "got -5"),
    ({"peak_reserved_bytes": True}, "field 'peak_reserved_bytes' must be a non-negative integer, "
                                    "got True"),
    ({"peak_reserved_bytes": 1.5}, "field 'peak_reserved_bytes' must be a non-negative integer"),
    ({"warnings": "x"}, "field 'warnings' must be a non-negative integer, got 'x'"),
    ({"rank": -1}, "field 'rank' must be a non-negative integer, got -1"),
])
def test_report_refuses_negative_or_boolean_fields(tmp_path, record, message):
    path = tmp_path / "vramledger-steps-rank0.jsonl"
    path.write_text(json.dumps({"rank": 0, "peak_allocated_bytes": GIB,
                                "peak_reserved_bytes": GIB, **record}) + "\n")
    assert_cli_error(run_cli("report", tmp_path), f"{path}:1: {message}")


@pytest.mark.parametrize("threshold", ["-1", "nan", "inf"])
def test_report_refuses_a_bad_threshold(tmp_path, threshold):
    write_rank_log(tmp_path, 0, [10.0])
    assert_cli_error(run_cli("report", tmp_path, "--threshold", threshold),
                     f"--threshold must be a non-negative fraction of the median (0.05: 5%), "
                     f"got {float(threshold)}")
    assert run_cli("report", tmp_path, "--threshold", "0").returncode == 0
