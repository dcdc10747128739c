"""Across machines: the node coordinators of several machines form one cluster.

One :class:`Cluster` per node, in the process that runs the node's
:class:`~shared_td.Coordinator`. The cluster runs on what ships with torch:

* a ``torch.distributed`` Store (a ``TCPStore``, hosted by node 0 unless told otherwise)
  for names, layouts, versions, counters, heartbeats and requests, every value signed
  with the cluster authkey (:mod:`~shared_td.coordinator.cluster_store`);
* two-rank gloo process groups, one per pair of nodes, for tensor payloads
  (:mod:`~shared_td.coordinator.cluster_transfer`).

A name published with :meth:`Cluster.publish` has one owner node. Another node's
:meth:`Cluster.attach` makes a *replica*: one local anonymous segment with the owner's
layout (:mod:`~shared_td.coordinator.cluster_layout`: any tree of TensorDicts,
tensorclasses and lazy stacks, rebuilt with the same classes; the segment and its
versions: :mod:`~shared_td.coordinator.cluster_replica`), filled by one transfer and
published on the node's own Coordinator under the same name, so all processes of that
node attach it as today and the network copy is made once per node.

Non-tensor values published with ``share_non_tensor=True`` are shared by every node: each
node keeps them in its own shared cells, a write on any node is sent to the others as a
signed notice, and the highest store version wins
(:mod:`~shared_td.coordinator.cluster_values`). Publishing a name again makes a new
*generation*: each node that holds a replica renews it by itself (one full transfer into
a new segment, which replaces the old replica once filled), so the views of that node's
processes turn stale (:func:`shared_td.is_stale`) and :func:`shared_td.refresh` gives the
new one; a push of rows written into a view of the old generation is refused (see
:meth:`Cluster.push`).

The class is in four parts, each in its own module: this node's calls (here), attaching
another node's name as a replica (:mod:`~shared_td.coordinator.cluster_attach`), joining
and leaving (:mod:`~shared_td.coordinator.cluster_membership`), and requests to other
nodes with what their failures mean (:mod:`~shared_td.coordinator.cluster_requests`).
Requests travel through the store, each node serving its peers from one lane per peer
(:mod:`~shared_td.coordinator.cluster_serve`); payloads go over the pair's gloo groups
(:mod:`~shared_td.coordinator.cluster_transfer`; a push, once its pair is built, skips
the store: :mod:`~shared_td.coordinator.cluster_push`; a sync's sending half:
:mod:`~shared_td.coordinator.cluster_sync`). Every wait is bounded, and a wait on a
transfer ends as soon as its peer is found lost
(:mod:`~shared_td.coordinator.cluster_waits`).

Failure behaviour:

* Each node writes a heartbeat every ``HEARTBEAT_S``; a node whose heartbeat has not
  changed for ``LOST_AFTER_S`` is lost (:mod:`~shared_td.coordinator.cluster_liveness`).
  ``pull``/``push`` whose owner is lost raise :class:`~shared_td.errors.OwnerLostError`
  about ``LOST_AFTER_S`` (plus one look, ``WATCH_S``) after the owner died, whether gloo
  reports the closed connection or leaves the transfer hanging. The replica stays
  readable (after an interrupted transfer its version reads None: its rows may mix two
  versions). A failed transfer with a node that is alive raises a ConnectionError: the
  call may be retried (a new pair generation).
* ``sync`` on the owner drops a replica node that fails or does not answer within the
  timeout (or is lost) and reports it in :attr:`SyncReport.dropped`; the others get it.
* The store host lost: store calls raise :class:`ConnectionError`.
* A record of the store with a wrong signature is never used and counted in
  ``refused``; a forged non-tensor value met by ``attach`` is stored again by its owner.

Example: a one-node cluster on a store of a free port (normally one member per machine,
all started with the same URL and authkey, e.g. ``Cluster("tcp://head:29600", node=i,
nodes=n, authkey=key)``, each waiting in ``start()`` for the others)::

    >>> import datetime, torch, shared_td
    >>> from torch.distributed import TCPStore
    >>> store = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    >>> with Cluster(store, node=0, nodes=1, authkey=b"sixteen+ byte key") as cluster:
    ...     td = cluster.publish("policy", shared_td.TensorDict(w=torch.zeros(3), mode="train", batch_size=[3]),
    ...                          share_non_tensor=True)
    ...     _ = td.set_("mode", "eval")      # any node's set_ reaches the others within ms
    ...     cursor = shared_td.SharedCounter("cursor", cluster=cluster)
    ...     cluster.owner("policy"), cluster.sync("policy").version, cursor.fetch_add(8), cursor.value
    (0, 2, 0, 8)

On another node, ``cluster.attach("policy")`` makes its replica, ``shared_td.version(view)``
and ``shared_td.wait_version(view, n)`` tell which delivery it holds (each sync and each
pull, a first attach or renew included, takes the owner's next version), and
``shared_td.is_stale(view)``/``shared_td.refresh(view)`` follow a re-publish.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import os
import secrets
import threading
import time

from shared_td.coordinator import cluster_generations as generations
from shared_td.coordinator import cluster_drain, cluster_layout, cluster_push, cluster_sync
from shared_td.coordinator import cluster_replica as replica
from shared_td.coordinator.cluster_attach import ATTACH_TRIES, ClusterAttach
from shared_td.coordinator.cluster_liveness import Liveness
from shared_td.coordinator.cluster_owners import claim_name
from shared_td.coordinator.cluster_membership import ClusterMembership
from shared_td.coordinator.cluster_replica import Owned, Replica
from shared_td.coordinator.cluster_requests import ClusterRequests
from shared_td.coordinator.cluster_serve import lane_queue
from shared_td.coordinator.cluster_counter import ClusterCounter
from shared_td.coordinator.cluster_store import ClusterAuthError, SignedStore, cluster_key
from shared_td.coordinator.cluster_sync import SyncReport
from shared_td.coordinator.cluster_transfer import PairGroups, TransferFailed, stripe_count, stripe_ranges
from shared_td.coordinator.cluster_values import ClusterValues
from shared_td.coordinator.cluster_wake import AnswerWaits
from shared_td.errors import OwnerLostError, TransferRefused
from shared_td.platform import ThreadLock

__all__ = ["ATTACH_TRIES", "Cluster", "ClusterAuthError", "OwnerLostError", "SyncReport"]

#: Seconds any cluster call may take in all, unless the Cluster is given another timeout.
DEFAULT_TIMEOUT = 30.0
#: Stripes of a large transfer by default (Cluster's ``stripes``): 1, as measured on a
#: 2-core loopback (CPU-bound: 2 or 4 gave no reliable gain for a 100 MB sync); where one
#: TCP stream is bound by the link or its latency, try more (``--only cluster_sync``).
DEFAULT_STRIPES = 1
# (ATTACH_TRIES, the tries of an attach overtaken by a publish: defined in cluster_attach, re-exported)


class Cluster(ClusterAttach, ClusterMembership, ClusterRequests):
    """This node's membership of a cluster.

    Args:
        cluster: ``"tcp://HOST:PORT"`` (node 0 hosts the TCPStore there; ``?host=0`` on
            every node when another process hosts it), ``"env://"`` (``MASTER_ADDR``,
            ``MASTER_PORT``, node rank and count from the environment: torchrun, a
            scheduler), or a ``torch.distributed`` Store.
        node, nodes: this node's number and the number of nodes.
        authkey: the cluster authkey (bytes or str, 16 bytes at least), the same on every node; default
            ``SHARED_TD_CLUSTER_KEY``.
        timeout: seconds any call may take in all (joining waits for every node).
        coordinator: this node's running Coordinator; replicas are published on it under
            their name, so local processes attach them by name.
        hostname: the address gloo binds and announces; default: ``GLOO_SOCKET_IFNAME``'s
            interface, else this host's name.
        stripes: how many gloo groups (TCP connections) of a pair carry one ``sync``,
            ``pull`` or first attach of at least
            :data:`~shared_td.coordinator.cluster_transfer.STRIPE_MIN_BYTES`, each a
            contiguous byte range, received in place (1 to
            :data:`~shared_td.coordinator.cluster_transfer.MAX_STRIPES`; the node that
            asks for a transfer chooses: the owner for a sync, the replica for a pull).
            Default :data:`DEFAULT_STRIPES`. A ``push`` goes over one.
    """

    def __init__(self, cluster, node: int | None = None, nodes: int | None = None, *,
                 authkey=None, timeout: float = DEFAULT_TIMEOUT, coordinator=None,
                 hostname: str | None = None, stripes: int | None = None):
        stripes = DEFAULT_STRIPES if stripes is None else stripes
        stripe_ranges(0, stripes)  # ValueError now, not at the first transfer
        self.stripes = stripes
        self._spec, self.node, self.nodes = cluster, node, nodes
        self._authkey = cluster_key(authkey)
        self.timeout = timeout
        self._coordinator = coordinator
        self._hostname = hostname
        self._store: SignedStore | None = None
        self._groups: PairGroups | None = None
        self._values: ClusterValues | None = None
        self._owned: dict[str, Owned] = {}
        # name -> the node that took it over while this node's heartbeat stood still
        self._taken_names: dict[str, str] = {}
        self._replicas: dict[str, Replica] = {}
        # name -> a replica being filled by attach, not yet in _replicas (see _attach): a
        # sync of its generation that comes meanwhile is received into it (_receiving)
        self._filling: dict[str, Replica] = {}
        self._held: set[str] = set()  # names published on this node's Coordinator by us
        # name -> the newest generation its owner announced to this node (a renew notice):
        # what is_stale can still tell once the store host is lost
        self._announced: dict[str, int] = {}
        self._attaching = ThreadLock()  # one attach at a time (user's, or a lane's renewal)
        self._tags = itertools.count(1)
        self._reply_slots = itertools.count()
        self._local = threading.local()  # each thread's reply queue
        # reply queues that drains handed back once done (cluster_drain), taken again before
        # a new slot: the store's host keeps every queue name it met for good
        self._free_replies: list[str] = []
        self._waits = AnswerWaits()  # the threads waiting in their reply queue, woken by the watch thread
        self._stop = threading.Event()  # set: this node's threads end (shutdown, or the number taken over)
        self._closed = False  # shutdown() ran
        self._left = False  # shutdown() ran to its end (an interrupted one is finished by the next call)
        self._liveness: Liveness | None = None
        self._claim: str | None = None  # this process's token in claim/<node> (cluster_liveness)
        self._run = ""  # the cluster's run, which claim tokens are bound to (cluster_runs.run_id)
        self._threads: list[threading.Thread] = []
        self._push_lines: dict[int, cluster_push.PushLine] = {}  # owner -> this node's pushes to it
        self._name_syncs: dict[str, cluster_sync.NameSyncs] = {}  # owned name -> its syncs' state
        self._senders = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="shared_td-sync")
        self.refused = 0  # requests dropped for a wrong signature
        self.renew_failures = 0  # replicas not renewed after a re-publish (see cluster_serve)
        self.serve_errors = 0  # errors a serving thread met and served on past (cluster_serve)
        # this process's run of the node, named in its requests and echoed by their answers
        # in the store: a restarted node must not take its predecessor's (cluster_requests)
        self._caller = secrets.token_hex(8)

    def counter(self, name: str) -> ClusterCounter:
        """A counter shared by every node (``fetch_add`` is one ``TCPStore.add``)."""
        return ClusterCounter(self._checked(), name)

    # ------------------------------------------------------------------ names
    def publish(self, name: str, td, *, share_non_tensor: bool = False):
        """Publish ``td`` as ``name`` owned by this node; returns ``td``.

        ``td`` (a TensorDict, a tensorclass or a LazyStackedTensorDict, nested in any
        way; its members may differ in shape) is memory-mapped into one anonymous
        segment (``memmap_()``, on this node's Coordinator when there is one). Another
        node's replica has the same classes (a tensorclass must be defined on that node:
        its module imported before the attach), batch sizes, names and stack dims. With
        ``share_non_tensor=True`` its
        NonTensorData values are shared by every process of every node: a write on any
        node reaches the others within milliseconds (see
        :mod:`~shared_td.coordinator.cluster_values`); without it, a tree with a
        non-tensor value is refused. Publishing a name again makes a new generation:
        replicas of the old one are stale (:meth:`is_stale`). A name has one owner: one
        another node owns is a ValueError while that node lives, and taken over once it
        is lost (:func:`~shared_td.coordinator.cluster_owners.claim_name`)."""
        store = self._as_node(f"publish({name!r})")
        cluster_push.check_name(name)  # before anything is claimed: a push of it could never be sent
        cluster_layout.check_kinds(td, name, share_non_tensor)  # before anything is mapped or published
        with generations.publish_lock(self, name):  # claim to record: see cluster_generations
            claim_name(store, self._liveness, self.node, self.nodes, name, refuse=self._count_refused, run=self._run,
                       recorded_owner=lambda: (generations.read_name(self, store, name) or {}).get("owner"))
            td = self._memmap_here(name, td, share_non_tensor)
            layout, segment, cells = cluster_layout.describe(td, name, share_non_tensor)
            generation, digest = generations.next_generation(self, store, name), generations.layout_digest(layout)
            self._owned[name] = Owned(td, segment, layout, generation, version=1, digest=digest)  # (a higher one)
            self._taken_names.pop(name, None)
            self._replicas.pop(name, None)  # a name taken over from its lost owner: no replica of it any more
            self._values.publish(name, generation, cells, digest)  # before the name: attachers read them
            if not generations.record_name(self, store, name, {"owner": self.node, "generation": generation,
                                                               "digest": digest, "layout": layout}):
                raise generations.overtaken(self, store, name)
            if generation > 1:  # replicas of the old generation renew themselves
                for peer in range(self.nodes):
                    if peer != self.node and cluster_sync.has_replica(self, store, name, peer):
                        store.push_json(lane_queue(peer, self.node), {"op": "renew", "name": name, "from": self.node,
                                                                      "generation": generation})
            store.set_json(f"version/{name}", {"version": 1, "generation": generation})
        return td

    def knows(self, name: str) -> bool:
        """Whether ``name`` is published across the cluster (one store round trip)."""
        return self._checked().has(f"name/{name}")

    def owner(self, name: str) -> int:
        """The node that owns ``name``; KeyError if nothing is published as ``name``."""
        return self._info(name)["owner"]

    def _info(self, name: str) -> dict:
        store = self._checked()
        if not store.has(f"name/{name}"):
            raise KeyError(f"Nothing is published as {name!r} in the cluster (publish it with "
                           "replicate=True on its owner node first).")
        return store.get_json(f"name/{name}")

    def _memmap_here(self, name: str, td, share_non_tensor: bool):
        """``td`` in anonymous memory, published on this node's Coordinator if any."""
        self._held.add(name)
        if self._coordinator is not None:
            if share_non_tensor:
                return self._coordinator.publish(name, td, share_non_tensor=True)
            return self._coordinator.publish(name, td)
        return td.memmap_(share_non_tensor=share_non_tensor)  # keeps leaves already in anonymous memory

    def holds(self, name: str) -> bool:
        """Whether ``name`` on this node's Coordinator is the cluster's (owned or a
        replica); the others are recorded in :attr:`local_names`."""
        return name in self._held and not self._closed  # (shut down: the names are left to the Coordinator)

    def replicates(self, name: str) -> bool:
        """Whether this node holds a replica of ``name`` (no round trip)."""
        return name in self._replicas

    def is_stale(self, name: str) -> bool:
        """Whether the owner published ``name`` again since this replica was made. Once
        the store host is lost: whether the owner announced a newer generation to this
        node before (no new one can be published after)."""
        have = self._replicas.get(name)
        if have is None:
            return False
        return self._identity(name) != (have.generation, have.digest)

    def version(self, name: str) -> int | None:
        """The version this node holds of ``name`` (the owner's: the last it delivered)."""
        if name in self._owned:
            return self._owned[name].version
        return replica.replica_version(self._replica(name).td)

    def _replica(self, name: str) -> Replica:
        have = self._replicas.get(name)
        if have is None:
            raise KeyError(f"This node has no replica of {name!r}: attach it first.")
        return have

    # ------------------------------------------------------------------ transfers
    def pull(self, name: str) -> int:
        """Replica <- owner: the owner's current contents, in place; returns the version.
        OwnerLostError if the owner is lost (the replica keeps what it has)."""
        if name in self._owned:
            return self._owned[name].version
        self._as_node(f"pull({name!r})")
        return self._fill(name, self._replica(name))

    def _fill(self, name: str, rep: Replica) -> int:
        """:meth:`pull` into ``rep`` (registered or not: see _attach; asked without its lock: see
        cluster_serve._serve_pull); returns the version."""
        rep.lock.refuse_reentry(f"pull({name!r})")  # (before anything is asked: nothing to drain)
        deadline = time.monotonic() + self.timeout
        nbytes = rep.layout["nbytes"]
        stripes = stripe_count(nbytes, self.stripes)
        def ask():  # (its budget: the owner serves it no later, see cluster_deliveries)
            asked[:] = self._request(rep.owner, "pull", name, rep.generation, stripes=stripes, digest=rep.digest,
                                     budget=round(max(0.0, deadline - time.monotonic()), 3))
            return (*asked, cluster_drain.answer(self, rep.owner, name, asked, deadline, nbytes, stripes))

        asked = []  # (tag, pair): a pull given up is still received when served (cluster_drain)
        try:
            tag, generation, answer = self._retried_if_stale(ask)
        except TransferRefused as refusal:  # of the old generation: "published again" when it was
            cluster_push.raise_if_republished(self, name, rep, refusal, "pull")
            raise
        bound = cluster_drain.receive_bound(self)  # (announced: its send is bounded so)
        try:
            if not rep.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                cluster_drain.into_scratch(self, rep.owner, generation, tag, nbytes, stripes, f"pull of {name!r}")
                raise TimeoutError(f"Another transfer of {name!r} on this node did not end within {self.timeout:g} s.")
            try:
                replica.set_state(rep.segment, replica.state(rep.segment) | 1)
                works = self._groups.recv(rep.owner, generation, replica.segment_bytes(rep.segment, nbytes), tag,
                                          bound, stripes)
                # every stripe, before the version; given up once the owner is found lost
                self._groups.wait(rep.owner, works, bound, f"pull of {name!r}", nbytes, generation=generation)
            except TransferFailed as err:
                self._groups.fail(rep.owner, generation)
                raise self._lost_or(rep.owner, name, err) from err
            replica.set_state(rep.segment, 2 * answer["version"])
            return answer["version"]
        finally:
            try:
                rep.lock.release()
            except RuntimeError:
                pass  # not taken: timed out, or interrupted before acquire returned (platform.ThreadLock)

    def push(self, name: str, index) -> None:
        """Rows ``index`` (of the first batch dimension) of this node's replica -> the
        same rows of the owner's tree, in place. Returns when the owner wrote them.

        ``index`` selects rows as ``td[index]`` does on the first batch dimension: an
        int, a slice, ints (negative ones from the end) or a boolean mask of that
        dimension's length. A row is what ``td[i]`` selects: of a tensorclass, row
        ``i`` of its fields; of a lazy stack along dim 0 (the root's first dimension),
        its whole member ``i``; of a lazy stack along another dim, row ``i`` of every
        member. Non-tensor values are not pushed: with ``share_non_tensor=True`` they
        travel by themselves.

        The rows are read from this node's replica once no transfer writes it (a sync or
        pull under way is waited for, within the timeout). Once the owner published
        ``name`` again, the rows written into views of the old generation cannot be
        pushed: the push raises a RuntimeError saying so and sends nothing, both while
        this node renews its replica and after (the new replica holds the owner's own
        values, not the user's rows), until ``attach(name)`` in this process (or
        ``shared_td.refresh`` of its view) returns the new generation."""
        cluster_push.push(self, name, index)  # over the pair when it is built: see cluster_push

    def sync(self, name: str, timeout: float | None = None) -> SyncReport:
        """On the owner: send the current contents of ``name`` to every node holding a
        replica, as a new version; returns when all have it (or were dropped: a node
        that fails or does not answer within ``timeout`` seconds)."""
        return cluster_sync.sync(self, name, timeout)  # see cluster_sync

    # ------------------------------------------------------------------ helpers
    def generation(self, name: str) -> int:
        """The current generation of ``name`` (one store round trip): it grows with
        every publish of ``name`` on its owner. Once the store host is lost, for a name
        this node replicates: the newest generation it knows of (its replica's, or one
        the owner announced since); ConnectionError for the others."""
        return self._identity(name)[0]

    def _identity(self, name: str) -> tuple[int, str | None]:
        """(generation, digest) of ``name`` (see :meth:`generation`; the digest is None
        once the store host is lost and the owner announced a newer generation)."""
        try:  # the small gen/<name> record, not the whole layout (cluster_generations.read_identity)
            current = generations.read_identity(self._checked(), name, self._count_refused)
            if current is None:
                self._info(name)  # its KeyError
            return current
        except ConnectionError:
            have = self._replicas.get(name)
            if have is None:
                raise
            announced = self._announced.get(name, 0)
            return (have.generation, have.digest) if announced <= have.generation else (announced, None)

    def _checked(self) -> SignedStore:
        """The store, once this node runs: RuntimeError before start() and after
        shutdown(), NodeTakenOverError once another process took this node's number over.
        In a fork child of the node's process, the store only (its own connections: see
        cluster_store's _STORES): reads and counters; what acts as the node asks
        :meth:`_as_node` first."""
        if self._store is None:
            raise RuntimeError("This Cluster is not started (call start()).")
        if self._closed:
            # before the liveness check: a node that left stopped beating, and its own
            # stopped heartbeat read as a takeover (a NodeTakenOverError naming this pid)
            raise self._shut_down()
        if self._liveness is not None and os.getpid() == self._started_in:
            # (a fork child's copy never beats: its look would write the node's heartbeat)
            self._liveness.check()
        return self._store

    def _as_node(self, call: str) -> SignedStore:
        """:meth:`_checked`, for a call that acts as this node (publish, pull, push, sync,
        an attach that makes a replica): a RuntimeError in a fork child of the node's
        process, whose copies of the node's gloo pairs are the parent's sockets and whose
        copy has none of the node's threads (before, its sync went out on them beside the
        parent's transfers, and its publish claimed a name that no process served)."""
        if os.getpid() != self._started_in:
            raise RuntimeError(
                f"{call}: this process (pid {os.getpid()}) is a fork child of node {self.node}'s process (pid "
                f"{self._started_in}), not the node: its transfers, threads and heartbeat stay in that process. "
                "Make this call there; a fork child may read the node's replicas (shared memory), attach one the "
                "node holds and use its cluster counters.")
        return self._checked()

    def _shut_down(self, during: str = "") -> RuntimeError:
        """The error of a call on this node once it was shut down (``during``: the call
        that was under way then)."""
        return RuntimeError(f"Cluster node {self.node} was shut down{during} (shutdown(), or its start() failed): "
                            "its threads and store connections are gone. Start a new Cluster to rejoin.")

