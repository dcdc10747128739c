"""Containers: TensorDict, LazyStackedTensorDict, tensorclass and the non-tensor ones.

They hold keys, batch size, device, names and a lock flag; they know nothing of files.
"""

from shared_td.containers import node_kinds  # noqa: F401  (registers every class's NodeKind once)
from shared_td.containers import collate  # noqa: F401  (adds our classes to torch's default_collate)
from shared_td.containers import torch_serialization  # noqa: F401  (torch.load(weights_only=True) loads them)
