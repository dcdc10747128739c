"""Commands of a test node (cluster_children.node_main) for striped transfers: a tree of
several dtypes whose leaves cross the stripes' boundaries, its bytes' digest, and the
groups a node holds with a peer."""
from __future__ import annotations

import hashlib

import torch

import shared_td
from shared_td.coordinator import cluster_replica


def dtypes_td(rows: int, fill: int):
    """Leaves of six dtypes (odd sizes: the payload is no multiple of a small stripe
    count), each byte depending on its position and ``fill``: a stripe received at the
    wrong place or not at all changes the digest."""
    td = shared_td.TensorDict(
        a=torch.zeros(rows, dtype=torch.float32),
        b=torch.zeros(rows, 2, dtype=torch.int64),
        c=torch.zeros(rows, 3, dtype=torch.uint8),
        d=torch.zeros(rows, dtype=torch.float16),
        e=torch.zeros(rows, dtype=torch.bool),
        nested=shared_td.TensorDict(f=torch.zeros(rows, dtype=torch.float64), batch_size=[rows]),
        batch_size=[rows],
    )
    _fill(td, fill)
    return td


def _fill(td, fill: int) -> None:
    for n, leaf in enumerate(td.values(True, True)):
        count = leaf.numel()
        pattern = (torch.arange(count, dtype=torch.int64) * (7 + n) + fill) % 251
        leaf.copy_((pattern % 2 if leaf.dtype == torch.bool else pattern).to(leaf.dtype).view(leaf.shape))


def _segment(cluster, name: str):
    entry = cluster._owned.get(name) or cluster._replicas[name]
    return entry.segment, entry.layout


def publish_dtypes(cluster, name: str, rows: int, fill: int):
    """Publish a dtypes_td; returns its payload's bytes and each leaf's byte span."""
    cluster.publish(name, dtypes_td(rows, fill))
    _segment_, layout = _segment(cluster, name)
    spans = []
    for leaf in layout["leaves"]:
        count = 1
        for size in leaf["shape"]:
            count *= size
        spans.append((leaf["offset"], leaf["offset"] + count * getattr(torch, leaf["dtype"]).itemsize))
    return layout["nbytes"], spans


def attach_dtypes(cluster, name: str) -> None:
    cluster.attach(name)


def fill_dtypes(cluster, name: str, fill: int) -> None:
    _fill(cluster.attach(name), fill)


def digest(cluster, name: str):
    """sha256 of the payload bytes of this node's ``name`` (owned or replica), the
    replica's version (None on the owner) and its segment's key."""
    segment, layout = _segment(cluster, name)
    data = cluster_replica.segment_bytes(segment, layout["nbytes"])
    version = None if name in cluster._owned else cluster_replica.replica_version(cluster._replicas[name].td)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest(), version, tuple(segment.key)


def stripes(cluster, peer: int):
    """(pair generation, stripes built) of this node's groups with ``peer``, or None."""
    return cluster._groups.stripes(peer)


COMMANDS = {"publish_dtypes": publish_dtypes, "attach_dtypes": attach_dtypes, "fill_dtypes": fill_dtypes, "digest": digest, "stripes": stripes}
