"""The layer rules of CONTRIBUTING.rst, read from the source with ``ast``: a reach upward, or into a private module or
a foreign internal from where it does not belong, fails here. An import is ``import``, ``from ... import`` (relative
ones resolved from the importing module) or ``importlib.import_module``/``__import__`` of a string literal.

- each layer imports only the layers below it (``LOWER``): ``runtime/`` never ``callbacks/`` or ``sync/``,
  ``sync/`` never torchbearer, nothing inside the package imports its public root ``torchbearer_dist``;
- no layer below the fault-tolerant mode (``BELOW_FT``: ``callbacks/``, ``checkpoint/``, ``data/``, ``runtime/``,
  ``sync/``) imports ``ft/``, not even inside a function: ``recipe.py``, above both, joins them;
- torchbearer is imported only by ``callbacks/``, ``checkpoint/`` and ``_torchbearer.py``;
- a foreign private name (``torch.nn.modules.batchnorm._BatchNorm``, ``Tqdm._loader`` through ``getattr``,
  ``from torchbearer... import _Checkpointer``, ``torch.distributed.distributed_c10d``) appears only in a private
  module, where its warning and canary are;
- nothing outside the package (examples, benchmarks, docs) imports a private module.
"""
import ast
import os

import pytest

from _dist import ROOT

PACKAGE = 'torchbearer_dist'

#: The layers each layer may import (besides itself). A layer is a subpackage or a private root module.
LOWER = {
    '_once': set(),
    'runtime': {'_once'},
    'sync': {'runtime', '_once'},
    'data': {'sync', 'runtime', '_once'},
    '_torchbearer': {'_once'},
    'callbacks': {'data', 'sync', 'runtime', '_torchbearer', '_once'},
    'checkpoint': {'data', 'sync', 'runtime', '_torchbearer', '_once'},
    # The fault-tolerant mode (torchft) builds on the callbacks and checkpoints it plugs into.
    'ft': {'callbacks', 'checkpoint', 'data', 'sync', 'runtime', '_torchbearer', '_once'},
    # distributed_callbacks: the standard set for either mode, above the callbacks and the fault-tolerant mode.
    'recipe': {'ft', 'callbacks', 'checkpoint', 'data', 'sync', 'runtime', '_torchbearer', '_once'},
}
#: The layers below the fault-tolerant mode: none imports ``torchbearer_dist.ft``, not even lazily (issue 43).
BELOW_FT = ('callbacks', 'checkpoint', 'data', 'runtime', 'sync')
#: The layers that may import torchbearer itself.
TORCHBEARER = {'callbacks', 'checkpoint', '_torchbearer', 'ft'}
#: Foreign libraries whose private names stay in private modules.
FOREIGN = ('torch', 'torchbearer')
#: Internal module names of foreign libraries that are private in all but name.
FOREIGN_INTERNAL = {'distributed_c10d'}


def _private(module):
    return any(part.startswith('_') and not part.startswith('__') for part in module.split('.'))


def _layer(module):
    parts = module.split('.')
    return parts[1] if len(parts) > 1 else None


def _relative(anchor, level, name):
    """The absolute name of ``name`` imported ``level`` dots up from package ``anchor`` (``from ..sync import x``
    in ``torchbearer_dist.runtime``: ``torchbearer_dist.sync``), or None where ``anchor`` is unknown or too shallow."""
    parts = anchor.split('.') if anchor else []
    if level - 1 >= len(parts):
        return None
    base = parts[:len(parts) - (level - 1)]
    return '.'.join(base + ([name] if name else []))


def _import_module_call(node):
    """Whether ``node`` calls ``importlib.import_module`` (under any alias) or ``__import__``."""
    func = node.func
    return (isinstance(func, ast.Attribute) and func.attr == 'import_module') or \
        (isinstance(func, ast.Name) and func.id in ('import_module', '__import__'))


