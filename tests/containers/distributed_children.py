"""The ranks of tests/containers/test_distributed_ops.py: each a spawned process in a gloo
group on 127.0.0.1 (rendezvous through the test's TCPStore), running one scenario and
putting ``(rank, result)`` or ``(rank, "error", traceback)`` on a queue.

A helper module, not a test; imported as ``tests.containers.distributed_children``.
"""
from __future__ import annotations

import datetime
import os
import traceback

import torch

from shared_td import tensorclass

TIMEOUT = 30  # seconds: any wait of the group


def rank_main(scenario: str, rank: int, world: int, port: int, queue, argument) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch.distributed as dist

    try:
        store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=TIMEOUT))
        dist.init_process_group("gloo", store=dist.PrefixStore(scenario, store), rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT))
        try:
            queue.put((rank, globals()[scenario](rank, argument)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _tree(fill: float):
    from shared_td import LazyStackedTensorDict, TensorDict

    td = TensorDict(
        b=torch.full((4, 3), fill),
        a=TensorDict(z=torch.full((4,), fill, dtype=torch.int64), y=torch.full((4, 2), fill), batch_size=[4]),
        text="sender" if fill else "receiver",
        batch_size=[4],
    )
    td["stack"] = LazyStackedTensorDict(*(TensorDict(v=torch.full((2,), fill + i)) for i in range(4)), stack_dim=0)
    return td


def _plain(td) -> dict:
    return {key if isinstance(key, str) else ".".join(key): value.tolist()
            for key, value in td.items(include_nested=True, leaves_only=True)
            if isinstance(value, torch.Tensor)}


# ------------------------------------------------------------------ point to point
def send_recv(rank: int, prefix: str) -> dict:
    """Rank 0 sends a tree (nested, a lazy stack, a non-tensor value); rank 1 receives
    into its own tree built in another key order, with a memory-mapped leaf, a leaf that
    is not contiguous and a non-tensor value that must stay."""
    from shared_td import TensorDict

    if rank == 0:
        td = _tree(1.0)
        td["a", "y"] = torch.full((2, 4), 1.0).T  # not contiguous on the sending side
        td.send(dst=1)
        return {}
    td = _tree(0.0)
    target = TensorDict(stack=td["stack"], text="receiver", batch_size=[4])
    target["b"] = torch.zeros(3, 4).T  # not contiguous: received through a copy
    target["a"] = td["a"].memmap_(prefix)
    tag = target.recv(src=0)
    return {"values": _plain(target), "text": target["text"], "tag": tag,
            "memmap_file": torch.from_file(os.path.join(prefix, "z.memmap"), size=4, dtype=torch.int64).tolist()}


def interop(rank: int, direction: str) -> dict:
    """One rank with tensordict 0.15.3, the other with shared_td: pseudo-random tags from
    init_tag 7, then plain tags from 100."""
    import shared_td
    import tensordict

    sender_module, receiver_module = (tensordict, shared_td) if direction == "td_to_std" else (shared_td, tensordict)
    module = sender_module if rank == 0 else receiver_module
    def tree(fill: float):
        return module.TensorDict(b=torch.full((4, 3), fill), batch_size=[4],
                                 a={"z": torch.full((4,), fill), "y": torch.full((4, 2), fill)})

    td = tree(0.0)
    if rank == 0:
        tree(1.0).send(dst=1, init_tag=7, pseudo_rand=True)
        tree(2.0).send(dst=1, init_tag=100)
        return {}
    first = td.recv(src=0, init_tag=7, pseudo_rand=True)
    seen = _plain(td)
    last = td.recv(src=0, init_tag=100)
    return {"first": seen, "second": _plain(td), "tags": [first, last]}


def isend_irecv(rank: int, _) -> dict:
    from shared_td import TensorDict

    td = TensorDict(a=torch.full((4,), float(1 - rank)), b=torch.full((4, 3), float(1 - rank)), batch_size=[4])
    if rank == 0:
        works = td.isend(dst=1, return_early=True, init_tag=3)
        for work in works:
            work.wait()
        return {"count": len(works)}
    target = TensorDict(a=torch.zeros(4), b=torch.zeros(3, 4).T, batch_size=[4])  # b: through a copy
    works = target.irecv(src=0, return_premature=True, init_tag=3)
    for work in works:
        work.wait()
    return {"count": len(works), "values": _plain(target)}


def group_peers(rank: int, _) -> dict:
    """``group_dst``/``group_src`` over a standalone gloo group (never registered)."""
    import torch.distributed as dist

    from shared_td import TensorDict

    store = dist.PrefixStore("standalone", dist.distributed_c10d._get_default_store())
    group = dist.ProcessGroupGloo(store, rank, 2)
    td = TensorDict(a=torch.full((3,), float(1 - rank)), batch_size=[3])
    if rank == 0:
        td.send(group=group, group_dst=1)
        return {}
    td.recv(group=group, group_src=0)
    return {"a": td["a"].tolist()}


def remote_init(rank: int, _) -> dict:
    """init_remote, then batches sent consolidated into the receiver's buffer."""
    from shared_td import NonTensorData, TensorDict

    if rank == 0:
        td = TensorDict(obs=torch.ones(2, 5), nested=TensorDict(r=torch.arange(2.0), batch_size=[2]),
                        task="walk", meta=NonTensorData({"k": [1, 2]}), batch_size=[2])
        td.init_remote(dst=1)
        consolidated = td.consolidate()
        for step in range(3):
            consolidated["obs"].fill_(step + 10)
            consolidated.send(dst=1, consolidated=True)
        td.isend(dst=1, consolidated=True)  # not consolidated: consolidated on the way
        return {}
    td = TensorDict.from_remote_init(src=0)
    first = _plain(td)
    seen = []
    for _ in range(3):
        td.recv(src=0, consolidated=True)
        seen.append(td["obs"][0, 0].item())
    td.irecv(src=0, consolidated=True)
    return {"first": first, "task": td["task"], "meta": td["meta"], "consolidated": td.is_consolidated(),
            "seen": seen, "last": td["obs"][0, 0].item(), "batch_size": list(td.batch_size)}


# --------------------------------------------------------------------- collectives
def broadcast(rank: int, _) -> dict:
    from shared_td import TensorDict

    td = TensorDict(a=torch.arange(3.0), s="from zero", batch_size=[3]) if rank == 0 else TensorDict()
    out = td.broadcast(src=0)
    return {"a": out["a"].tolist(), "s": out["s"], "consolidated": out.is_consolidated()}


def all_gather(rank: int, _) -> dict:
    from shared_td import TensorDict

    td = TensorDict({f"k{rank}": torch.full((rank + 1,), float(rank))}, batch_size=[rank + 1])
    return {"gathered": [_plain(item) for item in td.all_gather()]}


def gather_and_stack(rank: int, world: int) -> dict:
    from shared_td import TensorDict

    if rank == 0:
        out = TensorDict(a=torch.zeros(world - 1, 3), batch_size=[world - 1]).share_memory_()
        returned = out.gather_and_stack(dst=0)
        return {"a": out["a"].tolist(), "returned_self": returned is out}
    td = TensorDict(a=torch.full((3,), float(rank)), batch_size=[3])
    return {"returned": td.gather_and_stack(dst=0)}


def reductions(rank: int, bucket_bytes) -> dict:
    from shared_td import TensorDict

    def tree():
        td = TensorDict(b=torch.full((4, 3), float(rank + 1)), a=torch.full((4,), rank + 1, dtype=torch.int64),
                        c=torch.full((3, 4), float(rank + 1)).T, d=torch.full((4, 2), float(rank + 1)),
                        batch_size=[4])
        if rank:  # another insertion order: the wire order is sorted
            td = TensorDict({key: td[key] for key in reversed(list(td.keys()))}, batch_size=[4])
        return td

    summed = tree()
    summed.all_reduce(bucket_bytes=bucket_bytes)
    works_td = tree()
    works = works_td.all_reduce(async_op=True, bucket_bytes=bucket_bytes)
    for work in works:
        work.wait()
    reduced = tree()
    reduced.reduce(dst=0, bucket_bytes=bucket_bytes)
    result = {"all_reduce": _plain(summed), "async": _plain(works_td)}
    if rank == 0:
        result["reduce"] = _plain(reduced)
    return result


@tensorclass
class Step:
    obs: torch.Tensor
    label: str


def tensorclass_transfers(rank: int, _) -> dict:
    """A tensorclass through init_remote (its class kept on arrival), send/recv and
    broadcast, and a lazy stack through init_remote."""
    from shared_td import LazyStackedTensorDict, TensorDict

    if rank == 0:
        step = Step(obs=torch.ones(2, 3), label="walk", batch_size=[2])
        step.init_remote(dst=1)
        Step(obs=torch.full((2, 3), 5.0), label="run", batch_size=[2]).send(dst=1)
        LazyStackedTensorDict(TensorDict(x=torch.ones(2)), TensorDict(x=torch.zeros(2), y=torch.ones(1))).init_remote(
            dst=1)
        step.broadcast(src=0)
        return {}
    arrived = Step.from_remote_init(src=0)
    target = Step(obs=torch.zeros(2, 3), label="kept", batch_size=[2])
    target.recv(src=0)
    lazy = TensorDict.from_remote_init(src=0)
    broadcast = Step(obs=torch.zeros(0), label="", batch_size=[0]).broadcast(src=0)
    return {"arrived": [type(arrived).__name__, arrived.obs.tolist(), arrived.label],
            "received": [target.obs.tolist(), target.label],
            "lazy": [type(lazy).__name__, [sorted(member.keys()) for member in lazy.tensordicts],
                     lazy.tensordicts[1]["y"].tolist()],
            "broadcast": [type(broadcast).__name__, broadcast.obs.tolist(), broadcast.label]}


def sender_dies(rank: int, _) -> dict:
    """Rank 0 sends the first of three leaves by hand, then is SIGKILLed; rank 1's recv
    must raise (not wait for ever), within the group's timeout at most."""
    import signal
    import time

    import torch.distributed as dist

    from shared_td import TensorDict

    if rank == 0:
        dist.send(torch.ones(4), dst=1, tag=0)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    td = TensorDict(a=torch.zeros(4), b=torch.zeros(4), c=torch.zeros(4), batch_size=[4])
    began = time.monotonic()
    try:
        td.recv(src=0)
    except RuntimeError as error:
        return {"raised": str(error)[:200], "seconds": time.monotonic() - began, "a": td["a"].tolist()}
    return {"raised": None}


def scatter(rank: int, world: int) -> dict:
    """Rank 0 scatters one tensordict per rank (of different structures, a tensorclass
    among them); a tensorclass's all_gather gives TensorDicts, as tensordict's."""
    from shared_td import TensorDict

    parts = None
    if rank == 0:
        parts = [TensorDict(a=torch.full((3,), float(r)), s=f"to {r}", batch_size=[3]) for r in range(world - 1)]
        parts.append(Step(obs=torch.full((2, 3), float(world - 1)), label="last", batch_size=[2]))
    got = TensorDict().scatter(src=0, tensordicts=parts)
    gathered = Step(obs=torch.full((1, 3), float(rank)), label=str(rank), batch_size=[1]).all_gather()
    return {"type": type(got).__name__, "values": _plain(got), "s": got["s" if "s" in got.keys() else "label"],
            "gathered": [[type(item).__name__, item["obs"].tolist(), item["label"]] for item in gathered]}


def _outcome(call) -> list:
    """``[error type, message with its notes, seconds]`` of ``call()`` (None: it returned)."""
    import time

    began = time.monotonic()
    try:
        call()
    except Exception as error:
        try:
            said = str(error)
        except Exception:  # (an error whose message cannot be made: one of the cases)
            said = "<exception str() failed>"
        message = "\n".join([said, *getattr(error, "__notes__", [])])
        return [type(error).__name__, message, time.monotonic() - began]
    return [None, "", time.monotonic() - began]


class _WordlessError(Exception):
    def __str__(self):
        raise ValueError("no words")


class _RefusesPickleWordlessly:
    def __reduce__(self):
        raise _WordlessError()


def senders_fail(rank: int, world: int) -> dict:
    """A rank that cannot build its message (a non-tensor value pickle refuses, a
    scatter list that is not one per rank) raises its error; each other rank raises one
    naming it instead of waiting for the group's timeout (30 s); the group stays usable."""
    import threading

    import torch.distributed as dist

    from shared_td import TensorDict

    def unpicklable():
        return TensorDict(a=torch.ones(2), mutex=threading.Lock(), batch_size=[2])

    def remote_init():
        if rank == 0:
            unpicklable().init_remote(dst=1)
        elif rank == 1:
            TensorDict.from_remote_init(src=0)

    fine = TensorDict(a=torch.full((2,), float(rank)), batch_size=[2])
    wordless = TensorDict(a=torch.ones(2), value=_RefusesPickleWordlessly(), batch_size=[2])
    pair = dist.new_group([1, 2])  # (every rank makes it; ranks 1 and 2 gather in it)
    outcomes = {
        "init_remote": _outcome(remote_init),
        "broadcast": _outcome(lambda: (unpicklable() if rank == 0 else TensorDict()).broadcast(src=0)),
        "scatter_list": _outcome(lambda: TensorDict().scatter(src=0, tensordicts=[fine] if rank == 0 else None)),
        "scatter_pickle": _outcome(lambda: TensorDict().scatter(
            src=0, tensordicts=[fine] * (world - 1) + [unpicklable()] if rank == 0 else None)),
        "all_gather": _outcome(lambda: (unpicklable() if rank == 1 else fine).all_gather()),
        "gather_and_stack": _outcome(lambda: (unpicklable() if rank == 2 else
                                              TensorDict(a=torch.zeros(world - 1, 2), batch_size=[world - 1]))
                                     .gather_and_stack(dst=0)),
        "wordless": _outcome(lambda: (wordless if rank == 0 else TensorDict()).broadcast(src=0)),
        "pair": _outcome(lambda: (unpicklable() if rank == 2 else fine).all_gather(group=pair)) if rank else
        [None, "", 0.0],
    }
    check = torch.ones(1)
    dist.all_reduce(check)  # (the group still works)
    return {"outcomes": outcomes, "usable": check.item()}


def posting_fails(rank: int, _) -> dict:
    """all_reduce(op=MAX) of a tree whose second leaf torch refuses to post (complex):
    the error names that leaf, raised once the first leaf's reduction is done."""
    import torch.distributed as dist

    from shared_td import TensorDict

    td = TensorDict(a=torch.full((4_000_000,), float(rank + 1)), b=torch.ones(3, dtype=torch.complex64))
    outcome = _outcome(lambda: td.all_reduce(op=dist.ReduceOp.MAX))
    first = td["a"]
    return {"outcome": outcome[:2], "a_reduced_when_raised": bool((first[:1] == 2).all() and (first[-1:] == 2).all())}
