"""Containers: TensorDict, LazyStackedTensorDict, tensorclass and the non-tensor ones.

They hold keys, batch size, device, names and a lock flag; they know nothing of files.
"""
