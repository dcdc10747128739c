"""How a node of a cluster finds its store: the authkey, the launch URL, and the Store
kinds a cluster can run on.

A cluster runs on a ``torch.distributed`` Store with queues: ``tcp://HOST:PORT`` (node 0
hosts the TCPStore, on a listening socket of the address's own family:
:func:`~shared_td.coordinator.store_host.host_tcp_store`), ``env://`` (torchrun's agent
store, or one the launcher names), or a Store given as it is, checked by
:func:`check_store`. The signed store over it:
:class:`~shared_td.coordinator.cluster_store.SignedStore`.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import threading
import urllib.parse

import torch
import torch.distributed as dist

from shared_td.coordinator.cluster_store_watch import StallWatch, resolving
from shared_td.coordinator.store_host import host_tcp_store

__all__ = ["MIN_KEY_BYTES", "check_store", "cluster_key", "open_store", "signing_key"]


#: the fewest bytes a cluster authkey may have: a short key is found from one signed
#: value read off the store (a 4-digit key took 16 ms), offline, without a trace
MIN_KEY_BYTES = 16
_MAKE_ONE = ('make one with `python -c "import secrets; print(secrets.token_hex(16))"` and give the same to '
             "every node (authkey= or SHARED_TD_CLUSTER_KEY)")


def cluster_key(authkey) -> bytes:
    """The cluster authkey: ``authkey`` (bytes-like or str, as UTF-8) or
    ``SHARED_TD_CLUSTER_KEY``, checked: TypeError for anything else (``bytes(32)`` of
    an int would be 32 zero bytes, which HMAC pads to the empty key: anyone could sign),
    ValueError for a key under :data:`MIN_KEY_BYTES` bytes or of zero bytes only. The
    errors never show the key. What signs the store's values is :func:`signing_key` of it.

    Example:
        >>> cluster_key("0123456789abcdef")
        b'0123456789abcdef'
        >>> cluster_key(16)
        Traceback (most recent call last):
        ...
        TypeError: The cluster authkey must be bytes or a str, got a value of type int: ...
    """
    if authkey is None:
        authkey = os.environ.get("SHARED_TD_CLUSTER_KEY")
        if authkey is None:
            raise ValueError(f"A cluster needs an authkey, the same on every node: pass authkey= or set "
                             f"SHARED_TD_CLUSTER_KEY; {_MAKE_ONE}.")
    if isinstance(authkey, str):
        key = authkey.encode()
    elif isinstance(authkey, (bytes, bytearray, memoryview)):
        key = bytes(authkey)
    else:  # an int (or True) was read by bytes() as that many zero bytes
        raise TypeError(f"The cluster authkey must be bytes or a str, got a value of type "
                        f"{type(authkey).__name__}: {_MAKE_ONE}.")
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"The cluster authkey has {len(key)} bytes, fewer than {MIN_KEY_BYTES}: a short key is "
                         f"found offline from one value signed with it; {_MAKE_ONE}.")
    if not key.strip(b"\0"):
        raise ValueError(f"The cluster authkey is zero bytes only, the same as the empty key to HMAC: {_MAKE_ONE}.")
    return key


def signing_key(authkey: bytes) -> bytes:
    """The HMAC key that signs the cluster's values: SHA-256 of ``authkey`` after a label
    of its own. HMAC pads a key shorter than its block with zero bytes, so ``b"k"`` and
    ``b"k\\0"`` signed alike (and ``b"\\0" * n`` as the empty key); the hash of the
    key makes every authkey its own 32-byte key.

    Example:
        >>> signing_key(b"k" * 16) == signing_key(b"k" * 16 + b"\\0")
        False
    """
    return hashlib.sha256(b"shared_td-cluster\0" + bytes(authkey)).digest()


def check_store(store) -> None:
    """Refuse, before a node joins, a Store the cluster cannot run on: requests and
    notices travel through the store's queues (``queue_push``/``queue_pop``), which torch
    has since 2.8 and only some stores implement. Without this check a FileStore failed
    the first request with a bare NotImplementedError, and a TCPStore on the legacy
    backend (``use_libuv=False``) dropped the connection, which read as "the store's host
    stopped". RuntimeError for a torch without queues, ValueError for such a store (its
    class named, with the fix)."""
    if not hasattr(dist.Store, "queue_push"):
        raise RuntimeError(f"A shared_td cluster needs torch >= 2.8 (TCPStore queues); this is torch "
                           f"{torch.__version__}. Upgrade torch on every node.")
    base = store
    while isinstance(base, dist.PrefixStore):  # what a PrefixStore queues, its store queues
        base = base.underlying_store
    if isinstance(base, dist.FileStore):
        raise ValueError("A shared_td cluster cannot run on a FileStore (it has no queues): pass "
                         "cluster='tcp://HOST:PORT' or 'env://', or a torch.distributed.TCPStore.")
    if isinstance(base, dist.TCPStore) and not getattr(base, "libuvBackend", True):
        raise ValueError("A shared_td cluster cannot run on a TCPStore made with use_libuv=False (the legacy "
                         "backend has no queues): make it with the default use_libuv=True, or pass "
                         "cluster='tcp://HOST:PORT' or 'env://'.")


def open_store(url: str, node: int, timeout: float):
    """A Store for ``url``: ``tcp://HOST:PORT`` (node 0 hosts the TCPStore unless the URL
    says ``?host=0``; ``?host=1`` makes this node host it) or ``env://`` (``MASTER_ADDR``,
    ``MASTER_PORT``; under torchrun the agent's store is joined, never hosted again).

    Returns ``(store, node, nodes)``; ``node``/``nodes`` are None unless ``env://`` found
    them (``GROUP_RANK``/``NODE_RANK`` and ``WORLD_SIZE // LOCAL_WORLD_SIZE`` or ``NNODES``).
    """
    parsed = urllib.parse.urlparse(url)
    query = urllib.parse.parse_qs(parsed.query)
    found_node = found_nodes = None
    if parsed.scheme == "env":
        env = os.environ
        host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
        if not host or not port:
            raise ValueError("cluster='env://' needs MASTER_ADDR and MASTER_PORT in the environment.")
        if env.get("LOCAL_RANK", "0") != "0":  # torchrun's other processes of this node
            raise ValueError(f"cluster='env://' makes one Coordinator per node, in the process of local rank 0; "
                             f"this process has LOCAL_RANK={env['LOCAL_RANK']}: attach to your node's "
                             "Coordinator by address instead (or run torchrun --nproc-per-node 1).")
        rank = env.get("GROUP_RANK") or env.get("NODE_RANK") or env.get("SHARED_TD_NODE")
        found_node = int(rank) if rank is not None else None
        if env.get("NNODES") or env.get("SHARED_TD_NODES"):
            found_nodes = int(env.get("NNODES") or env["SHARED_TD_NODES"])
        elif env.get("WORLD_SIZE"):
            found_nodes = int(env["WORLD_SIZE"]) // int(env.get("LOCAL_WORLD_SIZE", "1"))
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        hosts = False if agent else None
        port = int(port)
    elif parsed.scheme == "tcp":
        host, port = parsed.hostname, parsed.port
        if not host or not port:
            raise ValueError(f"cluster={url!r}: expected tcp://HOST:PORT.")
        hosts = {"0": False, "1": True}.get(query.get("host", [""])[0])
    else:
        raise ValueError(f"cluster={url!r}: expected 'tcp://HOST:PORT', 'env://' or a torch.distributed Store.")
    node_here = found_node if found_node is not None else node
    is_master = (node_here == 0) if hosts is None else hosts
    if is_master:
        store = host_tcp_store(host, port, timeout=timeout)
    else:
        store = _connect_client(host, port, timeout)
    return store, found_node, found_nodes


def _connect_client(host: str, port: int, timeout: float):
    """The node's first connection to the store (a TCPStore client), bounded: torch's
    constructor waits for the host's answer to its validation with no limit once the
    connect itself succeeded, which the kernel does for a stopped host (fuzz17: a node's
    ``start()`` waited as long as the host was stopped). Watched as a call that connects
    (due two timeouts later, see ``SignedStore._connecting_now``): overdue, its socket is
    cut (cluster_store_watch) and ConnectionError is raised. A host that is not there (no
    node hosts the store yet, a wrong address) is a ConnectionError too, once torch's
    connect tries end (its timeout; it was torch's DistNetworkError, a RuntimeError)."""
    watch = StallWatch((host, port), on_stall=lambda: None)
    me = threading.get_ident()
    try:  # (registered inside: a Ctrl-C landing after it still closes the watch, which would cut later)
        watch.begin(me, 2 * timeout)
        with resolving():
            return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
    except dist.DistNetworkError as err:
        if not watch.stalled.is_set():
            raise ConnectionError(
                f"Could not connect to the cluster store at {host}:{port} within the node's timeout ({timeout:g} s): "
                f"{str(err).splitlines()[0][:200]}. Start the node that hosts it (node 0 by default) first, and "
                "give every node the same address and port.") from err
        raise ConnectionError(
            f"The cluster store's host {host}:{port} accepted this node's connection but did not answer it "
            f"within {2 * timeout:g} s (twice the node's timeout): it is stopped, frozen, or cut off.") from err
    finally:
        watch.calls.pop(me, None)
        watch.close()
