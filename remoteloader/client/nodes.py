"""Which node each rank of a torch.distributed job runs on, and the address a node is reached at.

A job is multi-node when its ranks run on more than one machine. torchrun says so in every
rank's environment (``LOCAL_WORLD_SIZE`` < ``WORLD_SIZE``; ``GROUP_RANK`` is the node,
``LOCAL_RANK`` 0 the node's first rank), with no waiting. Without torchrun's variables the
ranks meet in the store: each writes its host name and reads everyone's, so a job started by
hand (``RANK``/``WORLD_SIZE``, Slurm, mpirun) across hosts is told from one on a single host.

A node's address is the local address of the interface that reaches the rendezvous (torch's
``MASTER_ADDR``, else the store's host): the one the other nodes already reach this job on.
``REMOTELOADER_BIND_ADDRESS`` overrides it, per node (a second network, a NAT).
"""
from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Optional

from ..protocol.address import AddressError, validate_address

ENV_BIND_ADDRESS = "REMOTELOADER_BIND_ADDRESS"
HOST_KEY = "remoteloader/host/{fingerprint}/{rank}"  # rank -> its host name, when torchrun does not say
TORCHRUN_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class NodeLayout:
    """Where one rank runs in its job."""

    node: str  # its node's name: torchrun's node rank (``node-K``) or the host name
    nodes: int  # how many nodes the job spans
    first_on_node: bool  # the node's lowest rank: it starts the node's workers

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


ONE_NODE = NodeLayout("", 1, True)


def torchrun_layout(world_size: int, env: Mapping[str, str] = os.environ) -> Optional[NodeLayout]:
    """The layout torchrun's variables give, or None when they are missing or describe another
    world than the loader's (a loader given its own ``rank``/``world_size``)."""
    if any(name not in env for name in TORCHRUN_VARS):
        return None
    try:
        local_rank, local_world = int(env["LOCAL_RANK"]), int(env["LOCAL_WORLD_SIZE"])
        group_rank, world = int(env["GROUP_RANK"]), int(env["WORLD_SIZE"])
        nodes = int(env.get("GROUP_WORLD_SIZE") or -(-world // max(local_world, 1)))
    except ValueError:
        return None
    if world != world_size or local_world < 1:
        return None
    if local_world >= world:
        return ONE_NODE
    return NodeLayout(f"node-{group_rank}", max(nodes, 2), local_rank == 0)


def gathered_layout(store: Any, fingerprint: str, rank: int, world_size: int, timeout: float,
                    host: Optional[str] = None) -> NodeLayout:
    """The layout from every rank's host name (``host``, default this machine's), written to and
    read from ``store`` (a collective: every rank's loader construction takes part, as it does in
    finding the master)."""
    here = host or socket.gethostname()
    keys = [HOST_KEY.format(fingerprint=fingerprint, rank=r) for r in range(world_size)]
    store.set(keys[rank], here)
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError as e:  # torch's timeout (DistStoreError is a RuntimeError)
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(f"rank {rank}: ranks {missing} did not create their RemoteDataLoader within "
                           f"{timeout:g} s (every rank's loader says which host it runs on when it is created, so "
                           f"that rank 0 knows whether the job spans several): {e}") from None
    hosts = [store.get(key).decode() for key in keys]
    if len(set(hosts)) == 1:
        return ONE_NODE
    return NodeLayout(here, len(set(hosts)), hosts.index(here) == rank)


def detect_layout(store: Any, fingerprint: str, rank: int, world_size: int, timeout: float) -> NodeLayout:
    """This rank's layout: torchrun's variables if they describe the loader's world, else host names
    through ``store``; one node for a world of one."""
    if world_size <= 1:
        return ONE_NODE
    return torchrun_layout(world_size) or gathered_layout(store, fingerprint, rank, world_size, timeout)


def rendezvous_host(store: Any, env: Mapping[str, str] = os.environ) -> Optional[str]:
    """Where the job meets: ``MASTER_ADDR``, else the host of the TCPStore under ``store``'s prefixes."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    while hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    return getattr(store, "host", None) or None


def reachable_address(toward: str) -> str:
    """The local address of the interface this machine would send from to reach ``toward``
    (a UDP socket's ``connect`` picks the route and sends nothing)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(toward, 9, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def node_address(toward: Optional[str], env: Mapping[str, str] = os.environ) -> str:
    """The address this node's remoteloader processes bind to and are reached at by the other
    nodes: ``REMOTELOADER_BIND_ADDRESS``, else the one that reaches ``toward``. Raises a one-line
    error when neither gives an address other nodes could reach (nothing to go by, or loopback)."""
    setting = env.get(ENV_BIND_ADDRESS)
    if setting:
        try:  # the others connect to it: a concrete host, as for a worker's register (an IPv6 one unbracketed)
            if ":" in setting:
                ipaddress.IPv6Address(setting)
            else:
                validate_address(tcp_endpoint(setting, 1))
        except (AddressError, ValueError) as e:
            raise RuntimeError(f"{ENV_BIND_ADDRESS}={setting!r} is not a host address: {e}") from None
        if setting in ("*", "0.0.0.0", "::"):
            raise RuntimeError(f"{ENV_BIND_ADDRESS}={setting!r} is an any-address, which other nodes cannot connect "
                               "to: set an address of this node that they reach")
        return setting
    how = f"set {ENV_BIND_ADDRESS} on every node to an address of that node the others reach"
    if not toward:
        raise RuntimeError(f"a multi-node job, but neither MASTER_ADDR nor a TCP store says where the job meets: {how}")
    try:
        address = reachable_address(toward)
    except OSError as e:
        raise RuntimeError(f"a multi-node job meeting at {toward!r}, which this node cannot route to ({e}): {how}") \
            from None
    if ipaddress.ip_address(address.split("%", 1)[0]).is_loopback:
        raise RuntimeError(f"a multi-node job meeting at {toward!r}, a loopback address other nodes cannot reach "
                           f"this node by: {how}")
    return address


def tcp_endpoint(address: str, port: int = 0) -> str:
    """``tcp://ADDRESS:PORT``, an IPv6 address in brackets."""
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def endpoint_host(endpoint: str) -> str:
    """The host of ``tcp://HOST:PORT`` (brackets of an IPv6 address removed)."""
    host = endpoint.split("://", 1)[1].rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host
