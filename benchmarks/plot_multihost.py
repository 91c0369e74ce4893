"""The figure and the per-model tables of the multi-host benchmark, from its CSV.

Regenerate them from an existing run with ``python benchmarks/plot_multihost.py benchmarks/results/multihost``.
"""
import csv
import os
import sys

#: Per-model table: (CSV column, heading), narrow enough for a documentation page.
MODEL_TABLE = [('link', 'link'), ('contender', 'contender'), ('samples_per_s', 'samples/s'),
               ('ratio_to_ddp', 'x DDP'), ('ratio_to_single', 'x 1 process'), ('wire_kb_per_step', 'kB sent/step'),
               ('projected', 'model'), ('projected_loaded', 'model, loaded')]
COLOURS = {'single-1-thread': '#9e9e9e', 'single-all-cores': '#616161', 'ddp': '#d62728', 'ddp-fp16-hook': '#ff9896',
           'ddp-powersgd-hook': '#8c564b', 'per-param-recipe': '#ff7f0e', 'ours': '#1f77b4', 'ours-fp16': '#6baed6',
           'ours-bf16': '#9ecae1', 'ours-powersgd': '#2ca02c'}


MODEL_NAMES = {'cnn1m': 'the 1.2M-parameter CNN', 'mlp': 'the 784-100-10 MLP'}
LINK_NAMES = {'100mbit': '100 Mbit/s', '1gbit': '1 Gbit/s', '10gbit': '10 Gbit/s', 'none': 'unshaped'}


def plot(path, rows, command):
    """Write a PNG of ``rows`` (multihost.py's) to ``path``: 720 px wide, the width of a documentation page,
    so that it shows at about its own size there, its smallest text 11 pt (15 px)."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r['model'] for r in rows))
    links = list(dict.fromkeys(r['link'] for r in rows))
    names = [n for n in COLOURS if any(r['contender'] == n for r in rows)]
    columns, lines = 1, len(models)
    figure, axes = plt.subplots(lines, columns, figsize=(7.2, 3.3 * lines + 1.4), squeeze=False, layout='constrained')
    width = 0.8 / max(1, len(names))
    for index, model in enumerate(models):
        ax = axes[index // columns][index % columns]
        for k, name in enumerate(names):
            xs, ys, px, py = [], [], [], []
            for i, link in enumerate(links):
                row = next((r for r in rows if (r['model'], r['link'], r['contender']) == (model, link, name)), None)
                if row and row.get('samples_per_s'):
                    xs.append(i + (k - len(names) / 2 + 0.5) * width)
                    ys.append(row['samples_per_s'])
                    if row.get('projected_loaded') or row.get('projected'):
                        px.append(xs[-1])
                        py.append(row.get('projected_loaded') or row['projected'])
            ax.bar(xs, ys, width, color=COLOURS[name], label=name if index == 0 else None)
            ax.plot(px, py, 'k_', markersize=9, markeredgewidth=2,
                    label='projection (loaded)' if index == 0 and k == 0 else None)
        ax.set_yscale('log')
        ax.set_xticks(range(len(links)))
        ax.set_xticklabels([LINK_NAMES.get(link, link) for link in links], fontsize=11)
        ax.tick_params(axis='y', labelsize=11, which='both')
        ax.set_ylabel('samples/s (median)', fontsize=11)
        ax.set_title(MODEL_NAMES.get(model, model), fontsize=12)
        ax.grid(axis='y', alpha=0.3, which='both')
    for index in range(len(models), lines * columns):
        axes[index // columns][index % columns].axis('off')
    figure.legend(loc='outside lower center', ncol=3, fontsize=11, frameon=False)
    figure.suptitle('2 hosts, 1 rank x 1 thread each, batch 64; bars: measured,\nblack marks: the projection '
                    'model', fontsize=12)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def calibrate(rows):
    """Scale the model's compute by the contention measured on the unshaped link; adds ``projected_loaded``.

    The projection takes compute from a single-process step measured while the other host idles. Two
    hosts that share cores (here two namespaces on one 2-core machine with other jobs) compute slower
    than that. On the unshaped link, where communication is nearly free, DDP's step over the
    single-process step measures that slowdown ``c``; the loaded figure adds ``(c - 1)`` single steps
    to each projected step (first order: it ignores that a slower backward hides more communication).
    """
    for model in dict.fromkeys(r['model'] for r in rows):
        mine = {(r['link'], r['contender']): r for r in rows if r['model'] == model}
        ddp, single = mine.get(('none', 'ddp')), mine.get(('none', 'single-1-thread'))
        if not ddp or not single or not ddp.get('step_ms') or not single.get('step_ms'):
            continue
        slowdown = ddp['step_ms'] / single['step_ms']
        for (link, _), row in mine.items():
            solo = mine.get((link, 'single-1-thread'))
            if row.get('projected_step_ms') and solo and solo.get('step_ms'):
                step = row['projected_step_ms'] + (slowdown - 1) * solo['step_ms']
                row['projected_loaded'] = row['hosts'] * 64 / (step / 1e3)
                row['slowdown'] = slowdown


def read_rows(folder):
    """The rows of ``folder``/multihost.csv, numbers as floats."""
    with open(os.path.join(folder, 'multihost.csv'), newline='') as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        for key, value in row.items():
            try:
                row[key] = float(value) if value != '' else None
            except ValueError:
                pass
    return rows


def write_model_tables(folder, rows):
    """One narrow CSV per model, ``multihost_<model>.csv``, for the documentation's tables."""
    for model in dict.fromkeys(r['model'] for r in rows):
        with open(os.path.join(folder, 'multihost_{}.csv'.format(model)), 'w', newline='') as f:
            writer = csv.writer(f)
            writer.writerow([heading for _, heading in MODEL_TABLE])
            for row in rows:
                if row['model'] == model:
                    writer.writerow([_cell(row.get(key), key) for key, _ in MODEL_TABLE])


def _cell(value, key):
    if value is None:
        return ''
    if isinstance(value, float):
        return '{:.2f}'.format(value) if key.startswith('ratio') else '{:.0f}'.format(value)
    return 'unshaped' if value == 'none' else value


if __name__ == '__main__':
    folder = sys.argv[1]
    found = read_rows(folder)
    calibrate(found)
    write_model_tables(folder, found)
    with open(os.path.join(folder, 'command.txt')) as f:
        plot(os.path.join(folder, 'multihost.png'), found, f.readline().strip())
