"""DataLoader workers read a memory-mapped dataset without copying it.

The dataset is a TensorDict saved with ``memmap_`` into a directory. Each DataLoader
worker (started with spawn here, the strictest start method) receives the dataset by
reference: its MemoryMappedTensors re-map the same files, so memory does not grow with
the number of workers. Workers also write a per-sample result in place, which the main
process sees.

Run:  python examples/dataloader_workers.py
"""
from __future__ import annotations

import tempfile

import torch
from torch.utils.data import DataLoader, Dataset

from shared_td import TensorDict

SAMPLES = 256


class MemmapDataset(Dataset):
    """Items are rows of a memory-mapped TensorDict (views of the mapped files)."""

    def __init__(self, data: TensorDict):
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> TensorDict:
        row = self.data[index]
        row["seen"].fill_(1)  # written in place, into the shared file
        return row.exclude("seen").to_dict()


def main() -> None:
    with tempfile.TemporaryDirectory() as directory:
        data = TensorDict(
            {
                "image": torch.randn(SAMPLES, 3, 8, 8),
                "label": torch.arange(SAMPLES) % 10,
                "seen": torch.zeros(SAMPLES, dtype=torch.bool),
            },
            batch_size=[SAMPLES],
        ).memmap_(directory)
        loader = DataLoader(
            MemmapDataset(data), batch_size=32, num_workers=2,
            multiprocessing_context="spawn", shuffle=True,
        )
        total = sum(int(batch["label"].sum()) for batch in loader)
        assert total == int(data["label"].sum()), "a batch went missing"
        assert bool(data["seen"].all()), "a worker's write did not reach the files"
        print(f"2 spawn workers read {SAMPLES} samples from {directory} by reference;")
        print(f"every sample was marked seen in the shared files: {bool(data['seen'].all())}")


if __name__ == "__main__":
    main()
