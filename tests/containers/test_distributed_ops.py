"""tensordict 0.15.3's torch.distributed methods (send, recv, isend, irecv, init_remote,
from_remote_init, broadcast, scatter, all_gather, gather_and_stack, reduce, all_reduce) between
real spawned ranks of a gloo group on 127.0.0.1, and against tensordict's own ranks
(tests/containers/distributed_children.py runs each rank). Every wait is bounded: the
group's own timeout, the queue read and the join."""
from __future__ import annotations

import datetime
import multiprocessing
import queue as queue_module

import pytest
import torch

pytest.importorskip("torch.distributed")
import torch.distributed as dist  # noqa: E402

from shared_td import MemoryMappedTensor, ReadOnlyError, TensorDict  # noqa: E402
from shared_td.coordinator.store_host import host_tcp_store  # noqa: E402
from tests import processes  # noqa: E402
from tests.containers import distributed_children as children  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def run_ranks(scenario: str, world: int = 2, argument=None, reporting: int | None = None) -> list:
    """Each rank's result, in rank order; a rank's error fails the test with every
    rank's traceback. ``reporting``: how many ranks report (the others die)."""
    store = host_tcp_store("127.0.0.1", 0, timeout=children.TIMEOUT)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=children.rank_main, args=(scenario, rank, world, store.port, results, argument))
             for rank in range(world)]
    for process in ranks:
        process.start()
    try:
        items = [results.get(timeout=90) for _ in range(world if reporting is None else reporting)]
    except queue_module.Empty:
        pytest.fail(f"{scenario}: a rank gave no result within 90 s")
    finally:
        for process in ranks:
            processes.finish(process)
    errors = [f"rank {item[0]} of {scenario}:\n{item[2]}" for item in sorted(items) if item[1] == "error"]
    if errors:
        pytest.fail("\n".join(errors))
    exit_codes = [process.exitcode for process in ranks]
    return [result for _, result in sorted(items)] + ([exit_codes] if reporting is not None else [])


def test_send_recv_writes_every_leaf_in_place_in_tensordicts_order(tmp_path):
    _, received = run_ranks("send_recv", argument=str(tmp_path / "a"))
    values = received["values"]
    assert values["b"] == [[1.0] * 3] * 4  # into a leaf that is not contiguous, through a copy
    assert values["a.z"] == [1] * 4 and values["a.y"] == [[1.0, 1.0]] * 4
    assert received["memmap_file"] == [1] * 4  # the bytes landed in the memory-mapped file
    assert values["stack.v"] == [[1.0 + i] * 2 for i in range(4)]  # member by member
    assert received["text"] == "receiver"  # non-tensor values are not sent (as in tensordict)
    assert received["tag"] == 6  # 7 leaves, tagged 0 to 6


@pytest.mark.parametrize("direction", ["td_to_std", "std_to_td"])
def test_a_tensordict_rank_and_a_shared_td_rank_exchange_leaves(direction):
    pytest.importorskip("tensordict")
    _, received = run_ranks("interop", argument=direction)
    assert received["first"] == {"b": [[1.0] * 3] * 4, "a.y": [[1.0] * 2] * 4, "a.z": [1.0] * 4}
    assert received["second"] == {"b": [[2.0] * 3] * 4, "a.y": [[2.0] * 2] * 4, "a.z": [2.0] * 4}
    assert received["tags"][1] == 102


def test_a_receive_from_a_sender_killed_mid_transfer_raises_instead_of_waiting():
    received, exit_codes = run_ranks("sender_dies", reporting=1)
    assert exit_codes[0] == -9
    assert received["raised"] and received["seconds"] < children.TIMEOUT, received
    assert received["a"] == [1.0] * 4  # the leaf that arrived before the death is there


def test_isend_and_irecv_return_their_transfers_early():
    sent, received = run_ranks("isend_irecv")
    assert sent["count"] == received["count"] == 2
    assert received["values"] == {"a": [1.0] * 4, "b": [[1.0] * 3] * 4}


