"""MemoryMappedTensor across real processes: the child writes, the parent sees the write.

Every route a tensor takes to another process is covered -- Process arguments (fork,
spawn, forkserver), torch.multiprocessing queues, multiprocess (dill), DataLoader workers
and plain pickle bytes -- for file-backed and anonymous tensors, whole and as views.
"""

import multiprocessing
import pickle

import multiprocess
import pytest
import torch
import torch.multiprocessing

# The child targets are in a sibling module, importable by name (tests/conftest.py).
from tests import mp_children_memmap as children

from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.storage.anonymous import SegmentUnavailableError

JOIN_TIMEOUT = 50


def make_tensors(tmp_path):
    """A file-backed and an anonymous (6, 4) tensor of zeros."""
    return [
        MemoryMappedTensor.zeros(6, 4, filename=tmp_path / "rows.memmap"),
        MemoryMappedTensor.zeros(6, 4),
    ]


def pieces_of(tensor):
    """Views of rows 0, 2, 3, 4 and 5 made five different ways; row 1 is left alone."""
    return [
        tensor[0],
        tensor[1:3][1],  # a view of a view: row 2
        tensor.split(1)[3],  # row 3, shape (1, 4)
        tensor.chunk(3)[2][0],  # row 4
        tensor.unbind(0)[5],  # row 5
    ]


VALUES = [10.0, 12.0, 13.0, 14.0, 15.0]


def expected_rows():
    expected = torch.zeros(6, 4)
    for row, value in zip([0, 2, 3, 4, 5], VALUES):
        expected[row] = value
    return expected


def run_child(context, target, args):
    process = context.Process(target=target, args=args)
    process.start()
    process.join(JOIN_TIMEOUT)
    if process.is_alive():
        process.kill()
        pytest.fail("child process hung")
    assert process.exitcode == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_process_args_views_and_whole(tmp_path, method):
    tensors = make_tensors(tmp_path)
    whole = [
        MemoryMappedTensor.zeros(3, filename=tmp_path / "whole.memmap"),
        MemoryMappedTensor.zeros(3),
    ]
    pieces = [p for t in tensors for p in pieces_of(t)] + whole
    values = VALUES * 2 + [7.0, 8.0]
    run_child(multiprocessing.get_context(method), children.fill_pieces, (pieces, values))
    for tensor in tensors:
        torch.testing.assert_close(tensor.as_subclass(torch.Tensor), expected_rows())
    assert whole[0].tolist() == [7.0] * 3
    assert whole[1].tolist() == [8.0] * 3
    # the file itself holds the child's writes, not only the parent's mapping
    on_disk = torch.from_file(str(tmp_path / "rows.memmap"), size=24, dtype=torch.float32)
    torch.testing.assert_close(on_disk.view(6, 4), expected_rows())


@pytest.mark.timeout(60)
def test_process_args_forkserver(tmp_path):
    tensors = make_tensors(tmp_path)
    pieces = [tensors[0], tensors[1][1:3][1]]
    run_child(multiprocessing.get_context("forkserver"), children.fill_pieces,
              (pieces, [5.0, 6.0]))
    assert tensors[0].eq(5.0).all()
    assert tensors[1][2].eq(6.0).all() and tensors[1].sum() == 6.0 * 4


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_torch_multiprocessing_queue(tmp_path, method):
    context = torch.multiprocessing.get_context(method)
    queue, done = context.Queue(), context.Queue()
    tensors = make_tensors(tmp_path)
    process = context.Process(target=children.fill_from_queue, args=(queue, done))
    process.start()
    queue.put(([p for t in tensors for p in pieces_of(t)], VALUES * 2))
    assert done.get(timeout=JOIN_TIMEOUT) == "ok"
    process.join(JOIN_TIMEOUT)
    assert process.exitcode == 0
    for tensor in tensors:
        torch.testing.assert_close(tensor.as_subclass(torch.Tensor), expected_rows())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_multiprocess_dill_process(tmp_path, method):
    tensors = make_tensors(tmp_path)
    pieces = [p for t in tensors for p in pieces_of(t)]
    run_child(multiprocess.get_context(method), children.fill_pieces, (pieces, VALUES * 2))
    for tensor in tensors:
        torch.testing.assert_close(tensor.as_subclass(torch.Tensor), expected_rows())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_dataloader_workers_write_and_return_views(tmp_path, method):
    anonymous = MemoryMappedTensor.zeros(6, 2)
    on_file = MemoryMappedTensor.zeros(6, 2, filename=tmp_path / "data.memmap")
    loader = torch.utils.data.DataLoader(
        children.WritingDataset(anonymous, on_file),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=method,
    )
    items = list(loader)
    assert len(items) == 6
    for index, (anonymous_row, file_row) in enumerate(items):
        for row, parent in [(anonymous_row, anonymous), (file_row, on_file)]:
            # the worker's view came back by reference: the parent's own memory
            assert isinstance(row, MemoryMappedTensor)
            assert row.data_ptr() == parent[index].data_ptr()
            assert row.tolist() == [index + 1.0] * 2
    expected = torch.arange(1.0, 7.0).unsqueeze(1).expand(6, 2)
    torch.testing.assert_close(anonymous.as_subclass(torch.Tensor), expected)
    torch.testing.assert_close(on_file.as_subclass(torch.Tensor), expected)


@pytest.mark.timeout(60)
def test_plain_pickle_bytes_to_spawned_child():
    tensor = MemoryMappedTensor.zeros(5)
    blob = pickle.dumps(tensor[1:4][1])  # element 2
    run_child(multiprocessing.get_context("spawn"), children.fill_pickled, (blob, 9.0))
    assert tensor.tolist() == [0.0, 0.0, 9.0, 0.0, 0.0]


@pytest.mark.timeout(60)
def test_anonymous_pickle_from_exited_sender_is_a_clear_error():
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=children.send_anonymous_pickle, args=(sender,))
    process.start()
    sender.close()
    blob = receiver.recv_bytes()
    process.join(JOIN_TIMEOUT)
    assert process.exitcode == 0
    with pytest.raises(SegmentUnavailableError, match=f"process {process.pid}"):
        pickle.loads(blob)


@pytest.mark.timeout(60)
def test_file_backed_pickle_outlives_sender(tmp_path):
    # unlike anonymous memory, a file-backed tensor only needs the file
    path = tmp_path / "kept.memmap"
    context = multiprocessing.get_context("fork")
    run_child(context, _create_file_tensor, (str(path),))
    tensor = MemoryMappedTensor.from_filename(path, torch.float32, (4,))
    assert tensor.tolist() == [3.0] * 4


def _create_file_tensor(path):
    MemoryMappedTensor.full(4, fill_value=3.0, filename=path)
