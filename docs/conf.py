"""Sphinx configuration; build with ``sphinx-build -n -W -b html docs docs/_build/html``."""
import os
import sys

sys.path.insert(0, os.path.abspath('..'))

import torchbearer_dist  # noqa: E402

project = 'torchbearer_dist'
author = 'the torchbearer_dist authors'
copyright = '2025, ' + author
version = release = torchbearer_dist.__version__

extensions = [
    'sphinx.ext.autodoc',
    'sphinx.ext.doctest',
    'sphinx.ext.intersphinx',
    'sphinx.ext.napoleon',
    'sphinx.ext.viewcode',
    'sphinx_copybutton',
]

autodoc_member_order = 'bysource'
autodoc_typehints = 'none'
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # a dataclass's Attributes: section would otherwise repeat its fields

# Links to the Python and PyTorch references need their inventories from the web. The build must
# pass offline with -W, so they are fetched only when TORCHBEARER_DIST_DOCS_ONLINE=1.
intersphinx_mapping = {}
if os.environ.get('TORCHBEARER_DIST_DOCS_ONLINE') == '1':
    intersphinx_mapping = {
        'python': ('https://docs.python.org/3', None),
        'torch': ('https://pytorch.org/docs/stable', None),
    }

templates_path = []
exclude_patterns = ['_build']
# furo: maintained, readable at laptop widths, code blocks scroll inside their box.
html_theme = 'furo'
html_title = 'torchbearer_dist ' + release
html_static_path = []
# The copy button copies a command without its "$ " prompt, and leaves out the output lines after it.
copybutton_prompt_text = r'\$ '
copybutton_prompt_is_regexp = True
