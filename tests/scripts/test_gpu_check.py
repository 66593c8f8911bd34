"""The GPU check (scripts/gpu_check.sh, bench/gpu/) on a machine without a GPU.

- without CUDA the script prints one line saying why and exits with 2 (run for real: this machine's
  torch, a torch that cannot import, a CUDA build that sees no device, no interpreter at all);
- its arithmetic and pass/fail rules, with numbers: the ZeRO/FSDP memory formulas (the same as
  bench/sharded_memory.py's), transformer FLOPs and MFU, accuracy, memory and speed verdicts, the
  fp16 overflow rule, the table and its markdown;
- ``--device cpu``: the correctness and precision runs of the CPU-capable backends (local, ddp on 2
  ranks, fsdp, horovod through the shim), then the memory census and the speed runners, on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
sys.path.insert(0, str(REPO))  # bench/ is a folder of the repository, not an installed package

from bench.gpu import arith, cases, own_loop, preflight  # noqa: E402
from bench.gpu.report import Row, exit_code, format_markdown, format_text, last_line, summary  # noqa: E402
from bench.gpu.rows import memory_row, placement_problem, speed_rows, train_row  # noqa: E402


def run_script(*args: str, env: dict[str, str] | None = None,
               timeout: float = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO, env=full,
                          timeout=timeout)


def one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


# ------------------------------------------------------------------ without a GPU: one line, exit code 2
@pytest.mark.slow
def test_the_script_without_a_gpu_says_why_in_one_line() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    line = one_line(run_script("--markdown", "/nonexistent/never-written.md"))
    if torch.version.cuda is None:
        assert f"torch {torch.__version__} is a build without CUDA" in line
    else:
        assert "no CUDA device visible" in line


def _fake_torch(tmp_path: Path, body: str) -> dict[str, str]:
    package = tmp_path / "torch"
    package.mkdir()
    (package / "__init__.py").write_text(body)
    return {"PYTHONPATH": str(tmp_path), "POLYTRAIN_PYTHON": sys.executable}


def test_a_torch_that_cannot_import_is_named(tmp_path: Path) -> None:
    env = _fake_torch(tmp_path, "raise ImportError('libcudart.so.13: cannot open shared object file')\n")
    line = one_line(run_script(env=env))
    assert line == ("gpu_check: torch cannot be imported: ImportError: libcudart.so.13: cannot open shared "
                    "object file")


def test_a_cuda_build_without_a_device_is_named(tmp_path: Path) -> None:
    env = _fake_torch(tmp_path, "import types\n__version__ = '2.11.0+cu130'\n"
                      "version = types.SimpleNamespace(cuda='13.0')\n"
                      "cuda = types.SimpleNamespace(is_available=lambda: False, device_count=lambda: 0)\n")
    env["CUDA_VISIBLE_DEVICES"] = "7"
    line = one_line(run_script(env=env))
    assert line == ("gpu_check: no CUDA device visible to torch 2.11.0+cu130 "
                    "(CUDA 13.0, CUDA_VISIBLE_DEVICES='7')")


def test_no_interpreter_is_one_line() -> None:
    line = one_line(run_script(env={"POLYTRAIN_PYTHON": "/nonexistent/python3"}))
    assert line == "gpu_check: no Python interpreter '/nonexistent/python3' here (set POLYTRAIN_PYTHON)"


def test_preflight_reasons() -> None:
    ok_cuda = type("T", (), {"__version__": "2.11.0", "version": type("V", (), {"cuda": "13.0"}),
                             "cuda": type("C", (), {"is_available": staticmethod(lambda: True),
                                                    "device_count": staticmethod(lambda: 1)})})
    assert preflight.why_not("cuda", find=lambda m: True, import_torch=lambda: ok_cuda) is None
    assert preflight.why_not("cpu", find=lambda m: True, import_torch=lambda: ok_cuda) is None
    assert preflight.why_not("cuda", find=lambda m: m != "torch").startswith("torch is not installed")
    missing = preflight.why_not("cuda", find=lambda m: m not in ("yaml", "sklearn"))
    assert missing.startswith("missing Python package(s): pyyaml, scikit-learn for ")
    cpu_build = type("T", (), {"__version__": "2.13.0+cpu", "version": type("V", (), {"cuda": None})})
    assert preflight.torch_reason(cpu_build, "cuda").startswith("torch 2.13.0+cpu is a build without CUDA")
    assert preflight.torch_reason(cpu_build, "cpu") is None


# ------------------------------------------------------------------ arithmetic
def test_memory_formulas_match_the_cpu_bench() -> None:
    from bench.sharded_memory import MASTER, formula  # the planner's formula (polytrain.plan.memory)

    for n in range(1, 9):
        for name in arith.MEMORY_BACKENDS:
            assert arith.bytes_per_param(name, n) == pytest.approx(formula(name, n))
    assert arith.MASTER_COPY == MASTER
    assert [arith.bytes_per_param(b, 2) for b in arith.MEMORY_BACKENDS] == [16.0, 12.0, 10.0, 8.0, 8.0]
    assert arith.bytes_per_param("zero3", 4) == 4.0 and arith.bytes_per_param("zero2", 4) == 7.0
    assert arith.model_state_bytes("ddp", 1, 160_000_000) == 2_560_000_000
    assert arith.model_state_bytes("zero3", 2, 10**6, master=True) == 10_000_000  # 8Ψ + 4Ψ/2
    assert arith.model_state_bytes("ddp", 2, 10**6, master=True) == 16_000_000  # no DeepSpeed copy
    with pytest.raises(ValueError):
        arith.bytes_per_param("mpi", 2)


def test_transformer_flops_and_mfu() -> None:
    # the speed section's model: 10 blocks of d 1024 (12 d² each) and a 4096 × 1024 head
    assert arith.transformer_matmul_params(4096, 1024, 10) == 130_023_424
    assert arith.transformer_matmul_params(100, 8, 1, d_ff=16) == 3 * 64 + 64 + 2 * 128 + 800
    per_token = arith.train_flops_per_token(130_023_424, 10, 1024, 1024)
    assert per_token == 6 * 130_023_424 + 12 * 10 * 1024 * 1024 == 905_969_664
    # 100 samples of 1024 tokens a second on a 989 TFLOP/s GPU
    assert arith.mfu(100.0, 1024, per_token, 989.0) == pytest.approx(100 * 1024 * 905_969_664 / 989e12)
    assert arith.mfu(100.0, 1024, per_token, 989.0) == pytest.approx(0.0938, abs=1e-4)
    assert arith.mfu(100.0, 1024, per_token, None) is None
    assert arith.peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert arith.peak_bf16_tflops("NVIDIA H200") == 989.0
    assert arith.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert arith.peak_bf16_tflops("Tesla T4") is None
    assert arith.peak_bf16_tflops("NVIDIA H100 80GB HBM3", override=800.0) == 800.0


def test_matmul_parameters_are_the_models_linear_weights() -> None:
    torch = pytest.importorskip("torch")
    from polytrain.adapters.torch.transformer import build_transformer
    from polytrain.data.source import DatasetInfo
    from polytrain.spec.zoo import TransformerParams

    model = build_transformer(TransformerParams(d_model=48, n_heads=4, n_layers=3),
                              DatasetInfo(input_shape=(16,), num_outputs=50, task="next_token"))
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == arith.transformer_matmul_params(50, 48, 3) == 3 * 12 * 48 * 48 + 50 * 48


def test_verdicts() -> None:
    assert arith.accuracy_verdict(0.9694, 0.9749, 0.02, 0.95) == (
        "PASS", "≥ 0.9549 (CPU 0.9749 − 0.02, floor 0.95)")
    assert arith.accuracy_verdict(0.9499, 0.9600, 0.02, 0.95)[0] == "FAIL"  # over CPU − slack, under floor
    assert arith.accuracy_verdict(0.80, 0.8091, 0.03) == ("PASS", "≥ 0.7791 (CPU 0.8091 − 0.03)")
    assert arith.accuracy_verdict(0.77, 0.8091, 0.03)[0] == "FAIL"
    assert arith.accuracy_verdict(None, 0.9, 0.02)[0] == "FAIL"
    assert arith.accuracy_verdict(float("nan"), 0.9, 0.02)[0] == "FAIL"
    assert arith.ratio_verdict(16.5, 16.0, 0.8, 1.1) == ("PASS", pytest.approx(1.03125))
    assert arith.ratio_verdict(20.0, 16.0, 0.8, 1.1) == ("FAIL", 1.25)
    assert arith.speed_verdict(0.1025, 0.1000, 1.03) == ("PASS", pytest.approx(1.025))
    assert arith.speed_verdict(0.1040, 0.1000, 1.03) == ("FAIL", pytest.approx(1.04))
    assert arith.window_step_times([0.0, 1.0, 3.0, 6.0, 10.0], 2, 1) == [1.0, 1.5, 2.0]
    assert arith.median_step([1.0, 1.5, 2.0]) == 1.5


def test_fp16_overflow_rule() -> None:
    steps = [{"step": s, "skipped_steps": 1.0, "loss_scale": 32768.0} for s in range(1, 20)]
    steps.append({"step": 20, "skipped_steps": 2.0, "loss_scale": 16384.0})
    assert arith.overflow_skipped_at(steps, 20) == (
        True, "update 20: skipped_steps 1→2, loss scale 32768→16384")
    assert arith.overflow_skipped_at(steps, 19)[0] is False  # nothing skipped there
    assert arith.overflow_skipped_at([{"step": 20, "loss": 1.0}], 20) == (
        False, "no skipped_steps logged at updates 19 and 20")


# ------------------------------------------------------------------ rows
def _record(accuracy: float, device: str = "cuda", **extra: object) -> dict:
    where = {"param_devices": [device], "param_dtypes": ["float32"], "state_devices": [device]}
    return {"val_accuracy": accuracy, "seconds": 3.2, "start": where, "end": where, "backend_label": "ddp",
            **extra}


def test_train_rows() -> None:
    digits = cases.runs("full", ("correctness",))[0]
    row = train_row(digits, "ddp ×1 (nccl)", _record(0.9721), 0.9749, "cuda", "full")
    assert (row.result, row.case) == ("PASS", "ddp ×1 (nccl) · digits fp32")
    assert row.measured == "val acc 0.9721; weights cuda float32, optimizer state cuda"
    assert row.reference == "≥ 0.9549 (CPU 0.9749 − 0.02, floor 0.95)"
    assert train_row(digits, "x", _record(0.9721, "cpu"), 0.9749, "cuda", "full").result == "FAIL"
    assert placement_problem(_record(0.9, "cpu"), "cuda") == \
        "weights on ['cpu'] at the start, expected ['cuda']"
    refused = {"error": "DistBackendError: NCCL error: invalid usage", "traceback": "Duplicate GPU detected"}
    assert train_row(digits, "x", refused, 0.97, "cuda", "full", refusals=("Duplicate GPU",)).result == "INFO"
    assert train_row(digits, "x", refused, 0.97, "cuda", "full").result == "FAIL"
    unavailable = {"error": "BackendUnavailableError: precision: fp16 cannot run on cpu here"}
    assert train_row(digits, "x", unavailable, 0.97, "cpu", "quick").result == "SKIP"
    assert train_row(digits, "x", None, 0.97, "cuda", "full", missing="timed out after 300 s").note == \
        "timed out after 300 s"
    fp16 = next(r for r in cases.runs("full", ("precision",)) if r.precision == "fp16")
    steps = [{"step": 19, "skipped_steps": 0.0, "loss_scale": 65536.0},
             {"step": 20, "skipped_steps": 1.0, "loss_scale": 32768.0}]
    said = ["polytrain: fp16 gradient overflow in update 20 of this run: skipped (1 so far), "
            "loss scale now 32768.0"]
    good = _record(0.968, steps=steps, overflow_lines=said)
    assert train_row(fp16, "local", good, 0.9749, "cuda", "full").result == "PASS"
    assert train_row(fp16, "local", _record(0.968, steps=steps), 0.9749, "cuda", "full").result == "FAIL"
    bf16 = next(r for r in cases.runs("full", ("precision",)) if r.name == "digits bf16")
    assert train_row(bf16, "l", _record(0.97, nonfinite=[{"step": 20, "action": "skip"}]), 0.9749, "cuda",
                     "full").result == "PASS"
    assert train_row(bf16, "l", _record(0.97, nonfinite=[]), 0.9749, "cuda", "full").result == "FAIL"
    assert cases.without_skip(bf16).inject_at is None and "reliability" not in cases.without_skip(bf16).raw


def test_memory_rows() -> None:
    psi = 10**8
    ddp = [{"psi": psi, "params": 4 * psi, "grads": 4 * psi, "optimizer_state": 8 * psi, "master_copy": 0,
            "other": 0, "peak": 26 * psi}]
    row = memory_row("ddp", "ddp ×1", 1, ddp)
    assert row.result == "PASS" and row.measured == "state 1.49 GiB (1.000×), peak 2.42 GiB (1.62×)"
    assert row.reference.startswith("1.49 GiB = 16Ψ, Ψ = 100.0 M, N = 1")
    assert memory_row("ddp", "ddp ×1", 1, [{**ddp[0], "peak": 33 * psi}]).result == "FAIL"  # > 2 × 16Ψ
    assert memory_row("ddp", "ddp ×1", 1, [{**ddp[0], "peak": 33 * psi, "other": 2 * psi}]).result == "PASS"
    shard = {"psi": psi, "params": 2 * psi, "grads": 2 * psi, "optimizer_state": 4 * psi, "peak": 10 * psi}
    shards = [shard, shard]
    assert memory_row("fsdp", "fsdp ×2", 2, shards).measured.startswith("state 0.75 GiB (1.000×)")
    assert memory_row("ddp", "ddp ×2", 2, shards).result == "FAIL"  # half of what DDP must hold
    refused = [{"error": "RuntimeError: reduce_scatter", "traceback": "ProcessGroupGloo: no CUDA here"}]
    assert memory_row("fsdp", "f", 2, refused, refusals=("ProcessGroupGloo",)).result == "INFO"
    assert memory_row("fsdp", "f", 2, None, missing="exit code 1: boom").note == "exit code 1: boom"


def test_speed_rows() -> None:
    cfg = cases.SPEED["full"]
    results = {"hand": {"step_s": 0.100, "samples_per_s": 160.0, "params": 131_000_000},
               "polytrain": {"step_s": 0.102, "samples_per_s": 156.9},
               "lightning": {"step_s": 0.105, "samples_per_s": 152.4, "version": "2.6.6"},
               "accelerate": {"skip": "accelerate is not installed"}}
    labels = {"hand": "hand", "polytrain": "polytrain", "lightning": "Lightning", "accelerate": "Accelerate"}
    rows = {r.case: r for r in speed_rows(results, cfg, 989.0, labels)}
    assert rows["polytrain"].result == "PASS"
    assert rows["polytrain"].reference == "step time 1.020× the hand-written loop's (target ≤ 1.03)"
    # 160 samples of 1024 tokens a second at 905,969,664 FLOPs a token: 15.0 % of 989 TFLOP/s
    assert rows["hand"].measured == "160.0 samples/s, 100.0 ms/step, MFU 15.0%"
    assert rows["polytrain vs Lightning"].result == "PASS"
    assert rows["polytrain vs Lightning"].reference == "polytrain's step time 0.971× this (target ≤ 1.01)"
    assert rows["Accelerate"].result == "SKIP"
    compiled = {**results, "hand-compile": {"step_s": 0.080, "samples_per_s": 200.0},
                "polytrain-compile": {"step_s": 0.084, "samples_per_s": 190.5}}
    rows = {r.case: r for r in speed_rows(compiled, cfg, 989.0, labels | {"hand-compile": "hc",
                                                                          "polytrain-compile": "pc"})}
    assert (rows["hc"].result, rows["hc"].reference) == ("INFO", "1.25× the eager loop's speed")
    assert rows["pc"].result == "FAIL"  # 1.05 × the compiled loop, not the eager one (0.84 ×)
    assert rows["pc"].reference == "step time 1.050× the compiled hand-written loop's (target ≤ 1.03)"
    assert "polytrain vs pc" not in rows and "polytrain vs hc" not in rows
    slow = speed_rows({**results, "polytrain": {"step_s": 0.110, "samples_per_s": 145.5}}, cfg, None, {})
    assert [r.result for r in slow if r.case in ("polytrain", "polytrain vs lightning")] == ["FAIL", "FAIL"]
    assert "MFU n/a" in slow[0].measured


def test_own_loop_rows() -> None:
    """fp32: every micro-step's loss within 1e-4 of the CPU's; bf16/fp16: within 0.05 on average; weights and
    momentum on the device; a refusal is INFO."""
    reference = [2.30, 2.10, 1.90, 1.70]
    placed = {"param_devices": ["cuda"], "state_devices": ["cuda"], "backend_label": "ddp"}
    good = {"losses": [2.30, 2.10, 1.90, 1.70 + 5e-5], **placed}
    row = own_loop.loop_row("ddp ×1 (nccl)", "fp32", good, reference, "cuda")
    assert (row.section, row.case, row.result) == ("own-loop", "own loop · ddp ×1 (nccl) · fp32", "PASS")
    assert row.measured.startswith("max |loss − CPU loss| 5.00e-05 over 4 micro-steps; last loss 1.70")
    assert own_loop.loop_row("d", "fp32", {**good, "losses": [2.30, 2.10, 1.90, 1.70 + 2e-4]}, reference,
                             "cuda").result == "FAIL"
    low = {"losses": [2.34, 2.06, 1.94, 1.66], **placed}  # 0.04 off each time: fine for bf16, not for fp32
    assert own_loop.loop_row("d", "bf16", low, reference, "cuda").result == "PASS"
    assert own_loop.loop_row("d", "fp32", low, reference, "cuda").result == "FAIL"
    assert own_loop.loop_row("d", "bf16", {**low, "losses": [2.4, 2.2, 2.0, 1.8]}, reference, "cuda").result == "FAIL"
    assert own_loop.loop_row("d", "fp32", {**good, "param_devices": ["cpu"]}, reference, "cuda").result == "FAIL"
    assert own_loop.loop_row("d", "fp32", {**good, "losses": good["losses"][:3]}, reference, "cuda").result == "FAIL"
    refused = {"error": "DistBackendError: NCCL", "traceback": "Duplicate GPU detected"}
    assert own_loop.loop_row("d", "fp32", refused, reference, "cuda", refusals=("Duplicate GPU",)).result == "INFO"
    assert own_loop.loop_row("d", "fp32", None, reference, "cuda", missing="timed out").note == "timed out"
    assert own_loop.precisions("cuda") == ("fp32", "bf16", "fp16") and own_loop.precisions("cpu") == ("fp32", "bf16")


def test_table_and_markdown() -> None:
    rows = [Row("correctness", "local · digits fp32", "PASS", "val acc 0.9749", "≥ 0.9549", "2.1 s"),
            Row("memory", "a|b", "FAIL", "state 1.00 GiB", "", ""), Row("speed", "Accelerate", "SKIP")]
    text = format_text(rows).splitlines()
    assert text[0].split() == ["section", "case", "result", "measured", "reference", "note"]
    assert text[1].startswith("-----------  -------------------  ------")
    assert text[2].index("PASS") == text[0].index("result")
    assert summary(rows) == "1 PASS, 1 FAIL, 1 SKIP" and exit_code(rows) == 1 and exit_code(rows[:1]) == 0
    md = format_markdown(rows, {"device": "NVIDIA H100 80GB HBM3", "date": "2026-11-25 02:00 UTC"})
    lines = md.splitlines()
    assert lines[:4] == ["# GPU check", "", "- **device**: NVIDIA H100 80GB HBM3",
                         "- **date**: 2026-11-25 02:00 UTC"]
    assert "| memory | a\\|b | FAIL | state 1.00 GiB |  |  |" in lines
    assert lines.count("| section | case | result | measured | reference | note |") == 1
    assert last_line("x\nTraceback\nValueError: bad value\n  during handling\n") == "ValueError: bad value"


# ------------------------------------------------------------------ the CPU dry run
def _table(path: Path) -> dict[str, list[str]]:
    rows = [line.split(" | ") for line in path.read_text().splitlines() if line.startswith("| ")][2:]
    return {cells[1]: [c.strip(" |") for c in cells] for cells in rows}


def _accuracy(cells: list[str]) -> float:
    return float(cells[3].split(";")[0].removeprefix("val acc "))


@pytest.mark.slow
def test_dry_run_on_cpu_trains_every_backend(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    md = tmp_path / "results.md"
    result = run_script("--device", "cpu", "--quick", "--sections", "correctness,precision",
                        "--backends", "local,ddp2,fsdp,horovod", "--markdown", str(md), timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    table = _table(md)
    expected = [f"{b} · {r}" for b in ("local", "ddp ×2 (gloo, one device)", "fsdp ×1", "horovod (shim)")
                for r in ("digits fp32", "tokens fp32", "digits bf16", "digits fp16", "tokens bf16")]
    assert sorted(table) == sorted(expected)
    reference = {w: _accuracy(table[f"local · {w} fp32"]) for w in ("digits", "tokens")}
    assert reference["digits"] > 0.85 and reference["tokens"] > 0.35  # 3 and 4 epochs (--quick)
    for case, cells in table.items():
        assert cells[2] in ("PASS", "SKIP"), cells
        if cells[2] == "SKIP":  # fp16 where this CPU has no fp16 kernels
            assert "fp16" in case and "fp16" in cells[5]
            continue
        assert "weights cpu float32, optimizer state cpu" in cells[3]
        workload = case.split(" · ")[1].split()[0]
        assert _accuracy(cells) >= reference[workload] - 0.03
        if "fp32" in case:  # exact averaging: every backend and world size reaches the CPU run's accuracy
            assert _accuracy(cells) == pytest.approx(reference[workload], abs=1.5 / 359)
    assert "non-finite update 20: skipped" in table["ddp ×2 (gloo, one device) · digits bf16"][3]
    fp16 = table["fsdp ×1 · digits fp16"]
    assert fp16[2] == "SKIP" or "update 20: skipped_steps 0→1, loss scale 65536→32768" in fp16[3]
    text = md.read_text()
    assert "- **device**: CPU" in text and "- **versions**: torch " in text and "Result: " in text


@pytest.mark.slow
def test_dry_run_on_cpu_measures_memory_and_speed(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    md = tmp_path / "results.md"
    result = run_script("--device", "cpu", "--quick", "--sections", "memory,speed", "--backends", "ddp,fsdp",
                        "--markdown", str(md), timeout=240)
    # 1: polytrain may miss the speed target on a busy CPU with a tiny model (this is about code paths)
    assert result.returncode in (0, 1), result.stdout + result.stderr[-3000:]
    table = _table(md)
    # ddp ×1 and fsdp ×2 in a process group the check starts (gloo), fsdp ×1 in polytrain's own
    memory = (("ddp ×1", "16Ψ"), ("fsdp full_shard ×1", "16Ψ"),
              ("fsdp full_shard ×2 (gloo, one device)", "8Ψ"))
    for case, formula in memory:
        cells = table[case]
        assert cells[2] == "PASS" and cells[3].startswith("state "), cells
        assert f"= {formula}, Ψ = " in cells[4], cells
        assert float(cells[3].split("(")[1].split("×")[0]) == pytest.approx(1.0, abs=0.05)
    hand, ours = table["hand-written loop"], table["polytrain Trainer"]
    assert hand[2] == "INFO" and float(hand[3].split()[0]) > 0
    assert ours[2] in ("PASS", "FAIL") and "the hand-written loop's (target ≤ 1.03)" in ours[4]
    ratio = float(ours[4].split()[2].rstrip("×"))
    assert ratio == pytest.approx(float(hand[3].split()[0]) / float(ours[3].split()[0]), rel=0.01)
    for name in ("Lightning Trainer", "Accelerate"):
        if name in table:  # not installed here: a skip that says so
            assert table[name][2] == "SKIP" and "not installed" in table[name][5]
    for name in ("hand-written loop, compiled", "polytrain Trainer, compile.enabled"):
        assert table[name][2] == "SKIP" and "CUDA only" in table[name][5]


@pytest.mark.slow
def test_dry_run_on_cpu_runs_the_own_loop(tmp_path: Path) -> None:
    """The own-loop section on the CPU: one process and two ranks give the reference's fp32 losses, bf16 really
    runs in bf16 (its losses differ from fp32's, a little)."""
    pytest.importorskip("torch")
    md = tmp_path / "results.md"
    result = run_script("--device", "cpu", "--sections", "own-loop", "--backends", "local,ddp2",
                        "--markdown", str(md), timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    table = _table(md)
    for label in ("local", "ddp ×2 (gloo, one device)"):
        fp32, bf16 = table[f"own loop · {label} · fp32"], table[f"own loop · {label} · bf16"]
        assert fp32[2] == bf16[2] == "PASS", (fp32, bf16)
        assert _loss_gap(fp32[3]) <= 1e-4 and "over 40 micro-steps" in fp32[3] and "weights cpu" in fp32[3]
        assert 0 < _loss_gap(bf16[3]) <= 0.05


def _loss_gap(measured: str) -> float:
    """The number in "max |loss − CPU loss| 4.77e-07 over 40 micro-steps; ..." (markdown escapes the bars)."""
    return float(measured.split(" over ")[0].split()[-1])
