"""Slurm ``srun`` job steps, and Slurm's compressed host and task lists.

Only a process of an srun step is a rank: ``sbatch`` and ``salloc`` shells also carry
SLURM_PROCID=0 and SLURM_NTASKS, so a script run straight from a batch script would
otherwise wait forever for peers that never start. srun always sets SLURM_STEP_ID
(and SLURM_STEPID) to the step's number; the batch, extern and interactive pseudo-steps
use reserved ids at the top of the 32-bit range.
"""

from __future__ import annotations

import re

from polytrain.environments.base import (
    Env,
    Environment,
    check_below,
    first_set,
    port_from_job_id,
    read_addr,
    read_int,
    read_nodes,
    read_port,
    read_ranks,
)
from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World

_RESERVED_STEP_IDS = 0xFFFFFFF0  # batch 0xFFFFFFFE, extern 0xFFFFFFFF, interactive 0xFFFFFFFA, ...
_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def _split_top_level(text: str, name: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            break
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise EnvironmentDetectionError(f"{name}={text!r} has unbalanced brackets; expected e.g. 'node[01-03,07],gpu5'")
    parts.append(text[start:])
    return parts


def _expand_range(part: str, text: str, name: str) -> list[str]:
    lo, sep, hi = part.partition("-")
    if not lo.isdigit() or (sep and not hi.isdigit()):
        raise EnvironmentDetectionError(f"{name}={text!r} has a bad range {part!r}; ranges look like 01-03 or 7")
    if not sep:
        return [lo]
    if int(hi) < int(lo):
        raise EnvironmentDetectionError(f"{name}={text!r} has a descending range {part!r}; ranges go low-high")
    return [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]


def _expand_host(item: str, text: str, name: str) -> list[str]:
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise EnvironmentDetectionError(f"{name}={text!r} has unbalanced brackets; expected e.g. 'node[01-03]'")
        return [item]
    numbers = [n for part in match.group(1).split(",") for n in _expand_range(part, text, name)]
    tails = _expand_host(item[match.end():], text, name)
    return [item[:match.start()] + n + tail for n in numbers for tail in tails]


def expand_nodelist(text: str, name: str = "SLURM_NODELIST") -> list[str]:
    """``'node[01-03,07],gpu5'`` → ``['node01', 'node02', 'node03', 'node07', 'gpu5']``.

    Zero padding follows the range's first number; several bracket groups in one name
    (``'r[1-2]n[1-2]'``) expand to every combination, in order.
    """
    text = text.strip()
    hosts: list[str] = []
    for item in _split_top_level(text, name):
        if not item:
            raise EnvironmentDetectionError(f"{name}={text!r} has an empty host; expected e.g. 'node[01-03,07],gpu5'")
        hosts.extend(_expand_host(item, text, name))
    return hosts


def expand_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """``'2(x3),1'`` → ``[2, 2, 2, 1]``: the number of tasks on each node of the step, in node order."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASKS_ITEM.fullmatch(item)
        if match is None or int(match.group(1)) == 0 or match.group(2) == "0":
            raise EnvironmentDetectionError(f"{name}={text!r} is malformed; expected counts like '2(x3),1'")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _local_size(env: Env, size: int, node_rank: int, num_nodes: int) -> int:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in env:
            counts = expand_tasks_per_node(env[name], name)
            if len(counts) != num_nodes or sum(counts) != size:
                raise EnvironmentDetectionError(
                    f"{name}={env[name]!r} describes {sum(counts)} tasks on {len(counts)} nodes, "
                    f"but the step has {size} tasks on {num_nodes} nodes; it must agree with both")
            return counts[node_rank]
    if "SLURM_NTASKS_PER_NODE" in env:
        return read_int(env, "SLURM_NTASKS_PER_NODE", minimum=1)
    if size % num_nodes:
        raise EnvironmentDetectionError(
            f"SLURM_STEP_TASKS_PER_NODE is not set and {size} tasks do not split evenly over {num_nodes} nodes")
    return size // num_nodes


class SlurmEnvironment(Environment):
    launcher = "slurm"

    @classmethod
    def detect(cls, env: Env) -> bool:
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID", ""))
        return "SLURM_PROCID" in env and step.isdigit() and int(step) < _RESERVED_STEP_IDS

    @classmethod
    def world(cls, env: Env) -> World:
        size_var = first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        rank, size, local_rank, _ = read_ranks(env, "SLURM_PROCID", size_var, "SLURM_LOCALID")
        nodes_var = first_set(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        node_rank, num_nodes = read_nodes(env, "SLURM_NODEID", nodes_var, size)
        local_size = _local_size(env, size, node_rank, num_nodes)
        check_below(local_rank, "SLURM_LOCALID", local_size, "tasks on this node")
        addr = read_addr(env)
        if addr is None:
            list_var = first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
            if list_var in env:
                addr = expand_nodelist(env[list_var], list_var)[0]
        port = read_port(env) or port_from_job_id(env, first_set(env, "SLURM_JOB_ID", "SLURM_JOBID"))
        return World(rank=rank, size=size, local_rank=local_rank, local_size=local_size, node_rank=node_rank,
                     num_nodes=num_nodes, master_addr=addr, master_port=port, launcher=cls.launcher)