def test_group_dst_and_group_src_go_through_a_standalone_group():
    assert run_ranks("group_peers")[1] == {"a": [1.0, 1.0, 1.0]}


def test_init_remote_sends_structure_and_values_then_consolidated_batches_land_in_its_buffer():
    received = run_ranks("remote_init")[1]
    assert received["first"] == {"obs": [[1.0] * 5] * 2, "nested.r": [0.0, 1.0]}
    assert received["task"] == "walk" and received["meta"] == {"k": [1, 2]}
    assert received["consolidated"] and received["batch_size"] == [2]
    assert received["seen"] == [10.0, 11.0, 12.0]
    assert received["last"] == 1.0  # the unconsolidated original, consolidated by isend


def test_broadcast_gives_every_rank_the_tree_of_src():
    for result in run_ranks("broadcast", world=3):
        assert result["a"] == [0.0, 1.0, 2.0] and result["s"] == "from zero" and result["consolidated"]


def test_all_gather_gives_every_rank_each_ranks_tree():
    expected = [{"k0": [0.0]}, {"k1": [1.0, 1.0]}, {"k2": [2.0, 2.0, 2.0]}]
    for result in run_ranks("all_gather", world=3):
        assert result["gathered"] == expected


def test_gather_and_stack_fills_dst_in_place_with_the_other_ranks_rows():
    results = run_ranks("gather_and_stack", world=3, argument=3)
    assert results[0] == {"a": [[1.0] * 3, [2.0] * 3], "returned_self": True}
    assert results[1] == results[2] == {"returned": None}


@pytest.mark.parametrize("bucket_bytes", [None, 40, 1 << 20])
def test_reduce_and_all_reduce_match_leaves_by_sorted_key_whatever_the_insertion_order(bucket_bytes):
    results = run_ranks("reductions", argument=bucket_bytes)
    expected = {"a": [3] * 4, "b": [[3.0] * 3] * 4, "c": [[3.0] * 3] * 4, "d": [[3.0] * 2] * 4}
    for result in results:
        assert result["all_reduce"] == expected and result["async"] == expected
    assert results[0]["reduce"] == expected


# ------------------------------------------------------------ refused before anything
@pytest.fixture
def lone_group():
    """A standalone gloo group of one rank (never registered): enough for what is refused
    before the first transfer is posted."""
    store = host_tcp_store("127.0.0.1", 0, timeout=10)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=10)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, 0, 1, options)


def test_a_receive_into_an_expanded_leaf_is_refused_naming_it_before_anything(lone_group):
    td = TensorDict(a=torch.zeros(3), b=torch.zeros(1).expand(3), batch_size=[3])
    with pytest.raises(ValueError, match="Cannot receive into 'b': it is expanded"):
        td.recv(group=lone_group, group_src=0)


def test_a_receive_into_a_read_only_memory_mapped_leaf_is_refused(tmp_path, lone_group):
    TensorDict(a=torch.zeros(3), batch_size=[3]).memmap(tmp_path / "save")
    loaded = TensorDict.load_memmap(tmp_path / "save", mode="r")
    assert isinstance(loaded["a"], MemoryMappedTensor)
    with pytest.raises(ReadOnlyError, match="a receive into 'a'"):
        loaded.irecv(group=lone_group, group_src=0)


def test_recv_consolidated_into_a_tensordict_that_is_not_is_refused(lone_group):
    with pytest.raises(ValueError, match="not consolidated: receive into the result of from_remote_init"):
        TensorDict(a=torch.zeros(3)).recv(group=lone_group, group_src=0, consolidated=True)


@pytest.mark.parametrize("call", [
    lambda td: td.send(), lambda td: td.recv(), lambda td: td.send(dst=1, group_dst=1, group=object()),
    lambda td: td.isend(group_dst=1), lambda td: td.irecv(src=0, group_src=0, group=object()),
])
def test_the_peer_is_one_of_a_global_rank_and_a_group_rank(call):
    with pytest.raises(ValueError, match="`(dst|src)`|`group_(dst|src)`"):
        call(TensorDict(a=torch.zeros(2)))


