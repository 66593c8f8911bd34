"""Guard: no new way to unpickle appears in polytrain's own code (polytrain/, adapters/, launchers/).

Read with ``ast`` (nothing is imported). A site is a call that can unpickle:

- ``load``/``loads``/``Unpickler`` of pickle, cloudpickle, dill, joblib, marshal, shelve, ``pandas.read_pickle``;
- ``torch.load``/``torch.jit.load``/``numpy.load`` unless given a literal ``weights_only=True`` /
  ``allow_pickle=False``, and any call given ``weights_only``/``allow_pickle``/``safe_mode`` (Keras's guard
  against deserialising lambdas) that is not that safe literal;
- DeepSpeed's checkpoint loaders (``zero_to_fp32``), which ``torch.load(weights_only=False)`` their files;
- an object collective (``broadcast_object``, ``all_gather_object``, ``*_object_list``, ...): what a rank sends is
  unpickled by the others;
- mpi4py's lowercase, pickle-based collectives (``comm.bcast``, ``comm.allgather``, ...) on a communicator.

Imports are followed (``import cloudpickle as _pickler``, ``from torch import load``) and so are plain
assignments of a module (``_pickler = pickle``). Every site must be in ALLOWED, by file, enclosing function
and callee, with the reason it is safe; a new site fails `test_every_unpickling_site_is_justified`, a
removed one fails `test_the_allow_list_has_no_stale_entry`. The rule: data from inside the job (one rank to
another) may be unpickled; files from disk only behind ``--trust-checkpoint``.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("polytrain", "adapters", "launchers")

PICKLERS = ("pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal", "shelve")
UNPICKLING = {f"{m}.{f}" for m in PICKLERS for f in ("load", "loads", "Unpickler", "open")} | {
    "pandas.read_pickle", "torch.load", "torch.serialization.load", "torch.jit.load", "numpy.load",
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
}
SAFE_LITERALS = {"weights_only": True, "allow_pickle": False, "safe_mode": True}  # safe_mode: Keras (lambdas)
OBJECT_COLLECTIVE = re.compile(r"^(all_?gather|broadcast|bcast|gather|scatter|send|recv|isend|irecv)_object(_list)?$")
MPI_PICKLING = {"bcast", "allgather", "gather", "scatter", "alltoall", "send", "isend", "ssend", "recv", "irecv",
                "sendrecv", "reduce", "allreduce", "scan", "exscan"}
COMM_MAKERS = {"Split", "Split_type", "Dup", "Clone", "Create", "Create_group", "COMM_WORLD"}

IN_JOB = "in-job: every byte comes from another rank of the same job (the rule: acceptable)"
TRAINER = "the Trainer's collective on its backend: values computed by the ranks, nothing read from disk"

# (file, enclosing function, callee) -> why it stays. One entry per site.
ALLOWED: list[tuple[str, str, str, str]] = [
    # ---- files from disk: only with --trust-checkpoint, or in a mode that cannot unpickle
    ("polytrain/commands/checkpoint.py", "_torch_state_dict", "torch.load",
     "weights_only=not trust: full pickle only with `checkpoint import --trust-checkpoint`"),
    ("polytrain/checkpoint/export.py", "deepspeed_fp32_state", "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
     "ZeRO 1-3: DeepSpeed's unpickling loader, reached only with trust=True (--trust-checkpoint)"),
    # ---- the Horovod API's object collectives (their contract: any picklable object, between ranks)
    ("polytrain/horovod/torch/functions.py", "broadcast_object", "pickle.loads", IN_JOB),
    ("polytrain/horovod/torch/functions.py", "allgather_object", "pickle.loads", IN_JOB),
    ("polytrain/horovod/torch/functions.py", "broadcast_optimizer_state", "broadcast_object",
     "the optimizer's non-tensor hyper-parameters, from root_rank (Horovod's own algorithm)"),
    ("polytrain/horovod/tensorflow/functions.py", "broadcast_object", "cloudpickle.loads", IN_JOB),
    ("polytrain/horovod/tensorflow/functions.py", "allgather_object", "cloudpickle.loads", IN_JOB),
    ("polytrain/horovod/torch/elastic.py", "TorchState.sync", "broadcast_object",
     "ElasticSampler's state_dict from rank 0 (in-job); commits on disk are safetensors + JSON"),
    # ---- the backends' object collectives, and their callers
    ("adapters/torch/backend.py", "TorchBackend.broadcast_object", "broadcast_object_list",
     "torch.distributed's own object collective: in-job"),
    ("adapters/torch/backend.py", "TorchBackend.all_gather_object", "all_gather_object",
     "torch.distributed's own object collective: in-job"),
    ("adapters/tensorflow/multiworker.py", "MultiWorkerBackend.all_gather_object", "pickle.loads", IN_JOB),
    ("adapters/tensorflow/multiworker.py", "MultiWorkerBackend.broadcast_object", "all_gather_object", IN_JOB),
    ("adapters/torch/horovod.py", "HorovodBackend.broadcast_object", "broadcast_object", IN_JOB),
    # the pipeline stages' full tensors (numpy arrays of this job's weights), gathered between the ranks of a
    # pipeline group for the portable form
    ("adapters/torch/parallel/state.py", "gather_stages", "all_gather_object", IN_JOB),
    ("adapters/torch/horovod.py", "HorovodBackend.all_gather_object", "allgather_object", IN_JOB),
    ("adapters/tensorflow/horovod.py", "HorovodBackend.broadcast_object", "broadcast_object", IN_JOB),
    ("adapters/tensorflow/horovod.py", "HorovodBackend.all_gather_object", "allgather_object", IN_JOB),
    ("polytrain/comm/mpi_transport.py", "MpiTransport.node_records", "comm.allgather",
     "rank numbers and node sizes between the ranks of one MPI job"),
    ("polytrain/comm/mpi_transport.py", "MpiTransport.node_records", "comm.bcast", "a rank number: in-job"),
    ("polytrain/comm/mpi_transport.py", "MpiTransport.node_records", "comm.allgather",
     "rank numbers and node sizes between the ranks of one MPI job"),
    ("polytrain/comm/mpi_transport.py", "MpiTransport.bcast_object", "comm.bcast", IN_JOB),
    ("polytrain/comm/mpi_transport.py", "MpiTransport.allgather_object", "comm.allgather", IN_JOB),
    ("polytrain/comm/mpi_transport.py", "MpiCollectives.broadcast_object", "bcast_object", IN_JOB),
    ("polytrain/comm/mpi_transport.py", "MpiCollectives.all_gather_object", "allgather_object", IN_JOB),
    ("polytrain/comm/mpi_transport.py", "TrainerCollectivesOverMpi.broadcast_object", "broadcast_object", IN_JOB),
    ("polytrain/comm/mpi_transport.py", "TrainerCollectivesOverMpi.all_gather_object", "all_gather_object", IN_JOB),
    ("polytrain/environments/agree.py", "_agree_over_mpi", "comm.allgather",
     "host names of the ranks of one mpirun job, before rendezvous"),
    ("polytrain/environments/agree.py", "_agree_over_mpi", "comm.bcast", "rank 0's (status, address, port): in-job"),
    ("adapters/torch/framework.py", "live_model", "broadcast_object",
     "rank 0's initial weights (numpy arrays) of a model given to polytrain.fit or polytrain.torch: in-job"),
    ("adapters/torch/fsdp.py", "check_node_major", "all_gather_object", "one bool per rank: in-job"),
    ("adapters/torch/zero_infinity.py", "_agree", "all_gather_object",
     "each rank's nvme_path problem (a str) for every rank: in-job"),
    ("adapters/torch/zero_infinity.py", "prepare", "broadcast_object",
     "rank 0's random key naming the job's nvme folder (a str): in-job"),
    ("adapters/tensorflow/multiworker.py", "gather_hosts", "comm.allgather",
     "host names of the ranks of one mpirun/srun job"),
    ("polytrain/comm/settle.py", "settled", "all_gather_object", TRAINER + " (each rank's failure: type name, message)"),
    ("polytrain/comm/agree.py", "check_ranks_agree", "all_gather_object",
     TRAINER + " (each rank's spec/library fingerprint)"),
    ("polytrain/comm/agree.py", "check_replicas_agree", "all_gather_object", TRAINER + " (state digests)"),
    ("polytrain/train/trainer.py", "Trainer._end_epoch", "broadcast_object", TRAINER + " (rank 0's stop decision)"),
    ("polytrain/train/trainer.py", "Trainer._write_timeline", "all_gather_object", TRAINER + " (timeline events)"),
    ("polytrain/train/checkpoints.py", "RunCheckpoints.save_best", "broadcast_object", TRAINER + " (a bool)"),
    ("polytrain/train/checkpoints.py", "RunCheckpoints._write", "all_gather_object", TRAINER + " (RNG states)"),
    ("polytrain/train/checkpoints.py", "RunCheckpoints._restore", "broadcast_object",
     TRAINER + " (the checkpoint path as a str; the checkpoint itself is safetensors + JSON)"),
    ("polytrain/train/checkpoints.py", "RunCheckpoints._restore", "broadcast_object",
     TRAINER + " (rank 0's verdict on the data: what changed, a str, or None)"),
    ("polytrain/train/checkpoints.py", "RunCheckpoints.save_model", "all_gather_object", TRAINER + " (state digests)"),
    ("polytrain/train/checkpoints.py", "RunCheckpoints.model_written", "broadcast_object", TRAINER + " (a bool)"),
    ("polytrain/torch/checkpoints.py", "save", "all_gather_object",
     "the own loop's checkpoint, between the ranks of one job (RNG states, dicts of lists of ints), as the Trainer's"),
    ("polytrain/observe/peer_board.py", "hosted_store_board", "broadcast_object", "rank 0's store endpoint (host, port): in-job"),
]


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: str) -> None:
        self.path, self.scope, self.sites = path, [], []
        self.aliases: dict[str, set[str]] = {}  # local name -> the modules/functions it may be
        self.comms: set[str] = set()  # local names bound to an MPI communicator

    def resolve(self, node: ast.AST) -> set[str]:
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, {node.id})
        if isinstance(node, ast.Attribute):
            return {f"{base}.{node.attr}" for base in self.resolve(node.value)}
        return set()

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            local = a.asname or a.name.split(".")[0]
            self.aliases.setdefault(local, set()).add(a.name if a.asname else local)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        for a in node.names:
            self.aliases.setdefault(a.asname or a.name, set()).add(f"{node.module}.{a.name}")

    def visit_Assign(self, node: ast.Assign) -> None:
        resolved = self.resolve(node.value) if isinstance(node.value, (ast.Name, ast.Attribute)) else set()
        makes_comm = isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Attribute) and \
            node.value.func.attr in COMM_MAKERS
        for target in node.targets:
            if isinstance(target, ast.Name):
                if resolved & (UNPICKLING | set(PICKLERS) | {"numpy", "torch"}) or \
                        any(r.split(".")[0] in PICKLERS for r in resolved):
                    self.aliases.setdefault(target.id, set()).update(resolved)
                if makes_comm or any(r.endswith("COMM_WORLD") for r in resolved):
                    self.comms.add(target.id)
        self.generic_visit(node)

    def _scoped(self, node: ast.AST) -> None:
        self.scope.append(node.name)  # type: ignore[attr-defined]
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        callee = self._callee(node)
        if callee:
            self.sites.append((self.path, ".".join(self.scope), callee, node.lineno))
        self.generic_visit(node)

    def _callee(self, node: ast.Call) -> str | None:
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        unsafe_keyword = any(name in keywords and not (isinstance(keywords[name], ast.Constant)
                                                       and keywords[name].value is literal)
                             for name, literal in SAFE_LITERALS.items())
        names = self.resolve(node.func)
        hits = sorted(names & UNPICKLING)
        if hits:
            safe = any(isinstance(keywords.get(name), ast.Constant) and keywords[name].value is literal
                       for name, literal in SAFE_LITERALS.items())
            if unsafe_keyword or not safe or hits[0].split(".")[0] in PICKLERS:
                return hits[0]
            return None
        if unsafe_keyword:
            return _dotted(node.func) or "<call>"
        if not isinstance(node.func, (ast.Attribute, ast.Name)):
            return None
        attr = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        if OBJECT_COLLECTIVE.match(attr):
            return attr
        if isinstance(node.func, ast.Attribute) and attr in MPI_PICKLING and self._is_comm(node.func.value):
            return f"comm.{attr}"
        return None

    def _is_comm(self, node: ast.AST) -> bool:
        text = ast.unparse(node)
        return isinstance(node, ast.Name) and node.id in self.comms or "comm" in text.lower()


def unpickling_sites() -> list[tuple[str, str, str, int]]:
    sites = []
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            scanner = _Scanner(path.relative_to(REPO).as_posix())
            scanner.visit(ast.parse(path.read_text(), str(path)))
            sites.extend(scanner.sites)
    return sites


def _keys(entries: list[tuple]) -> Counter:
    return Counter(entry[:3] for entry in entries)


def test_every_unpickling_site_is_justified() -> None:
    sites = unpickling_sites()
    new = _keys(sites) - _keys(ALLOWED)
    where = [f"{p}:{line} in {scope or '<module>'}: {callee}" for p, scope, callee, line in sites
             if (p, scope, callee) in new]
    assert not new, ("a call that can unpickle, not in ALLOWED; remove it, or add it with the reason it is "
                     "safe (files from disk only behind --trust-checkpoint):\n  " + "\n  ".join(where))


def test_the_allow_list_has_no_stale_entry() -> None:
    stale = _keys(ALLOWED) - _keys(unpickling_sites())
    assert not stale, f"ALLOWED names sites that are gone; remove them: {sorted(stale)}"
    assert all(len(entry) == 4 and entry[3].strip() for entry in ALLOWED), "every entry needs a reason"


SAMPLE = '''
import pickle, numpy as np, torch
import cloudpickle as _p
from torch import load as tload
from mpi4py import MPI
_q = pickle
def f(path, comm, trust):
    pickle.loads(b"")
    _p.load(path)
    _q.Unpickler(path)
    tload(path)
    torch.load(path, weights_only=True)
    torch.load(path, weights_only=trust)
    np.load(path)
    np.load(path, allow_pickle=False)
    np.load(path, allow_pickle=True)
    other(path, weights_only=False)
    dist.broadcast_object_list([1])
    comm.bcast(1, root=0)
    local = MPI.COMM_WORLD.Split_type(0)
    local.allgather(1)
    comm.Bcast(buf, root=0)
    self.transport.bcast(buf, 0)
    keras.models.load_model(path, safe_mode=False)
'''


def test_the_scanner_sees_every_kind_of_site() -> None:
    """The guard can fail: each unsafe call in SAMPLE is found, and none of the safe ones is."""
    scanner = _Scanner("sample.py")
    scanner.visit(ast.parse(SAMPLE))
    found = [(callee, line) for _, scope, callee, line in scanner.sites]
    assert found == [("pickle.loads", 8), ("cloudpickle.load", 9), ("pickle.Unpickler", 10), ("torch.load", 11),
                     ("torch.load", 13), ("numpy.load", 14), ("numpy.load", 16), ("other", 17),
                     ("broadcast_object_list", 18), ("comm.bcast", 19), ("comm.allgather", 21),
                     ("keras.models.load_model", 24)]
