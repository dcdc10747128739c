"""The cluster's store: a ``torch.distributed`` Store whose every value is signed.

A ``TCPStore`` (and gloo) authenticate nobody: anything that reaches the port can read and
write keys. So every value that a node reads back from the store carries an HMAC-SHA256 of
the cluster authkey over ``key + NUL + payload``, and a value whose signature is wrong is
refused with :class:`ClusterAuthError` naming the key, before any byte of it is parsed.
Payloads are JSON (UTF-8); the one pickle, a cluster-wide non-tensor value
(:mod:`~shared_td.coordinator.cluster_values`), travels inside a signed JSON record and is
unpickled only after that record's signature was checked. The two integer facilities of the store that
cannot carry a signature -- ``add`` counters (:class:`~shared_td.coordinator.cluster_counter.ClusterCounter`, the pair generations
of :mod:`~shared_td.coordinator.cluster_transfer`) and gloo's own rendezvous keys -- are
only ever read as integers or by gloo: a forger can disturb them (a denial of service),
never make a node run code, and no decision about what a node sends, receives or keeps
is taken on them: generations come from the signed name record and a publish's identity
is a digest in it (:mod:`~shared_td.coordinator.cluster_generations`), value versions
from the signed value records (:mod:`~shared_td.coordinator.cluster_values`), and a
claim's token carries its own HMAC (:mod:`~shared_td.coordinator.cluster_liveness`). A
signed value can still be *replayed* by someone who recorded it: the cluster must run
on a private network.

Each thread talks to the store over its own connection (``Store.clone()``): a TCPStore
client serialises its calls, so one thread blocked in ``queue_pop`` or ``wait`` would
otherwise hold up every other thread of the process. A thread's first call takes a
*spare* connection made beforehand in the background when there is one: each TCPStore
connect makes torch resolve the peer's address back to a name (a reverse DNS lookup,
seen with strace), and a resolver that drops a query holds that connect for its 5 s
timeout (measured on the CI machine: one connect in ~25), which inside a ``sync`` ate the
call's whole deadline.

A blocking ``queue_pop`` runs on a connection of its own, one per thread and queue
(:meth:`SignedStore.pop_json`), never on the thread's connection for its other calls nor
on that of another queue. The store's host keeps a connection whose blocking pop of a
queue was answered registered as a waiter of that queue: the next value pushed there
wakes that connection's next blocking wait, whatever it waits for, and a pop of another,
empty queue then fails at once with ``QueueEmptyError`` (torch 2.13, measured: 0.05 s,
not a timeout). A lane that popped its requests and then waited for an answer in its
reply queue on one connection met it whenever the peer sent its next request meanwhile,
and the lane ended. A ``QueueEmptyError`` that still comes is read as "nothing yet": the
pop waits again within what is left of its timeout.

Example:
    >>> import datetime
    >>> from torch.distributed import TCPStore
    >>> raw = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5), wait_for_workers=False)
    >>> store = SignedStore(raw, b"k" * 32, timeout=5.0)
    >>> store.set_json("name/x", {"owner": 0})
    >>> store.get_json("name/x")
    {'owner': 0}
    >>> SignedStore(raw, b"other key", timeout=5.0).get_json("name/x")
    Traceback (most recent call last):
    ...
    shared_td.errors.ClusterAuthError: The value of 'name/x' in the cluster store has a wrong signature: ...
"""
from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import json
import os
import queue
import re
import threading
import time
import weakref

import torch.distributed as dist

# how a node finds its store, re-exported: defined here before
from shared_td.coordinator.cluster_launch import check_store, cluster_key, open_store  # noqa: F401
from shared_td.coordinator.cluster_launch import signing_key
from shared_td.coordinator.cluster_store_watch import StallWatch, open_sockets, resolving
from shared_td.errors import ClusterAuthError
from shared_td.storage.counter import INT64_MAX, INT64_MIN

