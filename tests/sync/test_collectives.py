"""Small collectives (sync/collectives.py) on one process: outside a group, and in a real gloo world of one."""
import torch

from torchbearer_dist.sync import collectives

from _dist import world_of_one


def test_outside_a_group_rank_0_of_1_and_every_value_is_its_own():
    assert (collectives.rank(), collectives.world_size()) == (0, 1)
    assert collectives.reduce_int(5, 'sum') == 5
    assert collectives.any_rank(True) is True and collectives.any_rank(False) is False


def test_in_a_world_of_one_the_reductions_are_the_identity():
    with world_of_one():
        assert (collectives.rank(), collectives.world_size()) == (0, 1)
        assert collectives._max_and_min([3, -2, 0], torch.device('cpu')) == ([3, -2, 0], [3, -2, 0])
        assert collectives.reduce_int(4, 'min') == 4
        assert collectives.comm_device(torch.device('cpu')) == torch.device('cpu')


def test_metric_names_are_hashed_stably():
    assert collectives._hash('acc\nloss') == collectives._hash('acc\nloss') != collectives._hash('loss\nacc')
    assert 0 <= collectives._hash('x') < 2 ** 56  # fits an int64 tensor with room for its negation


def test_a_name_on_the_wire_is_cut_at_200_bytes_without_breaking_a_character():
    assert collectives._wire_text('a' * 300) == 'a' * 200
    assert collectives._wire_text('a' * 199 + 'é') == 'a' * 199 + '\ufffd'  # the 2-byte character cut in half
    assert collectives._wire_text('loss   ') == 'loss'
