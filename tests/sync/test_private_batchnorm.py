"""Canary: the private torch base class ``sync/_batchnorm.py`` gives SyncBatchNorm is still torch's BatchNorm base.

Fails on the pinned torch if it moved; the package then warns once (``_batchnorm.LOST``) and
SyncBatchNorm extends BatchNorm2d instead.
"""
import warnings

import torch
from torch import nn

import torchbearer_dist
from torchbearer_dist import _once
from torchbearer_dist.sync import _batchnorm


def test_the_base_is_what_torch_batchnorms_and_its_syncbatchnorm_extend():
    _once._given.clear()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        base = _batchnorm.base()
    assert base is nn.modules.batchnorm._BatchNorm, 'torch.nn.modules.batchnorm._BatchNorm moved'
    for layer in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, torchbearer_dist.SyncBatchNorm):
        assert issubclass(layer, base), layer
    assert not isinstance(torchbearer_dist.SyncBatchNorm(3), (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))


def test_where_torch_moved_it_batchnorm2d_with_one_warning(monkeypatch):
    monkeypatch.delattr(nn.modules.batchnorm, '_BatchNorm')
    _once._given.discard(_batchnorm.LOST.format(torch.__version__))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        assert _batchnorm.base() is nn.BatchNorm2d and _batchnorm.base() is nn.BatchNorm2d
    lost = [w for w in caught if 'SyncBatchNorm extends BatchNorm2d instead' in str(w.message)]
    assert len(lost) == 1 and issubclass(lost[0].category, RuntimeWarning)