def test_a_peer_that_is_not_a_rank_is_a_type_error_naming_ucxx():
    with pytest.raises(TypeError, match="UCXX pipes are not built"):
        TensorDict(a=torch.zeros(2)).send("pipe")


def test_bucket_bytes_must_be_positive(lone_group):
    with pytest.raises(ValueError, match="bucket_bytes must be a positive number of bytes, got 0"):
        TensorDict(a=torch.zeros(2)).all_reduce(group=lone_group, bucket_bytes=0)


def test_tensorclasses_and_lazy_stacks_travel_with_their_class_and_members():
    received = run_ranks("tensorclass_transfers")[1]
    assert received["arrived"] == ["Step", [[1.0] * 3] * 2, "walk"]
    assert received["received"] == [[[5.0] * 3] * 2, "kept"]
    assert received["lazy"] == ["LazyStackedTensorDict", [["x"], ["x", "y"]], [1.0]]
    assert received["broadcast"] == ["Step", [[1.0] * 3] * 2, "walk"]


def test_the_readme_example_runs_in_two_processes(tmp_path):
    import os
    import re
    import socket
    import subprocess
    import sys

    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    section = readme[readme.index("### Between ranks of a torch.distributed group"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)[1]
    with socket.socket() as probe:  # a free port of 127.0.0.1 for the example's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = tmp_path / "example.py"
    script.write_text(code.replace("29512", str(port)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "2.0"


# ------------------------------------------------------------- the wire, in one process
def test_the_leaf_order_is_tensordicts_sorted_keys_and_members_in_turn():
    from shared_td import LazyStackedTensorDict
    from shared_td.containers.distributed_wire import wire_leaves

    td = TensorDict(b=torch.zeros(2), a=TensorDict(z=torch.zeros(2), y=torch.zeros(2), batch_size=[2]), s="text",
                    batch_size=[2])
    td["c"] = LazyStackedTensorDict(TensorDict(v=torch.zeros(1), u=torch.zeros(1)), TensorDict(v=torch.zeros(1)))
    assert [path for path, _ in wire_leaves(td)] == [("a", "y"), ("a", "z"), ("b",), ("c", "u"), ("c", "v"),
                                                      ("c", "v")]


def test_pseudo_random_tags_are_tensordicts_chain():
    pytest.importorskip("tensordict")
    from tensordict.utils import _int_generator

    from shared_td.containers.distributed_wire import wire_tags

    expected, tag = [], 6
    for _ in range(20):
        tag = _int_generator(tag + 1)
        expected.append(tag)
    tags = wire_tags(7, pseudo_rand=True)
    assert [next(tags) for _ in range(20)] == expected


def test_a_whole_tree_arrives_over_its_received_buffer_without_a_copy():
    from shared_td.containers.distributed_wire import tree_message, tree_of

    header, data, buffers = tree_message(TensorDict(a=torch.arange(4.0), s="x", batch_size=[4]))
    received = [buffer.clone() for buffer in buffers]  # as a receive fills fresh tensors
    tree = tree_of(data, received)
    assert tree["a"].tolist() == [0.0, 1.0, 2.0, 3.0] and tree["s"] == "x" and tree.is_consolidated()
    start = received[0].data_ptr()
    assert start <= tree["a"].data_ptr() < start + received[0].numel()


def test_scatter_gives_each_rank_its_tensordict_and_a_tensorclass_arrives_as_its_fields():
    results = run_ranks("scatter", world=3, argument=3)
    assert results[0] == {**results[0], "type": "TensorDict", "values": {"a": [0.0] * 3}, "s": "to 0"}
    assert results[1]["values"] == {"a": [1.0] * 3} and results[1]["s"] == "to 1"
    assert results[2] == {**results[2], "type": "TensorDict", "values": {"obs": [[2.0] * 3] * 2}, "s": "last"}
    for result in results:  # all_gather of a tensorclass: TensorDicts, as tensordict 0.15.3 gives them
        assert result["gathered"] == [["TensorDict", [[float(r)] * 3], str(r)] for r in range(3)]


def test_scatter_refuses_a_list_that_is_not_one_per_rank(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # (this process alone)
    try:
        with pytest.raises(ValueError, match=r"one tensordict per rank of the group on rank 0: 1, got 2 tensordicts"):
            TensorDict().scatter(src=0, tensordicts=[TensorDict(), TensorDict()])
    finally:
        dist.destroy_process_group()


def test_a_read_only_array_among_the_values_travels_without_torchs_warning():
    import warnings

    import numpy as np

    from shared_td import NonTensorData
    from shared_td.containers.distributed_wire import tree_message, tree_of

    array = np.arange(4.0)
    array.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (torch.from_numpy warns on a read-only array)
        header, data, buffers = tree_message(TensorDict(x=torch.ones(2), n=NonTensorData(array)))
        tree = tree_of(data, [buffer.clone() for buffer in buffers])
    assert tree["n"].tolist() == [0.0, 1.0, 2.0, 3.0] and tree["x"].tolist() == [1.0, 1.0]


def test_a_rank_that_cannot_send_its_tensordict_makes_the_others_raise_at_once_naming_it():
    results = run_ranks("senders_fail", world=3, argument=3)
    for rank, result in enumerate(results):
        outcomes = result["outcomes"]
        assert result["usable"] == 3.0, rank
        for operation, (kind, message, seconds) in outcomes.items():
            assert seconds < 10, (rank, operation, seconds)  # (not the group's timeout, 30 s)
            if operation == "init_remote" and rank == 2:
                assert kind is None  # (not a party to it)
        assert outcomes["init_remote"][:2] == (["TypeError", "cannot pickle '_thread.lock' object"] if rank == 0 else
                                               outcomes["init_remote"][:2])
        failing = {"init_remote": 0, "broadcast": 0, "scatter_list": 0, "scatter_pickle": 0, "all_gather": 1,
                   "gather_and_stack": 2}
        for operation, sender in failing.items():
            kind, message, _ = outcomes[operation]
            if operation == "init_remote" and rank == 2:
                continue
            if rank == sender:  # its own error, as it was
                expected = "ValueError" if operation == "scatter_list" else "TypeError"
                assert kind == expected, (rank, operation, kind, message)
            else:
                assert kind == "RuntimeError", (rank, operation, kind, message)
                assert message.startswith(f"rank {sender} could not send its tensordict, and raised there: "), message
                assert ".." not in message and message.endswith(". Nothing was received."), message
                reason = ("ValueError: scatter(src=0) needs one tensordict per rank" if operation == "scatter_list"
                          else "TypeError: cannot pickle '_thread.lock' object")
                assert reason in message, (operation, message)
        kind, message, _ = outcomes["wordless"]  # (an error whose message cannot be made still goes)
        assert (kind, message) == (("_WordlessError", "<exception str() failed>") if rank == 0 else (
            "RuntimeError", "rank 0 could not send its tensordict, and raised there: _WordlessError (its message "
            "could not be made). Nothing was received.")), (rank, kind, message)
        kind, message, _ = outcomes["pair"]  # (a rank of a subgroup named by its global rank too)
        if rank == 1:
            assert kind == "RuntimeError" and message.startswith(
                "rank 2 (rank 1 of the group) could not send its tensordict, and raised there: TypeError"), message
        elif rank == 2:
            assert kind == "TypeError", message


def test_a_leaf_gloo_cannot_reduce_is_named_after_the_posted_ones_are_waited_for():
    results = run_ranks("posting_fails")
    for result in results:
        kind, message = result["outcome"]
        assert kind == "ValueError" and "does not support RedOpType.MAX on complex tensors" in message
        assert "all_reduce of the leaf 'b' (torch.complex64, shape (3,)) could not be posted; " \
               "the 1 posted before it were waited for." in message
        assert result["a_reduced_when_raised"]
