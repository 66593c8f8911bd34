"""``tf-multiworker``: gradients averaged by ``tf.distribute.MultiWorkerMirroredStrategy``'s collectives.

The cluster comes from the detected World, so the same job runs under mpirun, torchrun,
``polytrain launch`` or Slurm without a hand-written ``TF_CONFIG``: worker ``i`` listens on
``<its host>:<master_port + 1 + its local rank>`` (``master_port`` itself is left to
whoever owns it, e.g. torchrun's store). On one node every worker uses the master
address; across nodes under an MPI launcher the host names are gathered over MPI.
A ``TF_CONFIG`` already in the environment wins (it must agree with the World).

The model's variables stay ordinary per-process variables; the strategy supplies the
collectives: inside ``strategy.run`` the replica context's ``all_reduce`` (RING on CPU,
NCCL on GPU, tensors packed up to the fusion threshold) averages the accumulated
gradients after the compiled micro-step, one compiled call per bucket (see
`GraphCollectiveBackend`), and ``all_gather`` carries the Trainer's metrics and objects. Keras'
``model.fit`` is not used: it does not work under this strategy with Keras 3.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from polytrain.adapters.tensorflow.backend import GraphCollectiveBackend
from polytrain.comm.mpi_transport import fusion_threshold
from polytrain.environments import ensure_master
from polytrain.errors import BackendUnavailableError, EnvironmentDetectionError
from polytrain.world import World

REDUCERS = {"sum": np.sum, "max": np.max, "min": np.min}


def choose_collective(num_gpus: int) -> str:
    """The ``CommunicationImplementation``: NCCL when this worker has a GPU, RING (gRPC) on CPU."""
    return "NCCL" if num_gpus > 0 else "RING"


def worker_addresses(world: World, hosts: Sequence[str]) -> list[str]:
    """``host:port`` of every rank; ``hosts[r]`` is rank r's host. Ports are master_port + 1 + local index."""
    if world.master_port is None:
        raise EnvironmentDetectionError("MASTER_PORT is not known; export MASTER_PORT (a free port on rank 0's host)")
    seen: dict[str, int] = {}
    out = []
    for host in hosts:
        index = seen.get(host, 0)
        seen[host] = index + 1
        out.append(f"{host}:{world.master_port + 1 + index}")
    return out


def tf_config(world: World, hosts: Sequence[str]) -> dict[str, Any]:
    """The ``TF_CONFIG`` this rank gets: every rank a worker, task index = rank."""
    return {"cluster": {"worker": worker_addresses(world, hosts)}, "task": {"type": "worker", "index": world.rank}}


def tf_config_from_env(env: Mapping[str, str], world: World) -> dict[str, Any] | None:
    """A user's own ``TF_CONFIG``, checked against the World (None when unset)."""
    raw = env.get("TF_CONFIG", "").strip()
    if not raw:
        return None
    try:
        config = json.loads(raw)
        workers, task = config["cluster"]["worker"], config["task"]
    except (ValueError, KeyError, TypeError):
        raise EnvironmentDetectionError(
            'TF_CONFIG is not {"cluster": {"worker": [...]}, "task": {"type": "worker", "index": i}}') from None
    if len(workers) != world.size or task.get("type") != "worker" or task.get("index") != world.rank:
        raise EnvironmentDetectionError(
            f"TF_CONFIG disagrees with the launcher ({world.launcher}: rank {world.rank} of {world.size}); it must list "
            f"{world.size} workers and give task worker/{world.rank}, or be unset")
    return config


def gather_hosts(world: World) -> list[str]:
    """Every rank's host: the master address on one node, gathered over MPI across nodes."""
    if world.num_nodes == 1:
        return [world.master_addr or "127.0.0.1"] * world.size
    from polytrain.environments import by_launcher

    environment = by_launcher(world.launcher)
    if environment is None or not environment.speaks_mpi:
        raise BackendUnavailableError(
            f"backend: 'tf-multiworker' on {world.num_nodes} nodes under {world.launcher} cannot learn the other "
            "workers' hosts; export TF_CONFIG, or launch with mpirun or srun")
    from mpi4py import MPI

    return list(MPI.COMM_WORLD.allgather(socket.gethostname()))


