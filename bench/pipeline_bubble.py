"""Pipeline bubbles: the idle fraction of each pipeline stage, measured from ``--timeline``, against (P−1)/(M+P−1).

Run:  python bench/pipeline_bubble.py [--schedules gpipe 1f1b] [--microbatches 4 8 16] [--interleaved]
      [--zero-bubble]  (one ``polytrain train`` under torchrun, 2 ranks, per schedule and M; ~1 min, ~1.5 with
      --interleaved, ~3 with --zero-bubble too)

The zoo's transformer LM (d_model 256, 4 heads, 4 blocks, vocab 256, 64 tokens, untied head), Adam, fp32,
``parallel.pipeline: 2`` (P = 2 stages, one per rank; gloo on CPU), ``--mb-size`` samples in each pipeline
micro-batch (``data.batch_size`` = M × that), so a micro-batch costs the same at every M. Each run writes a
Chrome trace (``--timeline``); the first ``--warmup`` steps are skipped (shape inference, allocator warm-up).

For every later step: the events of each rank's pipeline stages (track "pipeline stages": forward and
backward of each micro-batch) inside that rank's ``micro-step`` span; the step's span is from the first such
event to the last across the whole pipeline, on the trace's common clock (every rank's origin is taken right
after a barrier); a stage's idle fraction is 1 − (its busy time) / span. Averaged over steps, printed per stage
next to the theory, (P−1)/(M+P−1) — with ``--interleaved`` (interleaved_1f1b, 2 chunks per rank, V = 2)
(P−1)/(V·M+P−1) — and measured/theory (mean of the stages).

The theory assumes equal stages and free communication: waits for a peer's activations or gradients (gloo
over loopback) and any imbalance between the stages (the last holds the head and the loss, the first the
embeddings) count as idle here, so the ratio is ≥ 1 in practice. On a shared machine, another process taking
a core stretches one stage and shows up as idle in the other: numbers from a loaded machine are noisy.

Measured (2 cores shared with other test runs, load average 3-4; 8 samples per micro-batch), idle of stage 0/1:
gpipe M=4 0.29/0.26, M=8 0.16/0.16, M=16 0.15/0.15 (theory 0.20, 0.11, 0.06); 1f1b M=4 0.25/0.22,
M=8 0.20/0.14, M=16 0.12/0.09; interleaved_1f1b M=4 0.21/0.16, M=8 0.13/0.15, M=16 0.11/0.10 (theory 0.11,
0.06, 0.03). The idle falls with M as the theory says, but ~0.1 above it: a fixed cost per micro-batch (the
activation/gradient hand-off over gloo, the schedule's own work) and the other jobs' time slices. With 16
samples per micro-batch 1f1b M=8 read 0.17/0.12 (ratio 1.30, against 1.55 with 8), as a fixed per-hand-off
cost predicts.

The zero-bubble family (``--zero-bubble``; the theory in `theory`, 0 for ZBV and DualPipeV; the same idle
measure, the weight passes counting as busy), measured in one run with 1f1b and interleaved_1f1b (2 cores, idle
otherwise), step time in ms at M = 4 / 8 / 16: 1f1b 555 / 1024 / 1930, interleaved_1f1b 577 / 727 / 1769,
interleaved_zero_bubble 592 / 808 / 1579, zbv 415 / 1010 / 1595, dualpipev 381 / 890 / 1331; mean idle at M = 16:
0.14, 0.14, 0.12, 0.11, 0.09. DualPipeV is the fastest at every M here, ZBV next at M = 4 and 16: the V puts the
first stage (embeddings, light) and the last (head and loss, heavy) on one rank, which evens the two ranks' work,
hands stage 1's output to stage 2 without a send (same rank), and the weight passes fill what is left. Their idle
stays ~0.1 above the paper's zero: on CPU a weight pass costs about twice an input pass (the first stage's runs
the whole backward: it has no input gradient to split off), not the equal thirds the theory assumes, and every
hand-off over gloo is a fixed cost.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from group_run import run_group  # bench/, first on sys.path

REPO = Path(__file__).resolve().parents[1]
P = 2
MODEL = {"d_model": 256, "n_heads": 4, "n_layers": 4, "tie_weights": False}
VOCAB, SEQ = 256, 64
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
MULTI = SCHEDULES[2:]  # 2 model chunks per rank (V = 2): round robin, or V-shaped for zbv and dualpipev
ZERO_BUBBLE = SCHEDULES[3:]


def train_command(schedule: str, m: int, mb_size: int, steps: int, out: Path, trace: Path) -> list[str]:
    from polytrain.comm.net import free_port

    batch = m * mb_size
    # one batch held out for the end-of-epoch validation (not measured; it needs a whole batch, see the report)
    settings = {"model.name": "transformer", "data.name": "tokens", "data.tokens.samples": batch * (steps + 1),
                "data.tokens.seq_len": SEQ, "data.tokens.vocab": VOCAB, "data.val_fraction": 1 / (steps + 1),
                "data.batch_size": batch, "optimizer.name": "adam", "optimizer.lr": 1e-3, "backend": "ddp",
                "parallel.pipeline": P, "parallel.schedule": schedule, "parallel.microbatches": m,
                "loop.epochs": 1, "loop.max_steps": steps, "output": out}
    settings.update({f"model.params.{key}": str(value).lower() if isinstance(value, bool) else value
                     for key, value in MODEL.items()})
    if schedule in MULTI:
        settings["parallel.stages_per_rank"] = 2
    cmd = [str(Path(sys.executable).parent / "torchrun"), f"--nproc_per_node={P}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "polytrain.cli", "train", "--quiet", "--timeline", str(trace)]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def run_once(schedule: str, m: int, mb_size: int, steps: int, root: Path, timeout: float) -> dict[str, Any]:
    out, trace = root / f"{schedule}-{m}", root / f"{schedule}-{m}.json"
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    code, output = run_group(train_command(schedule, m, mb_size, steps, out, trace), env, timeout, f"{schedule} M={m}",
                             cwd=REPO)
    if code != 0:
        sys.exit(f"pipeline_bubble.py: {schedule} M={m}: training failed (exit {code}):\n{output[-3000:]}")
    return json.loads(trace.read_text())


def analyse(trace: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Per rank: mean idle fraction over the steps after ``warmup``, mean forward/backward ms; mean step span."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    ranks = sorted({e["pid"] for e in events})
    windows = {(e["pid"], e["args"]["step"], e["args"].get("micro", 0)): (e["ts"], e["ts"] + e["dur"])
               for e in events if e["name"] == "micro-step"}
    stage_events = [e for e in events if e["cat"] == "pipeline"
                    and e["name"] in ("forward", "backward", "backward (weights)")]
    keys = sorted({(step, micro) for _, step, micro in windows if step > warmup})
    if not keys:
        raise SystemExit("pipeline_bubble.py: no steps after the warm-up in the trace; raise --steps")
    idle: dict[int, list[float]] = {r: [] for r in ranks}
    spans: list[float] = []
    for key in keys:
        mine: dict[int, list[dict[str, Any]]] = {}
        for rank in ranks:
            start, end = windows[(rank, *key)]
            mine[rank] = [e for e in stage_events if e["pid"] == rank and start <= e["ts"] <= end]
        inside = [e for group in mine.values() for e in group]
        span = max(e["ts"] + e["dur"] for e in inside) - min(e["ts"] for e in inside)
        spans.append(span)
        for rank in ranks:
            idle[rank].append(1.0 - sum(e["dur"] for e in mine[rank]) / span)
    steps = {step for step, _ in keys}
    timed = [e for e in stage_events if any(
        windows[(e["pid"], *key)][0] <= e["ts"] <= windows[(e["pid"], *key)][1] for key in keys)]

    def mean_ms(rank: int, name: str) -> float:
        durs = [e["dur"] for e in timed if e["pid"] == rank and e["name"] == name]
        return statistics.fmean(durs) / 1e3 if durs else float("nan")

    return {"idle": {r: statistics.fmean(v) for r, v in idle.items()}, "span_ms": statistics.fmean(spans) / 1e3,
            "steps": len(steps), "fwd_ms": {r: mean_ms(r, "forward") for r in ranks},
            "bwd_ms": {r: mean_ms(r, "backward") for r in ranks},
            "wgt_ms": {r: mean_ms(r, "backward (weights)") for r in ranks}}


def theory(schedule: str, m: int) -> float:
    """The idle fraction each schedule's paper gives, with a forward, an input-gradient and a weight-gradient pass
    of equal time (a full backward is two of them) and free communication: 1F1B and GPipe (P−1)/(M+P−1);
    interleaved 1F1B with V chunks (P−1)/(V·M+P−1); zero-bubble ZB-H1 leaves (P−1)(F+B−W) of 1F1B's (P−1)(F+B+W)
    idle, a third, and interleaved over V chunks (P−1)/(3·V·M+P−1); ZB-V and DualPipeV fill the rest with the
    weight passes: (P−1)(F+B−2W) = 0 and (P/2−1)(F&B+B−3W) = 0."""
    if schedule in ("zbv", "dualpipev"):
        return 0.0
    chunks = 2 if schedule in MULTI else 1
    passes = 3 if schedule == "interleaved_zero_bubble" else 1
    return (P - 1) / (passes * chunks * m + P - 1)


def line(schedule: str, m: int, result: dict[str, Any]) -> str:
    label = "rank" if schedule in MULTI else "stage"
    idle = result["idle"]
    stages = ", ".join(f"{label} {r} idle {v:.2f}" for r, v in idle.items())
    expected, mean = theory(schedule, m), statistics.fmean(idle.values())
    ratio = f"ratio {mean / expected:.2f}" if expected else f"excess {mean - expected:+.2f}"
    fwd = "/".join(f"{v:.1f}" for v in result["fwd_ms"].values())
    bwd = "/".join(f"{v:.1f}" for v in result["bwd_ms"].values())
    weights = "/".join(f"{v:.1f}" for v in result["wgt_ms"].values())
    split = f", weights {weights} ms" if schedule in ZERO_BUBBLE else ""
    return (f"{schedule} M={m}: {stages} | theory {expected:.2f} | {ratio}   (step {result['span_ms']:.0f} ms, "
            f"{result['steps']} steps; fwd {fwd} ms, bwd {bwd} ms{split} per {label})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"],
                        choices=SCHEDULES)
    parser.add_argument("--microbatches", nargs="+", type=int, default=[4, 8, 16], metavar="M")
    parser.add_argument("--interleaved", action="store_true",
                        help="also run interleaved_1f1b with stages_per_rank 2")
    parser.add_argument("--zero-bubble", action="store_true",
                        help="also run interleaved_zero_bubble, zbv and dualpipev (2 chunks per rank)")
    parser.add_argument("--mb-size", type=int, default=8, help="samples per pipeline micro-batch (default 8)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per run, warm-up included (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out (default 2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run before it is killed")
    args = parser.parse_args()
    if args.mb_size < 1 or args.steps <= args.warmup or min(args.microbatches) < 1:
        parser.error("--mb-size and M must be ≥ 1 and --steps greater than --warmup")
    schedules = list(dict.fromkeys([*args.schedules, *(["interleaved_1f1b"] if args.interleaved else []),
                                    *(ZERO_BUBBLE if args.zero_bubble else [])]))
    print(f"transformer LM {MODEL}, vocab {VOCAB}, {SEQ} tokens, {args.mb_size} samples per micro-batch, Adam, "
          f"fp32, P = {P} pipeline ranks (gloo, CPU, 1 thread each); mean over {args.steps - args.warmup} steps "
          f"after {args.warmup} warm-up")
    with tempfile.TemporaryDirectory(prefix="polytrain-bubble-") as tmp:
        for schedule in schedules:
            for m in args.microbatches:
                trace = run_once(schedule, m, args.mb_size, args.steps, Path(tmp), args.timeout)
                print(line(schedule, m, analyse(trace, args.warmup)), flush=True)


if __name__ == "__main__":
    main()