__all__ = ["ClusterAuthError", "SignedStore", "check_store", "cluster_key", "open_store"]

_DIGEST = hashlib.sha256().digest_size
# The bound on one try of a spare connection's connect. torch retries a refused connect
# until this timeout, then once more after a random backoff of up to it: a spare that is
# connecting while the store's host dies runs ~2x this, and a node's close and its
# process's exit wait for it (7 s made a node's stop take 9.6 s). A try that fails for
# another reason (the resolver stalling for 5 s as torch resolves the peer's name) is
# tried again, up to SPARE_TRIES times, while the store is open.
SPARE_CONNECT_S = 2.0
SPARE_TRIES = 3
# the longest a spare's connect can run: torch's two tries and its backoff
_SPARE_CONNECT_WORST_S = 2 * SPARE_CONNECT_S + 1.0
#: The most queues one thread keeps a popping connection for (see
#: ``SignedStore.pop_json``): a lane pops its own queue, a caller its reply queue.
POP_CONNECTIONS = 4


# What a compare-and-set that expects it returns for a missing key (no value of the
# cluster is this: a signed one starts with its 32-byte digest): see get_unchecked
_ABSENT = b"\x00absent"
#: The most compare-and-set tries of one write that other writers keep overtaking.
CAS_TRIES = 1000


# Every SignedStore of this process. A fork child inherits their connections as shared
# sockets (its calls went out beside the parent's and each read the other's answer) and
# their watch, whose thread did not come along. So in a fork child each starts anew: no
# connection, no spare, a watch of its own, which spares the sockets inherited (listed
# before the child's first connection). The parent's connections are kept there, never
# freed: running torch's destructors of the parent's objects in a child is not known safe.
_STORES: weakref.WeakSet = weakref.WeakSet()
_INHERITED: list = []


def _forget_parents_connections() -> None:
    for store in list(_STORES):
        _INHERITED.append((store._local, store._spares, store._watch))
        store._no_connection_yet(forked=True)


os.register_at_fork(after_in_child=_forget_parents_connections)


def _store_call(method=None, *, waits=None):
    """A SignedStore method whose lost store host raises ConnectionError (torch raises
    DistNetworkError, a RuntimeError), whichever caller uses it: the Cluster, a counter.
    The call is due within the store's timeout, plus ``waits(self, *args, **kwargs)``
    seconds for a call that waits for something (a key, a queue's value); one that is
    not done by then finds the host lost (see cluster_store_watch). A call made inside
    another (``set_json_if_newer`` reads first) runs under the outer one's due time."""
    if method is None:
        return functools.partial(_store_call, waits=waits)

    @functools.wraps(method)
    def call(self, key, *args, **kwargs):
        me, calls = threading.get_ident(), self._watch.calls
        outer = me in calls
        try:
            if not outer:  # (inside the try: a Ctrl-C landing after it takes it back)
                self._watch.begin(me, self.timeout + (waits(self, key, *args, **kwargs) if waits else 0.0))
            return method(self, key, *args, **kwargs)
        except dist.DistNetworkError as err:
            self._host_lost = True  # no connection is tried any more: see _store
            raise self._lost(key, err) from err
        finally:
            if not outer:
                calls.pop(me, None)
    return call


def _is_counter(value: bytes) -> bool:
    """Whether ``value`` is an int64 as the store's host writes a counter (``std::to_string``)."""
    return re.fullmatch(rb"0|-?[1-9][0-9]*", value) is not None and INT64_MIN <= int(value) <= INT64_MAX


def _not_a_counter(key: str, value: bytes, outcome: str) -> ValueError:
    shown = value[:40] + (b"..." if len(value) > 40 else b"")
    return ValueError(
        f"{key!r} in the cluster store is a counter, but it holds {shown!r}, which is not an integer: something "
        f"other than a node of this cluster wrote it. {outcome} Set it back to an integer on the store "
        f"(store.set('shared_td/{key}', '0')) or use another name; run the cluster on a private network.")


