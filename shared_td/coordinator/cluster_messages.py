"""The signed messages of a node pair: a push's header and the answer to a push or a sync.

gloo is unauthenticated, so what a node acts on from a gloo connection is signed with
the cluster authkey like a store value
(:class:`~shared_td.coordinator.cluster_store.SignedStore`), for one *context*: an
answer for that request of that node only (:func:`answer_context`: its tag, both nodes
and the pair generation are in the signed text, so an answer recorded earlier does not
pass for another, not even one of a restarted node's tags), a push
header for one pair generation and direction (:func:`push_context`; its ``seq`` orders
the pushes of that generation). A message is a 4-byte length, then the signed bytes,
zeros up to a fixed size (:func:`encode_signed`: every message fills its receive
exactly, see :mod:`~shared_td.coordinator.cluster_transfer`), and its length and
signature are checked before a byte of it is parsed (:func:`decode_signed`).
"""
from __future__ import annotations

import hashlib
import json

import torch

from shared_td.errors import ClusterAuthError

__all__ = ["ANSWER_BYTES", "LENGTH_BYTES", "answer_context", "decode_signed", "encode_signed", "push_context"]

#: Bytes of the buffer an answer is received into: a 4-byte length, then the signed answer
#: (an error text too long for it is cut).
ANSWER_BYTES = 1024
#: Bytes of a message's length, in front of its signed bytes.
LENGTH_BYTES = 4


def answer_context(node: int, requester: int, generation: int, tag: int) -> str:
    """What an answer is signed for: node ``node``'s answer to request ``tag`` of node
    ``requester``, over their pair of ``generation``. The pair generation binds it to
    the requester's process: tags start again in a restarted node, which moves each of
    its pairs to a new generation first, so an answer recorded for its predecessor's
    request of the same tag does not pass for its own."""
    return f"answer/{node}/{requester}/{generation}/{tag}"


def push_context(sender: int, receiver: int, generation: int) -> str:
    """What a push header is signed for: from ``sender`` to ``receiver`` on that pair
    generation (its ``seq`` orders the pushes of that generation: no replay passes)."""
    return f"push/{sender}/{receiver}/{generation}"


def encode_signed(store, context: str, value: dict, limit: int = ANSWER_BYTES,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``value`` as JSON signed for ``context`` with ``store``'s authkey (a
    :class:`~shared_td.coordinator.cluster_store.SignedStore`): a 4-byte length, then the
    signed bytes, zeros up to ``limit`` bytes (a long ``error`` text is cut; ValueError
    for anything else that does not fit), written into the first ``limit`` bytes of
    ``out`` (a contiguous uint8 tensor: a push's header goes straight into its message)
    and returned, or into a new tensor."""
    room = limit - LENGTH_BYTES - hashlib.sha256().digest_size
    payload = json.dumps(value).encode()
    if len(payload) > room and "error" in value:  # cut (json takes <= 6 bytes a character)
        payload = json.dumps(dict(value, error=value["error"][: max(0, room - 64) // 6])).encode()
    if len(payload) > room:
        raise ValueError(f"a signed message of {len(payload)} bytes does not fit in {limit}")
    blob = store.sign(context, payload)
    end = LENGTH_BYTES + len(blob)
    if out is None:
        message = bytearray(limit)  # always ``limit`` bytes: see the module's opening
        message[:end] = len(blob).to_bytes(LENGTH_BYTES, "little") + blob
        return torch.frombuffer(message, dtype=torch.uint8)
    data = memoryview(out.numpy())
    data[:end] = len(blob).to_bytes(LENGTH_BYTES, "little") + blob
    data[end:limit] = bytes(limit - end)  # zeros: never what this memory held before
    return out[:limit]


def decode_signed(store, context: str, buffer: torch.Tensor) -> dict:
    """The value :func:`encode_signed` wrote at the start of ``buffer`` for ``context``;
    ClusterAuthError if it is not signed with ``store``'s authkey for ``context`` (its
    length and its signature are checked before any byte is parsed)."""
    data = memoryview(buffer.numpy())
    length = int.from_bytes(data[:LENGTH_BYTES], "little")
    if not 0 < length <= len(data) - LENGTH_BYTES:
        raise ClusterAuthError(f"A message for {context!r} has an impossible length ({length}): something else "
                               "writes to the cluster's gloo connections. Nothing of it was used.")
    return json.loads(store.check(context, bytes(data[LENGTH_BYTES: LENGTH_BYTES + length])))