def _imports(tree, submodules, module=None):
    """Every module an ``ast`` tree imports, with ``from package import module`` resolved to the module.

    Relative imports (``from . import x``, ``from ..sync import y``) are resolved against ``module``, the
    importing module's name, and ``importlib.import_module('...')`` with a string literal counts as an import.
    """
    known = set(submodules) | {m.rsplit('.', i)[0] for m in submodules for i in range(1, m.count('.') + 1)}
    # the package a relative import starts from: the module itself if it is a package, else its parent
    anchor = module if module in known and any(m.startswith(module + '.') for m in submodules) else \
        (module.rsplit('.', 1)[0] if module and '.' in module else None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            source = _relative(anchor, node.level, node.module) if node.level else node.module
            if source is None:
                continue  # a relative import outside a known package (a script's): nothing to resolve it to
            yielded = False
            for alias in node.names:
                name = source + '.' + alias.name
                if name in known:
                    yielded = True
                    yield node.lineno, name
            if not yielded:
                yield node.lineno, source
        elif isinstance(node, ast.Call) and _import_module_call(node) and node.args and \
                isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            name = node.args[0].value
            if name.startswith('.'):
                package = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == 'package'), None)
                start = package.value if isinstance(package, ast.Constant) and isinstance(package.value, str) \
                    else anchor
                level = len(name) - len(name.lstrip('.'))
                name = _relative(start, level, name[level:])
                if name is None:
                    continue
            yield node.lineno, name


