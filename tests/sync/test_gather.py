"""Gathering variable-length rows (sync/gather.py) on one process: the header, the order and the
deduplication; the padding across ranks runs in tests/callbacks/test_output.py."""
import pytest
import torch

from torchbearer_dist.sync.gather import _DTYPES, _MAX_DIMS, _header, all_gather_rows, gather_predictions

from _dist import world_of_one


def test_header_holds_rows_dims_dtype_and_the_other_dimensions():
    header = _header(torch.zeros(5, 3, 2, dtype=torch.float64))
    assert header == [5, 3, _DTYPES.index(torch.float64), 3, 2] + [0] * (_MAX_DIMS - 2)
    assert len(_header(None)) == len(header)  # every rank sends a header of one length
    assert _header(None)[:3] == [0, -1, -1]


@pytest.mark.parametrize('tensor', [torch.tensor(1.0), torch.zeros([1] * (_MAX_DIMS + 1)),
                                    torch.zeros(2, dtype=torch.float8_e4m3fn)], ids=['0-d', 'too many dims', 'fp8'])
def test_an_ungatherable_tensor_is_refused_before_any_collective(tensor):
    with pytest.raises(ValueError, match=r'can only gather tensors of 1 to 8 dimensions and a dtype among'):
        all_gather_rows(tensor)


@pytest.mark.parametrize('grouped', [False, True], ids=['no group', 'world of one'])
def test_one_rank_gets_its_own_rows_back(grouped):
    rows = torch.randn(4, 3)
    if grouped:
        with world_of_one():
            gathered, counts = all_gather_rows(rows)
    else:
        gathered, counts = all_gather_rows(rows)
    assert gathered is rows and counts == [4]


def test_predictions_come_back_in_dataset_order_each_sample_once():
    predictions = torch.tensor([[30.], [10.], [20.], [10.]])
    indices = [3, 1, 2, 1, 99]  # a padding sampler repeats sample 1; the extra index is cut off
    assert gather_predictions(predictions, indices).flatten().tolist() == [10., 20., 30.]


def test_more_predictions_than_indices_is_refused():
    with pytest.raises(ValueError, match=r'3 predictions but only 2 sample indices'):
        gather_predictions(torch.zeros(3, 1), [0, 1])


def test_no_predictions_gives_none():
    assert gather_predictions(None, []) is None
