"""Who is refused at a quorum of new membership (torchbearer_dist.ft._vote.decide): the pure decision, on tables
of rows as the all-reduce leaves them. The processes that compute them are tested in test_misconfiguration.py."""
from torchbearer_dist.ft import _vote

CONFIG = {'replica_id': 'r0', 'shards': 3, 'batch_size': 32, 'local_steps': None,
          'versions': 'torchbearer_dist 0.1.0, torch 2.14.1'}
MODEL, OPTIMIZERS = {'state[model]': {'0.weight': ((4, 2), 'torch.float32')}}, ['SGD of [2] parameters']


def _row(replica_id='r0', trained=False, model=MODEL, **config):
    return _vote.row(dict(CONFIG, replica_id=replica_id, **config), trained, model, OPTIMIZERS)


def test_replicas_that_agree_are_all_let_in():
    assert _vote.decide([_row('r0'), _row('r1'), _row('r2')], 'r0') == {}


def test_the_replicas_training_set_the_reference_even_when_fewer():
    rows = [_row('r0', trained=True, shards=2), _row('r1'), _row('r2')]
    assert _vote.decide(rows, 'r1') == {
        1: "this replica cannot join: its shard count (the DistributedSampler's num_replicas, the example's --replicas)"
           ' is 3 here and 2 at the replicas training; start every replica with the same shard count',
        2: "this replica cannot join: its shard count (the DistributedSampler's num_replicas, the example's --replicas)"
           ' is 3 here and 2 at the replicas training; start every replica with the same shard count'}


def test_where_none_trained_the_majority_sets_it_whoever_came_first():
    odd = {'state[model]': {'0.weight': ((8, 2), 'torch.float32')}}
    for position in range(3):
        rows = [_row('r{}'.format(r), model=odd if r == position else MODEL) for r in range(3)]
        assert list(_vote.decide(rows, 'r')) == [position]
        assert _vote.decide(rows, 'r')[position] == (
            "this replica cannot join: its model (the names, shapes and dtypes of the modules' tensors) differs from "
            'those at 2 of the 3 replicas starting; start every replica with the same model')


def test_a_tie_goes_to_the_lowest_ranks_configuration():
    assert list(_vote.decide([_row('r0', batch_size=16), _row('r1')], 'r')) == [1]
    assert list(_vote.decide([_row('r0'), _row('r1', batch_size=16)], 'r')) == [1]


def test_of_two_replicas_of_one_name_the_one_that_trained_keeps_it():
    rows = [_row('r1'), _row('r0', trained=True), _row('r1', trained=True)]
    assert _vote.decide(rows, 'r1') == {
        0: "this replica cannot join: its replica_id 'r1' is the name of another live replica, which trains; stop the "
           'other process of that name (a requeue while the old job still runs?) or pass another replica_id'}
    assert list(_vote.decide([_row('r1'), _row('r1')], 'r1')) == [1]  # none trained: the lower rank keeps it


def test_a_value_not_set_reads_none():
    rows = [_row('r0', trained=True), _row('r1', local_steps=16)]
    assert _vote.decide(rows, 'r1')[1] == (
        "this replica cannot join: its local_steps (DiLoCo's; None: averaging at every step) is 16 here and None at "
        'the replicas training; start every replica with the same local_steps')


def test_a_hash_is_the_same_in_every_process():
    assert _vote._hash('r0') == int.from_bytes(__import__('hashlib').sha256(b"'r0'").digest()[:7], 'big')
