"""Torch-only engines: collectives, gradient buckets, compression, gathering and SyncBatchNorm.

Nothing here imports torchbearer: each engine works on plain tensors and modules inside a
``torch.distributed`` process group, and can be unit-tested without a Trial.
"""
