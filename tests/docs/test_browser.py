"""The built pages in a real browser: headless Chromium at 1366x900, no error shown, no code block wider than its box.

Each page is copied next to the build with a script appended that measures every ``pre`` (its
``scrollWidth`` against its ``clientWidth``: a block that scrolls sideways hides the end of its
lines) and every table (its right edge against the article's), and writes the figures into the DOM
that ``chromium --dump-dom`` prints. Run by hand, ``python tests/docs/test_browser.py docs/_build/html``
prints the figures and saves a screenshot of each page next to it.
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGES = ('index', 'tutorial', 'launching', 'own_script', 'scaling', 'performance', 'low_communication',
         'troubleshooting', 'api/callbacks', 'api/process_group', 'api/data', 'api/checkpoints', 'api/engines')
WIDTH, HEIGHT = 1366, 900
#: Pixels a table may reach past the article: furo pads a table's box by 0.2 em for its shadow.
TABLE_SLACK = 8
#: Seconds one page may take to render on a busy 2-core machine.
RENDER_TIMEOUT = 60

MEASURE = '''<script>
(function () {
  var article = document.querySelector('article, div.body, [role=main]') || document.body;
  var right = article.getBoundingClientRect().right;
  var out = {viewport: window.innerWidth, pre: [], table: []};
  document.querySelectorAll('pre').forEach(function (el) {
    if (el.clientWidth === 0) { return; }  // hidden
    out.pre.push({scroll: el.scrollWidth, client: el.clientWidth, text: el.textContent.slice(0, 70)});
  });
  article.querySelectorAll('table').forEach(function (el) {
    var box = el.closest('.table-wrapper') || el.parentElement;  // furo scrolls a wide table in its wrapper
    out.table.push({right: Math.round(el.getBoundingClientRect().right), limit: Math.round(right),
                    scroll: box.scrollWidth, client: box.clientWidth, text: el.textContent.trim().slice(0, 70)});
  });
  out.errors = [];  // what the page shows a reader as an error: furo paints some as CSS content
  article.querySelectorAll('*').forEach(function (el) {
    ['::before', '::after'].forEach(function (pseudo) {
      var content = getComputedStyle(el, pseudo).content;
      if (content.indexOf('ERROR') !== -1) { out.errors.push(content.slice(0, 100)); }
    });
    if (el.classList.contains('system-message')) { out.errors.push(el.textContent.trim().slice(0, 100)); }
  });
  var node = document.createElement('div');
  node.id = 'tbd-measure';
  node.setAttribute('data-json', JSON.stringify(out));
  document.body.appendChild(node);
})();
</script>'''


def find_chromium():
    """The path of a Chromium binary, or None."""
    for name in ('chromium', 'chromium-browser', 'google-chrome', 'google-chrome-stable'):
        path = shutil.which(name)
        if path:
            return path
    return None


def _chromium_command(chromium, *args, height=HEIGHT):
    return [chromium, '--headless', '--disable-gpu', '--no-sandbox', '--hide-scrollbars',
            '--window-size={},{}'.format(WIDTH, height), '--virtual-time-budget=3000', *args]


def measure(chromium, html_dir, page):
    """Render ``page`` of the build in ``html_dir`` and return its measurements (a dict)."""
    source = os.path.join(html_dir, page + '.html')
    probe = os.path.abspath(os.path.join(os.path.dirname(source), '_measure_{}'.format(os.path.basename(source))))
    with open(source) as f:
        text = f.read()
    with open(probe, 'w') as f:
        f.write(text.replace('</body>', MEASURE + '</body>'))
    try:
        result = subprocess.run(_chromium_command(chromium, '--dump-dom', 'file://' + probe), capture_output=True,
                                text=True, timeout=RENDER_TIMEOUT)
    finally:
        os.remove(probe)
    found = re.search(r'id="tbd-measure" data-json="([^"]*)"', result.stdout)
    assert found, 'chromium printed no measurements (exit {}): {}'.format(result.returncode, result.stderr[-2000:])
    return json.loads(found.group(1).replace('&quot;', '"').replace('&lt;', '<').replace('&gt;', '>')
                      .replace('&amp;', '&'))


def overflowing(figures):
    """Descriptions of the code blocks wider than their box and the tables wider than the article."""
    wide = ['code block {} px in a {} px box: {!r}'.format(p['scroll'], p['client'], p['text'])
            for p in figures['pre'] if p['scroll'] > p['client']]
    # A table spills when its box scrolls, or when it reaches past the article by more than the few
    # pixels of padding that furo gives the box for its shadow.
    wide += ['table {} px in a {} px box, ending at {} px, the article at {} px: {!r}'.format(
        t['scroll'], t['client'], t['right'], t['limit'], t['text'])
        for t in figures['table'] if t['scroll'] > t['client'] or t['right'] > t['limit'] + TABLE_SLACK]
    return wide


@pytest.fixture(scope='module')
def chromium():
    path = find_chromium()
    if path is None:
        pytest.skip('Chromium is not installed (Debian: apt-get install -y chromium); the layout check needs a '
                    'real browser')
    result = subprocess.run(_chromium_command(path, '--dump-dom', 'about:blank'), capture_output=True, text=True,
                            timeout=RENDER_TIMEOUT)
    if '<body' not in result.stdout:
        pytest.skip('Chromium at {} does not start headless here: {}'.format(path, result.stderr.strip()[-500:]))
    return path


@pytest.mark.parametrize('page', PAGES)
def test_page_shows_no_error_and_its_blocks_fit_at_1366_px(page, chromium, built):
    figures = measure(chromium, str(built), page)
    assert figures['viewport'] == WIDTH
    assert figures['errors'] == []  # e.g. furo's red box over a `.. contents::` directive
    assert figures['pre'], 'no code blocks measured on {}'.format(page)
    assert overflowing(figures) == []


def main(html_dir):
    """Print each page's overflowing blocks and save a screenshot of it; exit 1 if any overflow."""
    chromium, failed = find_chromium(), False
    for page in PAGES:
        if not os.path.exists(os.path.join(html_dir, page + '.html')):
            continue
        figures = measure(chromium, html_dir, page)
        wide = overflowing(figures)
        failed = failed or bool(wide)
        wide += ['shows an error: {!r}'.format(error) for error in figures['errors']]
        print('{}: {} code blocks, {} tables, {} too wide or wrong'.format(page, len(figures['pre']),
                                                                           len(figures['table']), len(wide)))
        for line in wide:
            print('   ', line)
        shot = os.path.join(html_dir, 'screenshot_{}.png'.format(page.replace('/', '_')))
        subprocess.run(_chromium_command(chromium, '--screenshot=' + shot, 'file://' + os.path.abspath(
            os.path.join(html_dir, page + '.html')), height=3 * HEIGHT), capture_output=True, timeout=RENDER_TIMEOUT)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1]))
