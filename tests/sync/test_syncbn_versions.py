"""SyncBatchNorm's constructor works on every claimed torch (CI's second configuration runs torch 2.13.0).

Its ``bias=`` keyword goes to torch's BatchNorm base, which takes it from torch 2.13 on (the floor).
"""
import torch
from torch import nn

import torchbearer_dist


def test_bias_false_and_true_match_plain_batchnorm_in_a_job_of_one():
    torch.manual_seed(0)
    x = torch.randn(6, 4, 3, 3)
    for bias in (True, False):
        ours, plain = torchbearer_dist.SyncBatchNorm(4, bias=bias), nn.BatchNorm2d(4, bias=bias)
        assert (ours.bias is None) == (not bias) and ours.weight is not None
        assert sorted(ours.state_dict()) == sorted(plain.state_dict())
        assert torch.allclose(ours(x), plain(x), atol=1e-6)
        converted = torchbearer_dist.convert_sync_batchnorm(nn.Sequential(nn.BatchNorm2d(4, bias=bias)))
        assert isinstance(converted[0], torchbearer_dist.SyncBatchNorm) and (converted[0].bias is None) == (not bias)
