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

# Links to the Python, PyTorch and torchbearer references need their inventories from the web. The
# build must pass offline with -n -W, so they are fetched only when TORCHBEARER_DIST_DOCS_ONLINE=1;
# offline, references into those projects are left as plain text, and -n checks only our own.
intersphinx_mapping = {}
nitpick_ignore_regex = [(r'py:.*', r'(torch|torchbearer|datetime|callable)(\..*)?')]
if os.environ.get('TORCHBEARER_DIST_DOCS_ONLINE') == '1':
    intersphinx_mapping = {
        'python': ('https://docs.python.org/3', None),
        'torch': ('https://pytorch.org/docs/stable', None),
        'torchbearer': ('https://torchbearer.readthedocs.io/en/latest', None),
    }
    nitpick_ignore_regex = []
# The reference documents public names only (torchbearer_dist.__all__). A docstring that names an
# internal (torchbearer_dist.sync.buckets.GradientBuckets) renders it as plain text; a public name
# given by its defining module still links, through _reexported below.
nitpick_ignore_regex.append((r'py:.*', r'torchbearer_dist\.(callbacks|checkpoint|runtime|sync)\..*'))


def _reexported(app, env, node, contnode):
    """Resolve ``torchbearer_dist.<module>.<name>`` to ``torchbearer_dist.<name>`` where only that is documented.

    Docstrings name objects where they are defined (``torchbearer_dist.runtime.env.resolve``); the API
    reference documents them where users import them from (``torchbearer_dist.resolve``).
    """
    target = node.get('reftarget', '')
    if node.get('refdomain') != 'py' or not target.startswith('torchbearer_dist.'):
        return None
    short = 'torchbearer_dist.' + target.rsplit('.', 1)[-1]
    if short == target:
        return None
    domain = env.get_domain('py')
    return domain.resolve_xref(env, node['refdoc'], app.builder, node['reftype'], short, node, contnode)


def setup(app):
    app.connect('missing-reference', _reexported)


templates_path = []
exclude_patterns = ['_build']
# furo: maintained, readable at laptop widths, code blocks scroll inside their box.
html_theme = 'furo'
html_title = 'torchbearer_dist ' + release
html_static_path = ['_static']
html_css_files = ['custom.css']
# The copy button copies a command without its "$ " prompt, and leaves out the output lines after it.
copybutton_prompt_text = r'\$ '
copybutton_prompt_is_regexp = True
