"""TensorFlow backends' training throughput against a hand-written MultiWorkerMirroredStrategy loop,
and TensorFlow against PyTorch on the same spec.

Run:  python bench/tf_backends.py [--steps 150]      (~5–10 min on 2 cores)

The anchor is the loop a TensorFlow user writes by hand for 2 workers: MWMS with RING
collectives, the model and a Keras SGD optimizer created under ``strategy.scope()``, and a
``tf.function`` that runs ``strategy.run`` of a GradientTape step on each worker's half of
the global batch. polytrain runs the same model, data, batch and optimizer from a spec:
TensorFlow on ``local`` (1 process), ``tf-multiworker`` (``polytrain launch --launcher
local -np 2``), ``mpi`` (``mpirun -np 2``) and ``horovod`` (``horovodrun -np 2 --gloo``, when
Horovod is installed); PyTorch on ``local``, ``ddp``, ``mpi`` and ``horovod``.
Throughput is training samples per second over all workers, from the Trainer's
per-window measurements (the first window, which includes tracing, is left out); the
anchor is timed the same way after warm-up steps. Every process runs 1 thread. Each
configuration runs ``--repeat`` times and the best throughput counts (the machine is shared;
interference only ever slows a run down).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FEATURES, CLASSES, SAMPLES, HIDDEN, BATCH, LR, MOMENTUM = 256, 10, 8192, (512, 512), 64, 0.01, 0.9
LOG_EVERY = 25


def spec_dict(framework: str, backend: str, steps: int, out: str) -> dict:
    return {"framework": framework, "backend": backend, "seed": 0, "output": out,
            "model": {"name": "mlp", "params": {"hidden_sizes": list(HIDDEN)}},
            "data": {"name": "synthetic", "batch_size": BATCH,
                     "synthetic": {"samples": SAMPLES, "features": FEATURES, "classes": CLASSES}},
            "optimizer": {"name": "sgd", "lr": LR, "momentum": MOMENTUM},
            "loop": {"epochs": 100, "max_steps": steps, "log_every_n_steps": LOG_EVERY}}


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "SLURM_", "TF_CONFIG"))}
    out.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1",
               TF_NUM_INTEROP_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_btl_tcp_if_include="lo",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        out.pop(key, None)
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- the hand-written anchor
def anchor_worker(rank: int, port: int, steps: int, out_file: str) -> None:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]},
                                          "task": {"type": "worker", "index": rank}})
    import keras
    import numpy as np
    import tensorflow as tf

    from polytrain import validation
    from polytrain.data import load_dataset

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    spec = validation.from_dict(spec_dict("tensorflow", "auto", steps, "unused"))
    data = load_dataset(spec.data, spec.seed)
    global_batch = 2 * BATCH
    with strategy.scope():
        layers = [keras.Input((FEATURES,))] + [keras.layers.Dense(h, activation="relu") for h in HIDDEN]
        model = keras.Sequential([*layers, keras.layers.Dense(CLASSES)])
        optimizer = keras.optimizers.SGD(LR, momentum=MOMENTUM)

    def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss_sum = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
            loss = loss_sum / global_batch
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss_sum

    @tf.function
    def train_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        return strategy.run(replica_step, args=(x, y))

    n = len(data.x_train)
    order = np.random.default_rng(0).permutation(n)

    def batch(i: int) -> tuple[np.ndarray, np.ndarray]:
        start = (i * global_batch) % (n - global_batch) + rank * BATCH
        idx = order[start:start + BATCH]
        return data.x_train[idx], data.y_train[idx]

    warmup = LOG_EVERY
    for i in range(warmup):
        float(train_step(*batch(i)))
    begin = time.perf_counter()
    for i in range(warmup, steps):
        float(train_step(*batch(i)))  # a host sync per step, as the Trainer does
    elapsed = time.perf_counter() - begin
    if rank == 0:
        Path(out_file).write_text(json.dumps({"samples_per_s": (steps - warmup) * global_batch / elapsed}))


def run_anchor(steps: int, tmp: Path) -> float:
    out, port = tmp / "anchor.json", free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "anchor", str(rank), str(port), str(steps), str(out)],
                              env=env(), cwd=REPO) for rank in range(2)]
    if any(p.wait(timeout=1200) != 0 for p in procs):
        raise SystemExit("the MWMS anchor failed")
    return json.loads(out.read_text())["samples_per_s"]


# ----------------------------------------------------------------------------- polytrain runs
def run_polytrain(framework: str, backend: str, launcher: str, steps: int, tmp: Path) -> float:
    out = Path(tempfile.mkdtemp(prefix=f"{framework}-{backend}-", dir=tmp))  # fresh: metrics.jsonl appends
    spec_file = out / "spec.json"
    spec_file.write_text(json.dumps(spec_dict(framework, backend, steps, str(out))))
    train = ["-m", "polytrain.cli", "train", str(spec_file), "--quiet"]
    if launcher == "single":
        cmd = [sys.executable, *train]
    elif launcher == "local":
        cmd = [sys.executable, "-m", "polytrain.cli", "launch", "--launcher", "local", "-np", "2", str(spec_file),
               "--quiet"]
    elif launcher == "horovodrun":
        cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", "--network-interface", "lo",
               sys.executable, *train]
    else:
        cmd = [str(BIN / "mpirun"), "--oversubscribe", "-np", "2", sys.executable, *train]
    subprocess.run(cmd, env=env(), cwd=REPO, check=True, timeout=1200, stdout=subprocess.DEVNULL)
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    windows = [e for e in events if e["event"] == "step"]
    global_batch = BATCH * (1 if launcher == "single" else 2)
    samples = seconds = 0.0
    for before, window in zip(windows, windows[1:]):  # the first window (with tracing) is left out
        count = (window["step"] - before["step"]) * global_batch
        samples += count
        seconds += count / window["samples_per_s"]
    return samples / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeat", type=int, default=2, help="runs per configuration; the best counts")
    args = parser.parse_args()
    runs = [("tensorflow", "local", "single"), ("tensorflow", "tf-multiworker", "local"),
            ("tensorflow", "mpi", "mpirun"), ("torch", "local", "single"), ("torch", "ddp", "local"),
            ("torch", "mpi", "mpirun")]
    if (BIN / "horovodrun").exists():
        runs += [("tensorflow", "horovod", "horovodrun"), ("torch", "horovod", "horovodrun")]
    with tempfile.TemporaryDirectory(prefix="polytrain-bench-") as tmp:
        anchor, speeds = 0.0, {(fw, be): 0.0 for fw, be, _ in runs}
        for _ in range(args.repeat):  # interleaved, so a busy minute does not hit one configuration only
            anchor = max(anchor, run_anchor(args.steps, Path(tmp)))
            for fw, be, launcher in runs:
                speeds[fw, be] = max(speeds[fw, be], run_polytrain(fw, be, launcher, args.steps, Path(tmp)))
    print(f"\nMLP {FEATURES}-{'-'.join(map(str, HIDDEN))}-{CLASSES}, batch {BATCH} per worker, SGD, fp32, "
          f"{args.steps} steps, 1 thread per process, best of {args.repeat}\n")
    print(f"{'run':<34} {'samples/s':>10} {'vs MWMS hand loop':>18}")
    print(f"{'MWMS hand-written loop (2 workers)':<34} {anchor:>10.0f} {1.0:>18.2f}")
    for (fw, be), speed in speeds.items():
        print(f"{fw + '/' + be:<34} {speed:>10.0f} {speed / anchor:>18.2f}")
    print("\nTensorFlow / PyTorch on the same spec:")
    pairs = [("local", "local"), ("tf-multiworker", "ddp"), ("mpi", "mpi"), ("horovod", "horovod")]
    for tf_backend, torch_backend in pairs:
        if ("tensorflow", tf_backend) not in speeds:
            continue
        ratio = speeds["tensorflow", tf_backend] / speeds["torch", torch_backend]
        print(f"  tensorflow/{tf_backend} vs torch/{torch_backend}: {ratio:.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "anchor":
        anchor_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