class MultiWorkerBackend(GraphCollectiveBackend):
    name = "tf-multiworker"

    def setup(self) -> None:
        super().setup()
        num_gpus = len(tf.config.get_visible_devices("GPU"))
        implementation = getattr(tf.distribute.experimental.CommunicationImplementation,
                                 choose_collective(num_gpus))
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=fusion_threshold(), implementation=implementation,
            timeout_seconds=self.spec.reliability.collective_timeout_s)  # a dead peer fails the job, not hangs it
        resolver = None
        if self.world.distributed:
            world = ensure_master(self.world)
            config = tf_config_from_env(os.environ, world) or tf_config(world, gather_hosts(world))
            port = config["cluster"]["worker"][world.rank].rsplit(":", 1)[1]
            # TensorFlow's gRPC server binds 0.0.0.0 (hard-coded in grpc_server_lib.cc; no option
            # narrows it): say so instead of implying loopback. polytrain's own sockets stay on loopback.
            self.listen_address = (f"all interfaces, port {port} (TensorFlow's gRPC worker server cannot be bound "
                                   "to one address; backend mpi keeps a single-node job off the network)")
            resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
                tf.train.ClusterSpec(config["cluster"]), task_type="worker", task_id=world.rank, rpc_layer="grpc",
                num_accelerators={"GPU": num_gpus} if num_gpus else None)
        try:
            self.strategy = tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver,
                                                                      communication_options=options)
        except RuntimeError as exc:
            if "configured at program startup" not in str(exc):
                raise
            raise BackendUnavailableError(
                "backend: 'tf-multiworker' must set up TensorFlow's collectives before anything else runs on "
                "TensorFlow, and this process already did (e.g. built a keras.Model before polytrain.fit); pass "
                "polytrain.fit a function that builds the model (model=build_model), or use backend 'mpi'") from None
        self._worker_device = self.strategy.extended.worker_devices[0]
        self._gather_fns: dict[tuple[tuple[int, ...], str], Any] = {}

    # ---------------------------------------------------------------- collectives through the strategy
    def _on_worker(self, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        with tf.device(self._worker_device):  # inside a tf.function tensors carry no device; collectives need one
            return [tf.identity(t) for t in tensors]

    def _all_reduce(self, op: tf.distribute.ReduceOp, tensors: list[tf.Tensor]) -> list[tf.Tensor]:
        def replica_fn(*values: tf.Tensor) -> list[tf.Tensor]:
            return tf.distribute.get_replica_context().all_reduce(op, self._on_worker(list(values)))

        out = self.strategy.run(replica_fn, args=tuple(tensors))
        return [self.strategy.experimental_local_results(v)[0] for v in out]

    def _all_gather(self, array: np.ndarray) -> np.ndarray:
        """Rank r's ``array`` (same shape everywhere) in row r of the result.

        Compiled once per shape and dtype: run eagerly, one MWMS collective costs ~0.5 s.
        """
        key = (array.shape, array.dtype.str)
        if key not in self._gather_fns:
            def replica_fn(value: tf.Tensor) -> tf.Tensor:
                return tf.distribute.get_replica_context().all_gather(self._on_worker([value])[0], axis=0)

            self._gather_fns[key] = tf.function(
                lambda value: self.strategy.experimental_local_results(self.strategy.run(replica_fn, args=(value,)))[0],
                input_signature=[tf.TensorSpec((1, *array.shape), tf.as_dtype(array.dtype))])
        return self._gather_fns[key](array[None]).numpy()

    def average_in_graph(self, grads: Sequence[tf.Variable]) -> None:
        reduced = self._all_reduce(tf.distribute.ReduceOp.MEAN, [g.read_value() for g in grads])
        for grad, value in zip(grads, reduced):
            grad.assign(value)

    # ---------------------------------------------------------------- training hooks
    def broadcast_variables(self, variables: Sequence[Any]) -> None:
        if not self.world.distributed:
            return
        values = [tf.convert_to_tensor(v) for v in variables]
        mine = values if self.world.rank == 0 else [tf.zeros_like(t) for t in values]
        for var, value in zip(variables, self._all_reduce(tf.distribute.ReduceOp.SUM, mine)):
            var.assign(value)

    # ---------------------------------------------------------------- collectives for the Trainer
    def all_reduce(self, values: np.ndarray, op: str = "sum") -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if not self.world.distributed:
            return values
        return REDUCERS[op](self._all_gather(values), axis=0)  # same order, same result on every rank

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.world.distributed:
            return [obj]
        data = pickle.dumps(obj)
        lengths = self._all_gather(np.array([len(data)], dtype=np.int64))[:, 0]
        width = max(64, 1 << (int(lengths.max()) - 1).bit_length())  # a power of two: few compiled shapes
        padded = np.frombuffer(data.ljust(width, b"\0"), dtype=np.int64)
        rows = self._all_gather(padded)
        return [pickle.loads(row.tobytes()[:n]) for row, n in zip(rows, lengths)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.all_gather_object(obj)[src]

    def barrier(self) -> None:
        self.all_reduce(np.zeros(1))
