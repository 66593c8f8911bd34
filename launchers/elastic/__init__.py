"""polytrain's elastic driver: ``polytrain launch --launcher horovodrun -np N --min-np M [--max-np K]
[--host-discovery-script S | -H hosts] ... program`` without Horovod (or with ``POLYTRAIN_HOROVOD_IMPL=shim``).

Modules: `options` (the flags, bad input), `discovery` (script or fixed hosts), `hosts` (order, slots,
blacklist), `workers` (local and ssh processes), `driver` (rounds on the versioned store). The worker side is
`polytrain.comm.membership` and `polytrain.adapters.torch.reform`. docs/DESIGN.md, "The elastic driver".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from polytrain.errors import LaunchError
from polytrain.launchers.base import LaunchRequest, find_binary
from polytrain.launchers.elastic.discovery import DiscoveryError, FixedDiscovery, ScriptDiscovery, interval_s
from polytrain.launchers.elastic.options import (
    ElasticOptions,
    add_elastic_arguments,
    is_elastic,
    options_from_args,
)

__all__ = ["ElasticOptions", "add_elastic_arguments", "is_elastic", "options_from_args", "run_elastic",
           "uses_driver"]

IMPL_VARIABLE = "POLYTRAIN_HOROVOD_IMPL"


def uses_driver(environ: Mapping[str, str] | None = None) -> bool:
    """Whether polytrain's driver runs an elastic horovodrun job: with the shim asked for, or no horovodrun."""
    environ = os.environ if environ is None else environ
    return environ.get(IMPL_VARIABLE, "").strip() == "shim" or find_binary("horovodrun") is None


def _discovery(req: LaunchRequest, options: ElasticOptions) -> ScriptDiscovery | FixedDiscovery:
    if options.discovery_script is not None:
        return ScriptDiscovery(options.discovery_script, options.slots_per_host)
    hosts: dict[str, int] = {}
    for host, slots in req.hosts or (("localhost", options.np),):
        hosts[host] = hosts.get(host, 0) + slots
    return FixedDiscovery(hosts)


def describe(req: LaunchRequest, options: ElasticOptions) -> str:
    """The dry run: what the driver would do."""
    from polytrain.launchers.base import format_command

    source = (f"hosts from {options.discovery_script}, run every {interval_s():g} s" if options.discovery_script
              else f"hosts {', '.join(f'{h}:{n}' for h, n in _discovery(req, options).find().items())}")
    return "\n".join([
        f"# polytrain's elastic driver: -np {options.np}, --min-np {options.min_np}, --max-np "
        f"{options.max_np or 'every slot'}; {source}",
        "# one worker per slot (local, or over ssh with its variables on stdin), each running:",
        format_command(req.program),
    ])


def run_elastic(req: LaunchRequest, options: ElasticOptions, dry_run: bool = False) -> int:
    """Run the elastic job ``req`` with ``options``; its exit code (0 ok, 1 failed). Bad input: LaunchError."""
    from polytrain.launchers.elastic import driver, workers
    from polytrain.launchers.ssh_fanout import forwarded_env

    try:
        discovery = _discovery(req, options)
        if isinstance(discovery, FixedDiscovery) and sum(discovery.hosts.values()) < options.np:
            raise LaunchError(f"-np {options.np} is more than the {sum(discovery.hosts.values())} slots of "
                              f"-H/--hostfile: list more hosts or slots")
        discovery.check()
        interval = interval_s()
        if dry_run:
            print(describe(req, options), flush=True)
            return 0
        first = discovery.find()
    except DiscoveryError as exc:
        raise LaunchError(str(exc)) from None
    from polytrain.comm import net

    remote = [h for h in first if not workers.is_local(h)]
    # loopback while every host found is this one: give --master-addr when other hosts may join later
    addr = req.master_addr or (net.route_address(remote[0]) if remote else "127.0.0.1")
    store = driver.host_store(addr, options.elastic_timeout_s)
    store_addr = f"[{addr}]:{store.port}" if ":" in addr else f"{addr}:{store.port}"
    ssh = find_binary("ssh")
    local_env = {**os.environ, **req.env}
    remote_env = forwarded_env(req)

    def start(slot: driver.hostrules.Slot, env: Mapping[str, str]) -> workers.Worker:
        args = (slot.key, slot.hostname, slot.local_rank, slot.rank, req.program)
        if workers.is_local(slot.hostname):
            return workers.start_local(*args, {**local_env, **env})
        if ssh is None:
            raise LaunchError(f"host {slot.hostname} is not this one and ssh is not on PATH (install openssh-client)")
        return workers.start_remote(*args, {**remote_env, **env}, ssh)

    return driver.Driver(options, discovery, store, store_addr, start, interval,
                         driver.group_timeout_s(local_env)).run()


def with_real_horovodrun(req: LaunchRequest, options: ElasticOptions) -> LaunchRequest:
    """``req`` for the real horovodrun: its elastic flags before the program."""
    return dataclasses.replace(req, extra_args=(*options.flags(), *req.extra_args))
