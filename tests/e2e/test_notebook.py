"""The README's example in a real Jupyter kernel: train defined in one cell, launched from the next.

A spawned rank cannot import a function of a notebook; launch() forks it instead. Runs a real
ipykernel through nbclient, and skips where they are not installed (the ``test`` extra has them).
"""
import os
import re

import pytest

nbclient = pytest.importorskip('nbclient', reason='needs nbclient and ipykernel (pip install -e .[test])')
nbformat = pytest.importorskip('nbformat')
pytest.importorskip('ipykernel')

from _dist import ROOT  # noqa: E402

pytestmark = pytest.mark.slow

#: Seconds the kernel may take for one cell on a busy 2-core machine.
CELL_TIMEOUT = 150


def _readme_train():
    """The README's ``train`` function, as a user pastes it into a cell."""
    with open(os.path.join(ROOT, 'README.rst')) as f:
        readme = f.read()
    block = readme.split('.. code-block:: python', 1)[1].split("if __name__ == '__main__':", 1)[0]
    return '\n'.join(line[4:] for line in block.splitlines())


def test_a_function_defined_in_a_notebook_cell_trains_on_two_ranks(tmp_path):
    cells = [nbformat.v4.new_code_cell(_readme_train()),
             nbformat.v4.new_code_cell("results = tbd.launch(train, world_size=2)\n"
                                       "print('rank results', [round(r['loss'], 6) for r in results])")]
    notebook = nbformat.v4.new_notebook(cells=cells)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT, kernel_name='python3',
                                     resources={'metadata': {'path': str(tmp_path)}})
    client.execute()  # raises CellExecutionError with the cell's traceback on any error
    text = ''.join(output.get('text', '') for output in notebook.cells[1].outputs)
    losses = re.search(r'rank results \[([\d.]+), ([\d.]+)\]', text)
    assert losses is not None, text
    assert losses.group(1) == losses.group(2)  # the same global metrics on both ranks
