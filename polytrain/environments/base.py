"""What every launcher environment shares: the class shape and strict readers of variables.

Every reader raises `EnvironmentDetectionError` with a one-line message that names the
variable and what is allowed, so a malformed or contradictory dump never turns into a
World that hangs later in a collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from polytrain.errors import EnvironmentDetectionError
from polytrain.world import World

Env = Mapping[str, str]


class Environment:
    """One launcher: tell whether it started this process, and read the World it describes."""

    launcher: ClassVar[str] = ""
    #: The processes can agree on a master address over MPI (see ``polytrain.environments.ensure_master``).
    speaks_mpi: ClassVar[bool] = False

    @classmethod
    def detect(cls, env: Env) -> bool:
        raise NotImplementedError

    @classmethod
    def world(cls, env: Env) -> World:
        raise NotImplementedError


def read_int(env: Env, name: str, *, minimum: int = 0, default: int | None = None) -> int:
    """The integer in ``env[name]``; ``default`` when unset (an error when there is no default)."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise EnvironmentDetectionError(f"{name} is not set; it must be an integer >= {minimum}")
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise EnvironmentDetectionError(f"{name}={raw!r} is not an integer; it must be an integer >= {minimum}") from None
    if value < minimum:
        raise EnvironmentDetectionError(f"{name}={value} is below {minimum}; it must be an integer >= {minimum}")
    return value


def first_set(env: Env, *names: str) -> str:
    """The first of ``names`` present in ``env`` (the last name when none is, so errors name it)."""
    for name in names:
        if name in env:
            return name
    return names[-1]


def check_below(value: int, name: str, bound: int, bound_name: str) -> None:
    """``value`` (read from ``name``) must be in 0..bound-1."""
    if value >= bound:
        raise EnvironmentDetectionError(
            f"{name}={value} contradicts {bound_name}={bound}; {name} must be in 0..{bound - 1}")


def read_ranks(env: Env, rank: str, size: str, local_rank: str | None = None,
               local_size: str | None = None) -> tuple[int, int, int, int]:
    """(rank, size, local_rank, local_size), checked against each other.

    A missing local size reads as local_rank + 1 (the caller decides what it really is).
    """
    r = read_int(env, rank)
    n = read_int(env, size, minimum=1)
    check_below(r, rank, n, size)
    lr = read_int(env, local_rank) if local_rank else 0
    # A local rank may exceed the global rank: Open MPI 5 maps ranks to slots in other orders than 0, 1, 2.
    if not local_size:
        return r, n, lr, lr + 1
    ln = read_int(env, local_size, minimum=1)
    if ln > n:
        raise EnvironmentDetectionError(f"{local_size}={ln} contradicts {size}={n}; {local_size} must be in 1..{n}")
    if local_rank:
        check_below(lr, local_rank, ln, local_size)
    return r, n, lr, ln


def nodes_from_local(rank: int, size: int, local_size: int) -> tuple[int, int]:
    """(node_rank, num_nodes) when a launcher only tells sizes: ranks are taken to fill nodes in order.

    Exact for the usual block placement with the same number of processes on every node;
    with uneven nodes it is an estimate (``ensure_master`` corrects it from host names).
    """
    num_nodes = -(-size // local_size)
    return min(rank // local_size, num_nodes - 1), num_nodes


def read_nodes(env: Env, node_rank: str, num_nodes: str, size: int) -> tuple[int, int]:
    nn = read_int(env, num_nodes, minimum=1)
    nr = read_int(env, node_rank)
    check_below(nr, node_rank, nn, num_nodes)
    if nn > size:
        raise EnvironmentDetectionError(f"{num_nodes}={nn} is more nodes than processes ({size}); it must be in 1..{size}")
    return nr, nn


def read_port(env: Env, name: str = "MASTER_PORT") -> int | None:
    if name not in env:
        return None
    port = read_int(env, name, minimum=1)
    if port > 65535:
        raise EnvironmentDetectionError(f"{name}={port} is out of range; a port must be in 1..65535")
    return port


def read_addr(env: Env, name: str = "MASTER_ADDR") -> str | None:
    if name not in env:
        return None
    addr = env[name].strip()
    if not addr or any(c.isspace() for c in addr):
        raise EnvironmentDetectionError(f"{name}={env[name]!r} is not a host; it must be a host name or IP address")
    return addr


def port_from_job_id(env: Env, name: str) -> int | None:
    """A port every process of a batch job derives alike: 10000 + job id mod 20000 (10000..29999)."""
    if name not in env:
        return None
    digits = env[name].split("_")[0]  # array jobs may read "1234_7"
    if not digits.isdigit():
        raise EnvironmentDetectionError(f"{name}={env[name]!r} is not a job id; it must be a whole number")
    return 10000 + int(digits) % 20000