def _foreign_roots(tree):
    """Local names bound to a foreign library or its modules (``import torch.nn as nn``, ``from torch import nn``)."""
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split('.')[0] in FOREIGN:
                    roots.add(alias.asname or alias.name.split('.')[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split('.')[0] in FOREIGN:
            roots.update(alias.asname or alias.name for alias in node.names)
    return roots


def _chain_root(node):
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _own_names(trees):
    """The names the package itself defines: functions, classes, and attributes it assigns (``x._last = ...``)."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _foreign_private(tree, own=frozenset()):
    """(line, what) for each foreign private name the tree reaches; ``getattr`` of a name in ``own`` is ours."""
    roots = _foreign_roots(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split('.')[0] in FOREIGN:
            for alias in node.names:
                if alias.name.startswith('_') or alias.name in FOREIGN_INTERNAL or \
                        set(node.module.split('.')) & FOREIGN_INTERNAL:
                    yield node.lineno, 'from {} import {}'.format(node.module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split('.')[0] in FOREIGN and set(alias.name.split('.')) & FOREIGN_INTERNAL:
                    yield node.lineno, 'import ' + alias.name
        elif isinstance(node, ast.Attribute) and _chain_root(node) in roots:
            if (node.attr.startswith('_') and not node.attr.startswith('__')) or node.attr in FOREIGN_INTERNAL:
                yield node.lineno, '.' + node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ('getattr', 'hasattr', 'setattr', 'delattr') and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith('_') \
                    and not name.value.startswith('__') and name.value not in own \
                    and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ('self', 'cls')):
                yield node.lineno, '{}(..., {!r})'.format(node.func.id, name.value)


def violations(sources):
    """Every breach of the layer rules in ``sources``, a dict of module name to source text of the package."""
    trees = {module: ast.parse(text) for module, text in sources.items()}
    submodules, own = set(trees), _own_names(trees.values())
    found = []
    for module, tree in sorted(trees.items()):
        layer = _layer(module)
        for line, imported in _imports(tree, submodules, module):
            where = '{}:{} imports {}'.format(module, line, imported)
            top = imported.split('.')[0]
            if top == 'torchbearer' and layer is not None and layer not in TORCHBEARER:
                found.append(where + ': only callbacks/, checkpoint/ and _torchbearer.py import torchbearer')
            if top != PACKAGE or layer is None:
                continue
            target = _layer(imported)
            if target is None:
                found.append(where + ': nothing inside the package imports its public root')
            elif target != layer and target not in LOWER.get(layer, set()):
                found.append(where + ': {} may import only {}'.format(layer, sorted(LOWER.get(layer, ()))))
        if not _private(module):
            for line, what in _foreign_private(tree, own):
                found.append('{}:{} reaches {}: a foreign internal belongs in a private module'.format(
                    module, line, what))
    return found


def _package_sources(root):
    sources = {}
    for folder, _, names in os.walk(os.path.join(root, PACKAGE)):
        for name in names:
            if name.endswith('.py'):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, '.')
                module = module[:-len('.__init__')] if module.endswith('.__init__') else module
                with open(path) as f:
                    sources[module] = f.read()
    return sources


def test_the_package_keeps_its_layers():
    sources = _package_sources(ROOT)
    assert len(sources) > 40 and {'torchbearer_dist.sync.buckets', 'torchbearer_dist.runtime.group'} <= set(sources)
    assert violations(sources) == []


def ft_imports(sources):
    """``module:line imports name`` for each import of ``torchbearer_dist.ft`` by a module of a layer below it."""
    ft = PACKAGE + '.ft'
    return ['{}:{} imports {}'.format(module, line, imported)
            for module, text in sorted(sources.items()) if _layer(module) in BELOW_FT
            for line, imported in _imports(ast.parse(text), set(sources), module)
            if imported == ft or imported.startswith(ft + '.')]


def test_no_layer_below_ft_imports_it():
    sources = _package_sources(ROOT)
    assert set(BELOW_FT) <= {_layer(module) for module in sources}  # the layers still exist: the check is not empty
    assert ft_imports(sources) == []
    breach = {'torchbearer_dist.ft.callback': '', 'torchbearer_dist.ft': '', 'torchbearer_dist.recipe':
              'from torchbearer_dist.ft.callback import FaultTolerantAllReduce\n',  # above ft: allowed
              'torchbearer_dist.callbacks': 'def f():\n    from torchbearer_dist.ft.callback import A\n',  # lazy
              'torchbearer_dist.sync.group': 'from .. import ft\n'}  # relative
    assert ft_imports(breach) == ['torchbearer_dist.callbacks:2 imports torchbearer_dist.ft.callback',
                                  'torchbearer_dist.sync.group:1 imports torchbearer_dist.ft']


def circles(sources):
    """The import circles among the modules of ``sources`` (imports inside functions included): sorted module lists.

    A package's ``__init__`` imported by its own submodules does not count: Python runs it first anyway.
    """
    trees = {module: ast.parse(text) for module, text in sources.items()}
    graph = {module: {imported for _, imported in _imports(tree, set(trees), module)
                      if imported in trees and imported != module and not module.startswith(imported + '.')}
             for module, tree in trees.items()}

    def reach(module):
        seen, todo = set(), list(graph[module])
        while todo:
            nxt = todo.pop()
            if nxt not in seen:
                seen.add(nxt)
                todo.extend(graph[nxt])
        return seen

    reached = {module: reach(module) for module in graph}
    return sorted({tuple(sorted(m for m in reached[module] if module in reached[m]))
                   for module in graph if module in reached[module]})


def test_no_import_circle():
    assert circles(_package_sources(ROOT)) == []
    breach = {'torchbearer_dist.callbacks.stop': 'from torchbearer_dist.callbacks.gradients import A\n',
              'torchbearer_dist.callbacks.gradients': 'def f():\n    from . import stop\n',  # lazy, relative
              'torchbearer_dist.callbacks': 'from torchbearer_dist.callbacks.stop import A\n'}
    assert circles(breach) == [('torchbearer_dist.callbacks.gradients', 'torchbearer_dist.callbacks.stop')]


def test_nothing_outside_the_package_imports_a_private_module():
    found = []
    for top in ('examples', 'benchmarks', 'docs'):
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            for name in (n for n in names if n.endswith('.py')):
                path = os.path.join(folder, name)
                with open(path) as f:
                    tree = ast.parse(f.read())
                for line, imported in _imports(tree, set()):
                    names = [imported] + [imported + '.' + a.name for node in ast.walk(tree)
                                          if isinstance(node, ast.ImportFrom) and node.module == imported
                                          for a in node.names]
                    found += ['{}:{} imports {}'.format(os.path.relpath(path, ROOT), line, n) for n in names
                              if n.split('.')[0] == PACKAGE and _private(n)]
    assert found == []


@pytest.mark.parametrize('module, text, expected', [
    ('torchbearer_dist.runtime.group', 'from torchbearer_dist.sync import collectives\n',
     'runtime may import only'),
    ('torchbearer_dist.runtime.group', 'import torchbearer_dist.callbacks.stop\n', 'runtime may import only'),
    ('torchbearer_dist.sync.buckets', 'import torchbearer\n', 'only callbacks/, checkpoint/ and _torchbearer.py'),
    ('torchbearer_dist.sync.buckets', 'from torchbearer_dist import _torchbearer\n', 'sync may import only'),
    ('torchbearer_dist.callbacks.stop', 'from torchbearer_dist.checkpoint import files\n',
     'callbacks may import only'),
    ('torchbearer_dist.callbacks.stop', 'import torchbearer_dist\n', 'its public root'),
    ('torchbearer_dist.callbacks.output', 'bar = getattr(printer, "_loader", None)\n', "getattr(..., '_loader')"),
    ('torchbearer_dist.callbacks.output', 'def f(owner):\n    owner._last = 1\nx = getattr(owner, "_first")\n',
     "getattr(..., '_first')"),
    ('torchbearer_dist.sync.syncbn', 'from torch import nn\nclass B(nn.modules.batchnorm._BatchNorm): pass\n',
     '._BatchNorm'),
    ('torchbearer_dist.sync.buckets', 'import torch\nengine = torch.autograd.Variable._execution_engine\n',
     '._execution_engine'),
    ('torchbearer_dist.callbacks.output', 'from torchbearer.callbacks.checkpointers import _Checkpointer\n',
     'import _Checkpointer'),
    ('torchbearer_dist.runtime.group', 'import torch.distributed as dist\nx = dist.distributed_c10d\n',
     '.distributed_c10d'),
    # relative imports, resolved from the importing module
    ('torchbearer_dist.runtime.group', 'from ..sync import collectives\n', 'runtime may import only'),
    ('torchbearer_dist.runtime.group', 'from .. import sync\n', 'runtime may import only'),
    ('torchbearer_dist.sync.buckets', 'from .. import _torchbearer\n', 'sync may import only'),
    ('torchbearer_dist.callbacks.stop', 'from ..checkpoint.files import save_checkpoint\n',
     'callbacks may import only'),
    ('torchbearer_dist.callbacks.stop', 'def f():\n    from torchbearer_dist.ft.callback import A\n',
     'callbacks may import only'),  # the fault-tolerant mode is above the callbacks, even lazily
    # importlib, under any spelling, absolute or relative
    ('torchbearer_dist.runtime.group', 'import importlib\nimportlib.import_module("torchbearer_dist.callbacks.stop")\n',
     'runtime may import only'),
    ('torchbearer_dist.runtime.group', 'from importlib import import_module\nimport_module("..sync.collectives", '
     '__package__)\n', 'runtime may import only'),
    ('torchbearer_dist.runtime.group', 'import importlib as il\nil.import_module(".collectives", '
     'package="torchbearer_dist.sync")\n', 'runtime may import only'),
    ('torchbearer_dist.sync.buckets', '__import__("torchbearer")\n',
     'only callbacks/, checkpoint/ and _torchbearer.py'),
])
def test_each_rule_fails_on_a_breach(module, text, expected):
    sources = {'torchbearer_dist.sync.collectives': '', 'torchbearer_dist.checkpoint.files': '',
               'torchbearer_dist._torchbearer': '', 'torchbearer_dist.callbacks.stop': ''}
    sources[module] = text
    found = violations(sources)
    assert len(found) == 1 and expected in found[0], found
    private = module.rsplit('.', 1)[0] + '._' + module.rsplit('.', 1)[1]  # the same reach, from a private module
    if 'reaches' in found[0]:
        assert violations(dict(sources, **{module: '', private: text})) == []


def test_a_relative_import_resolves_from_the_importing_module_or_package():
    sources = {'torchbearer_dist.runtime': 'from .group import process_group\n',  # a package: from itself
               'torchbearer_dist.runtime.group': 'from . import env\nfrom .env import resolve\n',
               'torchbearer_dist.runtime.env': '', 'torchbearer_dist.sync.collectives': ''}
    assert violations(sources) == []  # within the layer
    sources['torchbearer_dist.runtime'] = 'from ..sync import collectives\n'  # from torchbearer_dist, not above it
    found = violations(sources)
    assert found == ['torchbearer_dist.runtime:1 imports torchbearer_dist.sync.collectives: runtime may import '
                     "only ['_once']"], found