def _adds_to(value: bytes) -> bool:
    """Whether the store's host can add to ``value``: it reads an int64 from its start
    (``std::stoll``: spaces, a sign, digits; what follows is ignored) and closes the
    connection of an addition it cannot read."""
    found = re.match(rb"\s*([+-]?\d+)", value)
    return found is not None and INT64_MIN <= int(found.group(1)) <= INT64_MAX


class SignedStore:
    """A Store (``base``) whose values are signed and checked with ``authkey``; all keys
    under ``shared_td/``. One connection per thread, ``spares`` of them connected ahead
    in the background (see the module's opening); :meth:`close` lets the spares go."""

    def __init__(self, base, authkey: bytes, *, timeout: float, spares: int = 0):
        self._base = dist.PrefixStore("shared_td", base)
        self._raw = base
        self._authkey = signing_key(authkey)  # (its hash: see signing_key)
        self.timeout = timeout
        self._closed = False
        # set once a call found the store's host gone: a connect to it would not fail
        # at once (torch retries a refused connect until its timeout, then once more
        # after a random backoff: 7-14 s for a spare), and no process can exit while
        # one runs (a node took 16 s to stop after the host's SIGKILL)
        self._host_lost = False
        self._no_connection_yet()
        _STORES.add(self)
        if spares:
            self._connect_spares(spares)

    def _no_connection_yet(self, forked: bool = False) -> None:
        """This process's connections (none yet: each thread makes its own at its first
        call) and the watch of its calls; made anew in a fork child (``forked``: see
        _STORES), whose watch spares the sockets it inherited (:meth:`_take_connection`)."""
        self._local = threading.local()
        self._spares: queue.SimpleQueue = queue.SimpleQueue()
        self._connecting: set[threading.Thread] = set()  # spares being connected
        self._connecting_lock = threading.Lock()
        self._inherited_unlisted = forked
        base = self._raw
        self._watch = StallWatch((base.host, base.port) if isinstance(base, dist.TCPStore) else None,
                                 on_stall=self._stalled)

    def hurry(self, seconds: float | None) -> None:
        """Every call of this store, in flight or to come, done within ``seconds``, or
        the host is taken as lost (see cluster_store_watch): a closing node's bound
        (None: lifted, for a close that was interrupted)."""
        self._watch.hurry(seconds)

    def _stalled(self) -> None:
        """A call was not done when due (see cluster_store_watch): the host is lost."""
        self._host_lost = True

    def _lost(self, key: str, err: Exception) -> ConnectionError:
        """The ConnectionError of a call on ``key`` that found the host gone (``err``)."""
        if self._watch.stalled.is_set():
            return ConnectionError(
                f"The cluster store's host did not answer a call of this node in time (the node's timeout, "
                f"{self.timeout:g} s, plus what the call waits for; while using {key!r}): it is taken as lost, as "
                "if it had stopped (it is stopped, frozen, or cut off from this node), and this node opens no "
                "new connection to it: start the cluster again.")
        return ConnectionError(f"The cluster store is gone ({err}) while using {key!r}: the "
                               "node that hosts it (node 0 by default) stopped.")

    def _connect_spares(self, count: int) -> None:
        """Put ``count`` new connections in the spares, each from its own background
        thread (a connect stalled by the resolver holds that thread only, not a caller
        and not the other spares)."""
        def connect_one() -> None:
            me = threading.get_ident()
            for _ in range(SPARE_TRIES):
                if self._closed or self._host_lost:
                    return
                try:  # due as a call (a host that accepts and never answers: see cluster_store_watch)
                    self._watch.begin(me, self.timeout + _SPARE_CONNECT_WORST_S)
                    self._spares.put(dist.PrefixStore("shared_td", self._new_connection()))
                    return
                except dist.DistNetworkError:  # timed out: stalled, or the host is gone
                    continue
                finally:
                    self._watch.calls.pop(me, None)

        def connect() -> None:
            try:
                connect_one()
            except (AttributeError, RuntimeError, ConnectionError):  # not clonable; a fork child that may not
                pass  # connect (see cluster_store_watch.resolving)
            finally:
                with self._connecting_lock:
                    self._connecting.discard(threading.current_thread())
            if self._closed:
                self._drop_spares()  # closed meanwhile: let what was just made go too

        # Not daemons: a daemon thread still inside torch's connect when the interpreter
        # exits aborts the process as it comes back ("terminate called without an active
        # exception"); close() and the interpreter's exit wait for these instead, each
        # connect bounded by _SPARE_CONNECT_WORST_S (at once while the store is up). Said so:
        # a thread inherits daemon from the thread that makes it, and a spare's
        # replacement is made by the thread that took it (a lane, a kept push receive).
        if self._closed or self._host_lost:
            return
        with self._connecting_lock:
            for _ in range(count):
                thread = threading.Thread(target=connect, name="shared_td-store-spare", daemon=False)
                self._connecting.add(thread)
                thread.start()

    def _new_connection(self):
        """A new connection to the store: a TCPStore whose connect tries are bounded by
        ``SPARE_CONNECT_S`` (see there: a spare made while the store's host dies must not
        hold a closing node for the whole store timeout), then given the store's own
        timeout; another Store's clone."""
        raw = self._raw
        with resolving():
            if not isinstance(raw, dist.TCPStore):
                return raw.clone()
            connect_s = min(SPARE_CONNECT_S, raw.timeout.total_seconds())
            store = dist.TCPStore(raw.host, raw.port, None, False, datetime.timedelta(seconds=connect_s))
        store.set_timeout(raw.timeout)
        return store

    def connect(self, spare_only: bool = False) -> None:
        """Give the calling thread its connection now (a spare if one is ready): for a
        thread that must answer fast once it has something to send. ``spare_only``:
        only a spare that is ready, else nothing now (the first store call connects)."""
        if spare_only and getattr(self._local, "store", None) is None and self._spares.empty():
            return
        self._store()

    def close(self) -> None:
        """Let the spare connections go (each thread's own goes with its thread), once
        those being connected are made (each connect bounded by _SPARE_CONNECT_WORST_S,
        and no new try after this): nothing of this store is left running, or opening and
        closing sockets, after it closed (one left so made a later test's descriptor
        check see sockets come and go)."""
        self._closed = True
        self._watch.close()
        deadline = time.monotonic() + _SPARE_CONNECT_WORST_S + 0.5
        with self._connecting_lock:
            connecting = list(self._connecting)
        for thread in connecting:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._drop_spares()

    def _drop_spares(self) -> None:
        while True:
            try:
                self._spares.get_nowait()
            except queue.Empty:
                return

    @property
    def raw(self):
        """The unsigned store under the same ``shared_td/`` prefix (gloo's rendezvous)."""
        return self._store()

    def _store(self):
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = self._take_connection()
        return store

    def _take_connection(self):
        """A connection for the calling thread: a spare if one is ready (its replacement
        is made in the background), else a new one; the store itself when it cannot be
        cloned (a HashStore: no sockets, no waiters to mix up)."""
        if self._host_lost:
            raise ConnectionError("The cluster store is gone (a call of this node found its host "
                                  "stopped): no new connection to it is tried.")
        if self._inherited_unlisted:  # a fork child's first connection: its sockets are all inherited
            with self._connecting_lock:
                if self._inherited_unlisted:
                    self._watch.spared, self._inherited_unlisted = open_sockets(), False
        try:
            store = self._spares.get_nowait()
            self._connect_spares(1)  # its replacement, in the background
        except queue.Empty:
            self._connecting_now()
            try:
                with resolving():
                    store = dist.PrefixStore("shared_td", self._raw.clone())
            except dist.DistNetworkError:
                # the host did not answer the connect: the call fails as any on a lost host
                # (taken for a Store that cannot be cloned, the thread went on over the
                # shared connection, which a fork child's watch spares: its call hung)
                raise
            except (AttributeError, RuntimeError):  # a Store that cannot be cloned: share it
                store = self._base
        return store

    def _connecting_now(self) -> None:
        """The calling thread's store call (if one runs) connects first: it is due that
        much later, the connect's own bound (torch's: the store's timeout), which a
        reverse DNS lookup the resolver dropped fills for 5 s: not the host stalling
        (review48: a node with a 1 s timeout took its healthy host as lost)."""
        me = threading.get_ident()
        due = self._watch.calls.get(me)
        if due is not None:
            self._watch.calls[me] = due + self.timeout

    def _queue_connection(self, queue_name: str):
        """The calling thread's connection for its blocking pops of ``queue_name``: one of
        its own, kept while the thread pops that queue (see the module's opening), at
        most POP_CONNECTIONS per thread (the least recently used goes)."""
        popping = getattr(self._local, "popping", None)
        if popping is None:
            popping = self._local.popping = {}
        store = popping.pop(queue_name, None)
        if store is None:
            if len(popping) >= POP_CONNECTIONS:
                del popping[next(iter(popping))]  # its socket closes with it
            store = self._take_connection()
        popping[queue_name] = store  # (the most recently used last)
        return store

    # --------------------------------------------------------------- signing
    def _mac(self, key: str, payload: bytes) -> bytes:
        """HMAC-SHA256 of the cluster authkey over ``key + NUL + payload``."""
        return hmac.digest(self._authkey, key.encode() + b"\0" + payload, "sha256")

    def sign(self, key: str, payload: bytes) -> bytes:
        return self._mac(key, payload) + payload

    def check(self, key: str, blob: bytes) -> bytes:
        """The payload of ``blob`` read at ``key``; ClusterAuthError if it is not signed
        with our authkey (compared in constant time)."""
        mac, payload = blob[:_DIGEST], blob[_DIGEST:]
        good = self._mac(key, payload)
        if len(blob) < _DIGEST or not hmac.compare_digest(mac, good):
            raise ClusterAuthError(
                f"The value of {key!r} in the cluster store has a wrong signature: the node "
                "that wrote it uses another cluster authkey (authkey= or SHARED_TD_CLUSTER_KEY "
                "must be the same on every node), or something else writes to the store. "
                "Nothing of it was used. Run the cluster on a private network."
            )
        return payload

    # --------------------------------------------------------------- values
    @_store_call
    def set_json(self, key: str, value) -> None:
        self._store().set(key, self.sign(key, json.dumps(value).encode()))

    @_store_call(waits=lambda self, key: self.timeout)
    def get_json(self, key: str):
        """The value at ``key`` (waits up to the store's timeout for it to exist)."""
        return json.loads(self.check(key, self._store().get(key)))

    @_store_call
    def set_json_if_newer(self, key: str, value: dict, field: str, forged=None, ties: bool = False) -> bool:
        """``set_json(key, value)`` unless ``key`` holds a value whose ``field`` is at
        least ``value[field]``: a compare-and-set loop on the store host, so that of two
        writers at once the higher ``field`` stays. True when ``value`` was written,
        False when a newer value was found (and kept). A current value with a wrong
        signature is refused (ClusterAuthError), never overwritten blindly -- unless
        ``forged`` is given: then ``forged()`` is called (the caller counts it) and the
        forged value, which carries nothing usable, is replaced by ``value`` (still a
        compare-and-set against exactly those bytes, so an honest writer's value
        stored meanwhile is compared again, not lost). After a failed compare-and-set
        the key is read again (for a key deleted in between, TCPStore answers the
        expected bytes, not what is there: the loop spun on them for good, audit 18),
        at most :data:`CAS_TRIES` times: then ClusterAuthError naming the key. With
        ``ties``, a value whose ``field`` equals ``value[field]`` is replaced too."""
        store, blob = self._store(), self.sign(key, json.dumps(value).encode())
        for _ in range(CAS_TRIES):
            current = self.get_unchecked(key)
            if current:
                try:
                    held = json.loads(self.check(key, current))[field]
                    if held > value[field] or (held == value[field] and not ties):
                        return False
                except ClusterAuthError:
                    if forged is None:
                        raise
                    forged()
            # (a missing or emptied key: b"" expected; TCPStore then creates it)
            if store.compare_set(key, current or b"", blob) == blob:
                return True
        raise ClusterAuthError(f"{key!r} changed at each of {CAS_TRIES} tries to store a newer {field} in it: "
                               "something keeps writing (or deleting) it. Run the cluster on a private network.")

    @_store_call
    def get_signed(self, key: str) -> tuple[object, bytes | None]:
        """The value at ``key`` and the bytes stored there, to replace exactly those with
        ``compare_set`` (:meth:`get_unchecked`: never waits); ``(None, None)`` when
        missing, ``(None, b"")`` for a key emptied (a record taken back, see
        ``cluster_sync``). ClusterAuthError for a wrong signature."""
        blob = self.get_unchecked(key)
        if not blob:
            return None, blob
        return json.loads(self.check(key, blob)), blob

    @_store_call
    def get_unchecked(self, key: str) -> bytes | None:
        """The bytes stored at ``key`` as they are (None when missing), signature NOT
        checked (:meth:`get_signed` checks it), in one round trip that never waits: a
        compare-and-set that expects what no value holds changes nothing and returns
        what is there (a ``get`` after a look waited the store's whole timeout for a key
        deleted between the two)."""
        held = self._store().compare_set(key, _ABSENT, _ABSENT)
        return None if held == _ABSENT else held

    @_store_call
    def has(self, key: str) -> bool:
        return self._store().check([key])

    @_store_call
    def has_all(self, keys: list[str]) -> bool:
        """Whether every key of ``keys`` exists: one round trip, whatever their number."""
        return self._store().check(keys)

    @_store_call(waits=lambda self, keys, timeout: timeout)
    def wait(self, keys: list[str], timeout: float) -> bool:
        """Whether all ``keys`` exist within ``timeout`` seconds (False on timeout)."""
        store = self._store()
        if store.check(keys):
            return True
        try:
            store.wait(keys, datetime.timedelta(seconds=max(timeout, 0.001)))
        except dist.DistStoreError as err:
            if "timeout" not in str(err):
                raise
            return False
        return True

    @_store_call
    def delete(self, key: str) -> None:
        self._store().delete_key(key)

    @_store_call
    def add(self, key: str, n: int) -> int:
        """``store.add``: the counter at ``key`` after adding ``n`` (unsigned, see above).
        ValueError naming ``key`` when it holds what is not an integer: the store's host
        answers such an addition by closing the connection, which read as the host being
        gone (every later call of the node failed, and none reconnected); the thread now
        takes a new connection and the host is found still there."""
        try:
            return self._store().add(key, n)
        except dist.DistNetworkError as err:
            self._after_dropped_add(key, err)
            raise  # the host is gone: ConnectionError (_store_call)

    def _after_dropped_add(self, key: str, err: Exception) -> None:
        """The connection of this thread dropped during an addition to ``key``: give the
        thread a new one (a spare if one is ready, else a connect bounded as a spare's)
        and read ``key`` with it. Returns when the host is gone (DistNetworkError from
        the new connection: the caller reports it); ValueError when ``key`` holds what
        the host cannot add to; ConnectionError otherwise (the host is there, the
        connection dropped: the addition may or may not have been made)."""
        self._local.store = None
        try:
            store = self._spares.get_nowait()
            self._connect_spares(1)
        except queue.Empty:
            store = dist.PrefixStore("shared_td", self._new_connection())
        value = store.get(key) if store.check([key]) else None
        self._local.store = store
        if value is not None and not _adds_to(value):
            raise _not_a_counter(key, value, "Nothing was added (the store's host refused the addition and closed "
                                             "that connection; this node made a new one and goes on).") from err
        raise ConnectionError(f"The cluster store closed this node's connection while adding to {key!r} "
                              f"({str(err).splitlines()[0][:200]}); its host still answers, so the call may be "
                              "retried (the addition may or may not have been made).") from err

    @_store_call
    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._store().compare_set(key, expected, desired)

    @_store_call
    def read_counter(self, key: str) -> int:
        """The counter at ``key`` (0 when missing) in one round trip, its bytes checked:
        ValueError naming ``key`` when they are not an integer as the store's host
        writes one. An addition (``add``, also of 0) cannot tell: the host adds to the
        integer the stored bytes start with and writes the sum back whole, so
        ``b"12abc"`` read as 12 and the rest was gone without a trace (read as
        :meth:`get_unchecked` reads)."""
        held = self.get_unchecked(key)
        if held is None:
            return 0
        if not _is_counter(held):
            raise _not_a_counter(key, held, "Nothing was read or added (an addition would have taken the integer "
                                            "it starts with, if any, and dropped the rest without a trace).")
        return int(held)

    # --------------------------------------------------------------- queues
    @_store_call
    def push_json(self, queue: str, value) -> None:
        self._store().queue_push(queue, self.sign(queue, json.dumps(value).encode()))

    @_store_call(waits=lambda self, queue, deadline=None: self.timeout if deadline is None
                 else max(0.0, deadline - time.monotonic()))
    def drain(self, queue: str, deadline: float | None = None) -> int:
        """Drop what waits in ``queue``, at most as many values as it held when this
        began and not past ``deadline`` (``time.monotonic()``; default: the store's
        timeout from now); returns how many values were dropped. Draining "until empty"
        never ended while anyone reaching the store kept pushing there (a pull hung
        > 60 s, its timeout 4 s); what a bounded drain leaves is skipped by its readers
        anyway (an answer by its tag and caller, a request by its signature and pair)."""
        store = self._store()
        deadline = time.monotonic() + self.timeout if deadline is None else deadline
        dropped, waiting = 0, store.queue_len(queue)
        while dropped < waiting and time.monotonic() < deadline:
            try:
                store.queue_pop(queue, False)
            except dist.QueueEmptyError:
                break  # another reader of the queue took the rest
            dropped += 1
        return dropped

    @_store_call(waits=lambda self, queue, timeout, ended=None: timeout)
    def pop_json(self, queue: str, timeout: float, ended=None):
        """The next value of ``queue``, or None when none came within ``timeout`` s.
        Waits on the thread's connection for that queue (see the module's opening); a
        wake-up that finds the queue empty (``QueueEmptyError``: a wake-up meant for
        another of its waits, or another process took the value) is "nothing yet", and
        the pop waits again for what is left of ``timeout`` -- unless ``ended()`` is
        true then: None at once (a process resumed after its node's number was taken
        over pops its queues beside its successor, and nobody sends it a stop notice)."""
        store = self._queue_connection(queue)
        deadline = time.monotonic() + timeout
        strays = 0
        try:
            while True:
                store.set_timeout(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
                try:
                    blob = store.queue_pop(queue)
                    break
                except dist.QueueEmptyError:
                    strays += 1
                    if time.monotonic() >= deadline or (ended is not None and ended()):
                        return None
                    # again at once the first time; a store that keeps waking in vain
                    # is not turned into a busy loop
                    time.sleep(min(0.001 * (strays - 1), 0.05, max(0.0, deadline - time.monotonic())))
                except dist.DistStoreError as err:
                    if "timeout" not in str(err):
                        raise
                    return None
        finally:
            store.set_timeout(datetime.timedelta(seconds=self.timeout))
        return json.loads(self.check(queue, blob))
