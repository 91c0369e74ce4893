"""Each mutant of the fault-tolerant mode's exact semantics must fail its test in tests/ft/test_membership_semantics.py.

Run from the repository root: ``python tests/scripts/ft_semantics_mutants.py [NAME ...]``. The package is never
changed: each mutant is planted by tests/ft/_membership_replica.py itself, in every replica process, when
``TBD_MUTANT`` names it (``MUTANTS`` there, by monkeypatching). The tests run first unchanged, then once per
mutant (one pytest at a time, the tests of its scenario only), and each line says which tests failed and why;
the exit status is 1 when a mutant leaves a test it must fail passing, no longer applies, or when the unchanged
tests fail. About five minutes on a loaded two-core machine (five pytest runs of three or one replicas).

The first three passed every test before issue 42: gradients averaged over the configured replicas instead of
the live ones, epoch figures averaged without the replicas' samples as weights, optimizers stepped where torchft
did not commit. The fourth waits one timeout for a quorum where the message says three. The fifth takes the steps'
quorum at once (torchft's synchronous quorum), where a replica that joins counts in its first step. The sixth
drops the failure of a sum started on torchft's process group (a replica lost during it) instead of recording it
with the Manager, which then commits a step that holds part of the replicas' gradients.
"""
import os
import re
import subprocess
import sys

TESTS = 'tests/ft/test_membership_semantics.py'
SCENARIO = 'not alone and not joins'  # the three replicas, one lost: one run serves (a), (b) and (c)
ALONE = 'alone_a_replica_waits_for_a_quorum'  # (d)
JOINS = 'joins'  # (e): a third replica joins two

A = 'test_a_step_while_one_of_three_is_lost_is_one_process_at_the_live_replicas_batch'
B = 'test_epoch_figures_are_the_live_replicas_weighted_by_their_samples'
C = 'test_the_step_in_flight_at_the_loss_is_dropped_and_the_next_one_is_the_reference'
D = 'test_alone_a_replica_waits_for_a_quorum_as_long_as_its_message_says'
E = 'test_a_replica_that_joins_counts_for_nothing_in_its_first_step_and_for_one_from_its_second'

#: name: (the tests run, as pytest's -k; the tests it must fail)
MUTANTS = {
    'configured_count': (SCENARIO, [A, C]),
    'unweighted_metrics': (SCENARIO, [B]),
    'step_uncommitted': (SCENARIO, [C]),
    'quorum_wait': (ALONE, [D]),
    'synchronous_quorum': (JOINS, [E]),
    'unreported_failure': (SCENARIO, [C]),
}


def _run(root, select, mutant=None):
    """The tests that failed (not errored: a setup error is no kill), each with the start of its message, and
    pytest's output."""
    env = dict(os.environ, COLUMNS='240')  # pytest's summary line of each failure holds the start of its message
    env.pop('TBD_MUTANT', None)
    if mutant:
        env['TBD_MUTANT'] = mutant
    out = subprocess.run([sys.executable, '-m', 'pytest', TESTS, '-n', '0', '-p', 'no:cacheprovider', '-q', '-rfE',
                          '-k', select], cwd=root, env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r'^FAILED \S+::(\w+)(?: - (.*))?$', out, re.M)), out


def _applies(root, mutant):
    """Whether the mutant can still be planted (what it patches still exists), in a process of its own."""
    code = 'import sys; sys.path[:0] = ["tests/ft"]; import _membership_replica as m; m.MUTANTS[{!r}](3)'.format(mutant)
    return subprocess.run([sys.executable, '-c', code], cwd=root, capture_output=True).returncode == 0


def main(names):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    unknown = [name for name in names if name not in MUTANTS]
    if unknown:
        print('unknown mutants {}; known: {}'.format(unknown, ', '.join(MUTANTS)))
        return 2
    failed, out = _run(root, '')
    if failed or ' passed' not in out or ' error' in out:
        print(out)
        print('the unchanged tests fail: {}'.format(failed))
        return 1
    print('{:20} all pass'.format('(none)'), flush=True)
    survivors = []
    for name in names or MUTANTS:
        select, expected = MUTANTS[name]
        if not _applies(root, name):
            print('{:20} NO LONGER APPLIES: update it in tests/ft/_membership_replica.py'.format(name), flush=True)
            survivors.append(name)
            continue
        failed, out = _run(root, select, name)
        missed = [test for test in expected if test not in failed]
        print('{:20} {}'.format(name, 'SURVIVED' if not failed else 'NOT FAILED: {}'.format(', '.join(missed))
                                if missed else 'killed'), flush=True)
        for test, message in sorted(failed.items()):
            print('    {}: {}'.format(test, message[:150]), flush=True)
        if missed:
            survivors.append(name)
    return 1 if survivors else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
