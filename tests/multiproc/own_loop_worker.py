"""A hand-written training loop on `polytrain.torch.Distributed` (`bench.gpu.own_loop.train_digits`, the loop the
GPU check runs too), as a script would have it: the digits MLP,
SGD with momentum, 2 micro-steps of accumulation, clipping that bites, 20 optimizer steps. Each micro-step's
global batch of 32 is split across the ranks (rank r takes every world-th sample), so any world size sees the
same samples per update. Rank 0 writes every micro-step's loss (averaged over the ranks) and the final weights.

Usage: python own_loop_worker.py BACKEND OUT.json [--launch NP [--fail-rank R]] [--stop K --save ROOT | --resume ROOT]
                                  [--preempt K --every N --save ROOT]
       python own_loop_worker.py --jobs JOBS.json
(BACKEND may be a comma list: each runs in turn in the same processes, a session after the previous one ended,
and writes OUT with ``{backend}`` replaced by its name.)
(``--launch``: the script starts its NP processes itself through `Distributed.launch`, the ``mp.spawn`` case;
``--fail-rank``: that rank raises before training, to see the others stopped and the failure named;
``--stop K --save ROOT``: stop before update K and save a checkpoint under ROOT; ``--resume ROOT``: load the
newest checkpoint there and go on from its step to the end; ``--preempt K``: with a ``preemption`` table, the
last rank SIGTERMs itself after update K, the loop asks ``dist.preempted`` after every update (the ranks agree
every N), saves under ROOT where it stopped and ends with ``dist.exit_preempted``.)
(``--jobs``: test_own_loop.py's shared launches: a JSON list of jobs run in turn in these processes, each
``{"do": "loop", "backend", "out"}`` with `train`'s keywords (``stop``, ``save``, ``resume``, ``preempt``,
``every``), ``{"do": "launch", "backend", "out", "np", "fail_rank"}`` (``--launch``), ``{"do": "fit", "sets",
"out", "resume"}`` (the Trainer on the default spec with ``sets``, into the directory ``out``, as ``polytrain train``
runs it), or the ``run`` of gather_worker.py, loop_fp16_worker.py or loop_trainer_worker.py (``"do": "gather" |
"fp16" | "trainer"``, with its arguments): a launch costs seconds of CPU per rank before it trains.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # bench/ is a folder of the repository, not installed

import torch  # noqa: E402

from bench.gpu.own_loop import ACCUM, CLIP, STEPS, train_digits  # noqa: E402
from polytrain.torch import Distributed, OwnLoopError  # noqa: E402


def flag(name: str) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else None


def train(backend: str, out: str, fail_rank: int = -1, stop: int = STEPS, save: str | None = None,
          resume: str | None = None, preempt: int = 0, every: int = 0) -> None:
    spec = None
    if backend.startswith("deepspeed"):  # "deepspeed-3": ZeRO stage 3; the engine clips at the spec's norm
        backend, stage = "deepspeed", int(backend.partition("-")[2] or 2)
        spec = {"deepspeed": {"stage": stage}, "loop": {"grad_clip_norm": CLIP}, "output": f"{out}.deepspeed"}
    if preempt:
        spec = {**(spec or {}), "preemption": {"signals": ["SIGTERM"]}}
    dist = Distributed(backend, grad_accum_steps=ACCUM, spec=spec)
    if dist.rank == fail_rank:
        raise RuntimeError(f"rank {dist.rank} fails on purpose")
    # imported here: it imports scikit-learn (seconds of CPU), which a rank that runs no loop does without
    from clean_exit_fit import native_threads

    restore = (lambda model, optimizer: dist.load(resume, {"model": model, "optimizer": optimizer})["step"]) \
        if resume else None
    stopped: list[int] = []

    def preempted(done: int) -> bool:
        if done == preempt and dist.rank == dist.world_size - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to this rank only
        if dist.preempted(done, every_n_steps=every):
            stopped.append(done)
        return bool(stopped)

    model, optimizer, losses, norms = train_digits(dist, last=stop, restore=restore,
                                                   stop=preempted if preempt else None)
    if stopped:
        dist.save(save, {"model": model, "optimizer": optimizer, "step": stopped[0]})
        dist.exit_preempted(stopped[0])
    if save:
        dist.save(save, {"model": model, "optimizer": optimizer, "step": stop})
    refused = ""
    if dist.backend_name == "deepspeed":  # a norm other than the engine's is refused in one line
        try:
            dist.clip_grad_norm_(model, CLIP / 2)
        except OwnLoopError as exc:
            refused = str(exc)
    state = dist.get_state_dict(model)
    dist.end()
    # the model and optimizer are still held here, as a script holds them: the groups ended all the same
    left, after = native_threads(), after_the_job(model, dist.backend_name)
    if dist.is_main:
        with open(out, "w") as f:
            json.dump({"backend": dist.backend_name, "label": dist.backend.label, "launcher": dist.world.launcher,
                       "world": dist.world_size, "refused": refused, "losses": losses, "norms": norms,
                       "weights": {k: v.flatten().tolist() for k, v in state.items()}, "threads_left": left,
                       "after_end": after, "niceness": os.nice(0)}, f)


def after_the_job(model: torch.nn.Module, backend: str) -> str:
    """What the set-up model does after `end()`: ddp runs its module on this process (``local <sum>``, its output
    on a fixed input), fsdp refuses in one line; the other backends are not asked."""
    if backend not in ("ddp", "fsdp"):
        return ""
    try:
        return f"local {float(model(torch.ones(2, 64)).sum()):.6e}"
    except OwnLoopError as exc:
        return str(exc)


def run_jobs(path: str) -> None:
    """``--jobs``: each job in turn (a session after the previous one ended)."""
    import importlib

    for job in json.loads(Path(path).read_text()):
        do = job.pop("do")
        if do == "loop":
            train(**job)
        elif do == "fit":
            from polytrain import validation
            from polytrain.train.trainer import Trainer

            spec = validation.load(None, [*job["sets"], f"output={job['out']}"])
            Trainer(spec, show_progress=False, resume=job.get("resume")).fit()
        elif do == "launch":
            Distributed.launch(train, job["backend"], job["out"], job.get("fail_rank", -1), np=job["np"])
        else:
            worker = {"gather": "gather_worker", "fp16": "loop_fp16_worker", "trainer": "loop_trainer_worker"}[do]
            importlib.import_module(worker).run(**job)


def main() -> None:
    if sys.argv[1] == "--jobs":
        run_jobs(sys.argv[2])
        return
    backend, out = sys.argv[1], sys.argv[2]
    if "--launch" not in sys.argv:
        steps = {"stop": int(flag("--stop") or STEPS), "save": flag("--save"), "resume": flag("--resume"),
                 "preempt": int(flag("--preempt") or 0), "every": int(flag("--every") or 0)}
        for one in backend.split(","):  # several: one session after another in these processes, OUT per backend
            train(one, out.replace("{backend}", one), **steps)
        return
    np = int(sys.argv[sys.argv.index("--launch") + 1])
    fail = int(sys.argv[sys.argv.index("--fail-rank") + 1]) if "--fail-rank" in sys.argv else -1
    Distributed.launch(train, backend, out, fail, np=np)


if __name__ == "__main__":
    main()
