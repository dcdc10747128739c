"""A mapping that fails leaves nothing open and says why (session-17 audit).

torch.from_file leaves open the descriptor it opens when its mmap fails: for a memfd
that descriptor keeps the whole segment reserved until the process exits. The limits
are real ones, set in one child process (RLIMIT_AS just above what it uses, then
RLIMIT_NOFILE with every descriptor below it taken), which counts its own descriptors.
"""

import errno
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch

from shared_td.storage import anonymous, fd_mapping
from shared_td.storage.anonymous import Segment, SegmentUnavailableError

pytestmark = pytest.mark.timeout(60)

BIG = 64 * 2**20

# argv: a pickled Segment of the parent (hex), a 64 MiB file. Prints one JSON object:
# scenario -> {"type", "errno", "message", "left"} (left: descriptors it left open).
CHILD = r"""
import gc, json, os, pickle, resource, sys, torch
import shared_td
from shared_td import TensorDict
from shared_td.memmap_tensor import MemoryMappedTensor
from shared_td.storage.anonymous import Segment
from shared_td.storage.fd_mapping import map_fd

BIG = 64 * 2**20
peer, path = bytes.fromhex(sys.argv[1]), sys.argv[2]
big = torch.zeros(BIG, dtype=torch.uint8)
out = {}

def fds():
    gc.collect()
    return set(os.listdir("/proc/self/fd"))

def attempt(name, call):
    try:
        call()
        out[name] = {"type": None}
    except Exception as err:
        out[name] = {"type": type(err).__name__, "errno": getattr(err, "errno", None), "message": str(err),
                     "runtime": isinstance(err, RuntimeError)}

def run(name, call):
    before = fds()
    attempt(name, call)
    out[name]["left"] = sorted(fds() - before, key=int)

def vm():
    return int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024

unlimited = resource.getrlimit(resource.RLIMIT_AS)
resource.setrlimit(resource.RLIMIT_AS, (vm() + 32 * 2**20, unlimited[1]))
run("segment", lambda: Segment.create(BIG))
run("memmap_", lambda: TensorDict(a=big).memmap_())
run("file", lambda: MemoryMappedTensor.from_filename(path, torch.uint8, (BIG,)))
run("file_r", lambda: MemoryMappedTensor.from_filename(path, torch.uint8, (BIG,), mode="r"))
resource.setrlimit(resource.RLIMIT_AS, unlimited)

memfd = os.memfd_create("audit17", os.MFD_CLOEXEC); os.ftruncate(memfd, 4096)
nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
taken = fds()
resource.setrlimit(resource.RLIMIT_NOFILE, (max(map(int, taken)) + 4, nofile[1]))
hog = []
try:
    while True:
        hog.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
attempt("attach_emfile", lambda: pickle.loads(peer))
attempt("map_emfile", lambda: map_fd(memfd, 4096, what="the example memfd"))
for fd in hog:
    os.close(fd)
resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
out["attach_emfile"]["left"] = out["map_emfile"]["left"] = sorted(fds() - taken, key=int)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """The child's findings (one process for every scenario: each start costs ~1 s)."""
    path = str(tmp_path_factory.mktemp("audit17") / "big.bin")
    with open(path, "wb") as f:
        f.truncate(BIG)  # sparse: no byte written
    segment = Segment.create(64)
    result = subprocess.run([sys.executable, "-c", CHILD, pickle.dumps(segment).hex(), path],
                            capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1]), path


@pytest.mark.parametrize("scenario", ["segment", "memmap_", "file", "file_r"])
def test_failed_mapping_leaves_nothing_open_and_names_the_limits(child, scenario):
    found, path = child
    seen = found[scenario]
    assert seen["left"] == []  # before the fix: torch's descriptor on the memfd/file stays
    assert seen["type"] == "MappingError" and seen["runtime"] and seen["errno"] == errno.ENOMEM, seen
    message = seen["message"]
    assert f"{BIG} bytes (64.0 MiB)" in message
    assert "RLIMIT_AS soft/hard = " in message and "/unlimited (in use: " in message and "vm.max_map_count" in message
    if scenario.startswith("file"):
        assert path in message
    else:
        assert "anonymous shared-memory segment (inode " in message
    private = scenario == "file_r"  # mode="r": a private copy-on-write mapping
    assert ("RLIMIT_DATA soft/hard = " in message and "vm.overcommit_memory" in message) == private


def test_attach_out_of_descriptors_blames_this_process(child):
    seen = child[0]["attach_emfile"]
    # before the fix: SegmentUnavailableError "sent by process N is gone (Too many open
    # files): that process has exited", and attach tried again
    assert seen["type"] == "MappingError" and seen["runtime"] and seen["errno"] == errno.EMFILE, seen
    assert "This process is out of file descriptors (RLIMIT_NOFILE soft/hard = " in seen["message"]
    assert "has exited" not in seen["message"]
    assert seen["left"] == []


def test_map_out_of_descriptors_names_the_file_and_the_limit(child):
    seen = child[0]["map_emfile"]
    assert seen["type"] == "MappingError" and seen["runtime"] and seen["errno"] == errno.EMFILE, seen
    assert seen["message"].startswith("[Errno 24] Cannot open the example memfd: Too many open files. "
                                      "This process is out of file descriptors (RLIMIT_NOFILE soft/hard = ")


def test_a_gone_sender_is_still_segment_unavailable():
    segment = Segment.create(64)
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                            capture_output=True, text=True, timeout=20)
    with pytest.raises(SegmentUnavailableError, match="has exited"):
        # (another inode than the segment's: this process's own copy is not reused)
        anonymous._attach(int(exited.stdout), segment.fd, (segment.key[0], -1), segment.nbytes)


def _map_fd_refused_by_torch(monkeypatch, message: str) -> OSError:
    """The error of ``map_fd`` of an 8-byte memfd when torch.from_file raises
    RuntimeError(``message``) (what the trial mapping cannot foresee)."""
    def refuse(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(torch, "from_file", refuse)
    fd = os.memfd_create("audit17", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, 8)
        with pytest.raises(OSError) as info:
            fd_mapping.map_fd(fd, 8)
        return info.value
    finally:
        os.close(fd)


def test_torch_mmap_failure_after_the_trial_is_the_same_error(monkeypatch):
    """The race the trial mapping leaves (another thread takes the address space
    between it and torch's mmap) still raises the clear error."""
    error = _map_fd_refused_by_torch(
        monkeypatch, "unable to mmap 8 bytes from file </proc/self/fd/3>: Cannot allocate memory (12)")
    assert re.search(r"Cannot map 8 bytes \(0.0 MiB\) of the file /memfd:audit17", str(error))
    assert error.errno == errno.ENOMEM and "vm.max_map_count" in str(error)


def test_torch_error_with_a_cpp_stack_trace_after_its_errno_is_still_read(monkeypatch):
    """With TORCH_SHOW_CPP_STACKTRACES=1 torch's message goes on after "(13)": the errno
    was looked for at its end only, so a read-only save's EACCES (which the loader turns
    into a copy-on-write mapping) came out as torch's RuntimeError and the load failed."""
    error = _map_fd_refused_by_torch(
        monkeypatch, "unable to open file </proc/self/fd/3> in read-write mode: Permission denied (13)"
                     "[W1205 symbolizing C++ stack trace for exception]\nframe #0: c10::Error (0x1 in x.so)")
    assert re.search(r"Cannot open the file /memfd:audit17", str(error))
    assert error.errno == errno.EACCES
