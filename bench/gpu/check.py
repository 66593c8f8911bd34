"""The GPU check: every PyTorch backend of polytrain on CUDA, its precisions, memory and speed, in one table.

Run:  bash scripts/gpu_check.sh [--markdown docs/gpu-results.md] [--quick] [--sections ...] [--backends ...]
      python -m bench.gpu --device cpu --quick      (the same code paths on the CPU: a dry run)

Without a usable CUDA device (or with a package missing) it prints one line saying why and exits with
2; otherwise it exits with 1 when a row failed, 0 when none did. Every job runs in processes of its
own (`bench.gpu.launch`), so one backend's crash or hang costs its rows, not the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.gpu import cases, preflight
from bench.gpu.arith import INFO, SKIP, peak_bf16_tflops
from bench.gpu.launch import JobResult, run_job
from bench.gpu.report import Row, exit_code, format_markdown, format_text, summary
from bench.gpu.rows import memory_row, speed_rows, speed_summary, train_row

SECTIONS = ("correctness", "precision", "own-loop", "memory", "speed")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (the check) or cpu (a dry run of the same code paths)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--backends", default=None, help="comma-separated keys: "
                        + ", ".join(cases.backend_cases("cuda")) + " (memory rows follow them too)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer epochs and small models (no accuracy floors)")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown here")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bf16 peak, TFLOP/s (default: from its name)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds per job (default 300; --quick 120)")
    parser.add_argument("--speed-rounds", type=int, default=None,
                        help="interleaved rounds of the speed runners, the best kept (default 2; --quick 1)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep every job's files and logs in this folder")
    args = parser.parse_args(argv)
    args.sections = tuple(s.strip() for s in args.sections.split(",") if s.strip())
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {', '.join(unknown)} (allowed: {', '.join(SECTIONS)})")
    known = cases.backend_cases(args.device)
    chosen = tuple(known) if args.backends is None else \
        tuple(b.strip() for b in args.backends.split(",") if b.strip())
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        parser.error(f"--backends: unknown {', '.join(unknown)} (allowed: {', '.join(known)})")
    args.backends = chosen
    args.mode = "quick" if args.quick else "full"
    args.timeout = args.timeout or (120.0 if args.quick else 300.0)
    args.speed_rounds = args.speed_rounds or (1 if args.quick else 2)
    return args


def say(text: str) -> None:
    print(f"gpu_check: {text}", file=sys.stderr, flush=True)


class Check:
    """Runs the sections' jobs under one work folder and collects the rows."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work, self.rows = args, work, []
        self.has_deepspeed = preflight.installed("deepspeed")

    def job(self, name: str, job: dict[str, Any], nproc: int = 1, env: dict[str, str] | None = None,
            device: str | None = None) -> JobResult:
        started = time.perf_counter()
        result = run_job(job, self.work / name, nproc=nproc, device=device or self.args.device,
                         timeout=self.args.timeout, env=env)
        ok = "timed out" if result.timed_out else f"exit {result.returncodes}"
        say(f"{name}: {time.perf_counter() - started:.0f} s ({ok})")
        return result

    # ------------------------------------------------------------ correctness and precision
    def _train_job(self, case: cases.BackendCase, runs: list[cases.Run], device: str) -> JobResult:
        name = f"train-{case.key}" if device == self.args.device else f"reference-{device}"
        items = []
        for run in runs:
            raw = cases.run_spec(run, case, str(self.work / name / run.name.replace(" ", "-")))
            if case.nproc > 1:  # a stuck collective fails within a minute, not five
                raw["reliability"] = {**raw.get("reliability", {}), "collective_timeout_s": 60.0,
                                      "startup_timeout_s": 60.0}
            items.append({"name": run.name, "raw": raw, "inject_at": run.inject_at})
        job = {"kind": "train", "runs": items, "process_group": case.process_group}
        return self.job(name, job, case.nproc, case.env, device)

    def train_sections(self) -> None:
        args = self.args
        sections = tuple(s for s in ("correctness", "precision") if s in args.sections)
        if not sections:
            return
        every = cases.backend_cases(args.device)
        runs = cases.runs(args.mode, sections)
        references = cases.runs(args.mode, ("correctness",))
        accuracy: dict[str, float | None] = {}
        reused = args.device == "cpu" and "local" in args.backends and "correctness" in sections
        if not reused:  # the CPU run every backend is held to
            result = self._train_job(every["local"], references, "cpu")
            for run in references:
                record = result.run(run.name)
                value = accuracy[run.workload] = record.get("val_accuracy") if record else None
                measured = f"val acc {value:.4f}" if value is not None else \
                    (record or {}).get("error", result.why_missing())
                self.rows.append(Row("reference", f"local on CPU · {run.name}", INFO, measured, "", ""))
        skipped_deepspeed = []
        for key in sorted(args.backends, key=lambda k: k != "local"):  # local first: it may be the reference
            case = every[key]
            if case.needs and not preflight.installed(case.needs):
                skipped_deepspeed.append(case.label)
                continue
            mine = runs if case.nonfinite_skip else [cases.without_skip(run) for run in runs]
            result = self._train_job(case, mine, args.device)
            refused = False
            for run in mine:
                record = result.run(run.name)
                if reused and key == "local" and run.section == "correctness":
                    accuracy[run.workload] = (record or {}).get("val_accuracy")
                if record is None and refused:  # the job stopped at the refusal
                    self.rows.append(Row(run.section, f"{case.label} · {run.name}", INFO, "not run", "",
                                         "refused above"))
                    continue
                row = train_row(run, case.label, record, accuracy.get(run.workload), args.device, args.mode,
                                missing=result.why_missing(), refusals=case.refusals)
                refused = refused or row.measured == "refused"
                self.rows.append(row)
        if skipped_deepspeed:
            self.rows.append(Row("correctness", ", ".join(skipped_deepspeed), SKIP, "", "",
                                 "deepspeed does not import here (carry it: bash scripts/gpu_prepare.sh)"))

    # ------------------------------------------------------------ own loop (polytrain.torch)
    def own_loop_section(self) -> None:
        if "own-loop" not in self.args.sections:
            return
        from bench.gpu import own_loop

        def items(precisions: tuple[str, ...], case: cases.BackendCase) -> list[dict[str, Any]]:
            spec = {k: v for k, v in case.spec.items() if k != "backend"}
            return [{"name": f"own loop {p}", "backend": case.spec["backend"], "precision": p, "spec": spec}
                    for p in precisions]

        local = cases.backend_cases("cpu")["local"]
        reference = self.job("own-loop-reference-cpu", {"kind": "ownloop", "runs": items(("fp32",), local)},
                             device="cpu").run("own loop fp32")
        losses = (reference or {}).get("losses")
        self.rows.append(Row("own-loop", "own loop · local on CPU · fp32", INFO,
                             f"last loss {losses[-1]:.4f}" if losses else (reference or {}).get("error", "no record"),
                             "", ""))
        for key in self.args.backends:
            case = cases.backend_cases(self.args.device)[key]
            if case.needs and not preflight.installed(case.needs):
                self.rows.append(Row("own-loop", f"own loop · {case.label}", SKIP, "", "",
                                     f"{case.needs} does not import here"))
                continue
            job = {"kind": "ownloop", "runs": items(own_loop.precisions(self.args.device), case),
                   "process_group": case.process_group}
            result = self.job(f"own-loop-{key}", job, case.nproc, case.env)
            refused = False
            for precision in own_loop.precisions(self.args.device):
                record = result.run(f"own loop {precision}")
                if record is None and refused:  # the job stopped at the refusal
                    self.rows.append(Row("own-loop", f"own loop · {case.label} · {precision}", INFO, "not run", "",
                                         "refused above"))
                    continue
                row = own_loop.loop_row(case.label, precision, record, losses, self.args.device,
                                        result.why_missing(), case.refusals)
                refused = refused or row.measured == "refused"
                self.rows.append(row)

    # ------------------------------------------------------------ memory
    def memory_section(self) -> None:
        if "memory" not in self.args.sections:
            return
        skipped = []
        chosen = set(self.args.backends) | ({"ddp2"} if "ddp2-gloo" in self.args.backends else set())
        for case in cases.MEMORY_CASES:
            if case.backend not in chosen:
                continue
            if case.settings["backend"] == "deepspeed" and not self.has_deepspeed:
                skipped.append(case.label)
                continue
            group = case.process_group
            if group == "auto":
                group = "nccl" if self.args.device == "cuda" else "gloo"
            name = f"memory-{case.backend}-x{case.nproc}"
            raw = cases.memory_spec(case.settings, self.args.mode, str(self.work / name / "out"))
            job = {"kind": "memory", "runs": [{"name": "memory", "raw": raw}], "process_group": group,
                   "stop_on_error": True}
            result = self.job(name, job, case.nproc)
            records = [r for rank in result.ranks for r in rank if r.get("name") == "memory"]
            if len(records) < case.nproc and not any("error" in r for r in records):
                records = []
            self.rows.append(memory_row(case.formula, case.label, case.nproc, records,
                                        missing=result.why_missing(), refusals=case.refusals))
        if skipped:
            self.rows.append(Row("memory", ", ".join(skipped), SKIP, "", "",
                                 "deepspeed does not import here"))

    # ------------------------------------------------------------ speed
    def speed_section(self) -> None:
        if "speed" not in self.args.sections:
            return
        from bench.gpu.speed import COMPILED, LABELS, RUNNERS

        cfg = cases.SPEED[self.args.mode]
        best: dict[str, dict[str, Any]] = {}
        if self.args.device != "cuda":
            best.update({r: {"skip": "torch.compile's runners run on CUDA only"} for r in COMPILED})
        for round_ in range(self.args.speed_rounds):
            for runner in RUNNERS:
                if "skip" in best.get(runner, {}):
                    continue
                job = {"kind": "speed", "runs": [{"name": runner, "runner": runner,
                                                  "config": dataclasses.asdict(cfg)}]}
                result = self.job(f"speed-{runner}-{round_ + 1}", job)
                record = result.run(runner) or {"error": result.why_missing()}
                previous = best.get(runner, {})
                if not previous or record.get("step_s", float("inf")) < previous.get("step_s", float("inf")):
                    best[runner] = record
        name = self.device_name()
        peak = peak_bf16_tflops(name, self.args.peak_tflops)
        self.rows += speed_rows(best, cfg, peak, LABELS)
        ratios = speed_summary(best)
        if ratios:
            text = ", ".join(f"{LABELS[r]} {v:.3f}" for r, v in ratios.items())
            self.rows.append(Row("speed", "samples/s ÷ hand-written loop's", INFO, text, "", ""))

    def device_name(self) -> str:
        if self.args.device != "cuda":
            return "cpu"
        import torch

        return torch.cuda.get_device_name(0)


def write_markdown(path: Path, rows: list[Row], header: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(format_markdown(rows, header))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    reason = preflight.why_not(args.device) or preflight.polytrain_reason()
    if reason:
        print(f"gpu_check: {reason}", file=sys.stderr)
        return preflight.EXIT_UNAVAILABLE
    header = preflight.versions(args.device, argv)
    work = args.keep or Path(tempfile.mkdtemp(prefix="polytrain-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    check = Check(args, work)
    started = time.perf_counter()
    try:
        check.train_sections()
        check.own_loop_section()
        check.memory_section()
        check.speed_section()
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
    took = time.perf_counter() - started
    header["run time"] = f"{took:.0f} s ({args.mode}; sections: {', '.join(args.sections)})"
    print(format_text(check.rows))
    print(f"\n{summary(check.rows)}")
    if args.markdown is not None:
        write_markdown(args.markdown, check.rows, header)
        say(f"wrote {args.markdown}")
    return exit_code(check.rows)
