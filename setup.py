import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(r"__version__ = '([^']+)'", (HERE / 'torchbearer_dist' / '__init__.py').read_text()).group(1)

setup(
    name='torchbearer_dist',
    version=VERSION,
    description='Torchbearer callbacks that make a standard Trial train data-parallel on gloo or nccl',
    long_description=(HERE / 'README.rst').read_text(),
    long_description_content_type='text/x-rst',
    license='MIT',
    packages=find_packages(include=['torchbearer_dist', 'torchbearer_dist.*']),
    python_requires='>=3.9',
    install_requires=[
        'torch>=2.1',  # post-accumulate-grad hooks
        'torchbearer>=0.5.3',
        'packaging',  # torchbearer imports it without declaring it
    ],
    extras_require={
        'examples': ['torchvision>=0.16', 'mlxtend>=0.21'],
        'test': ['pytest>=7', 'pytest-timeout>=2', 'ruff', 'nbclient>=0.7', 'ipykernel>=6'],
        'docs': ['sphinx>=7', 'furo>=2024.1.29', 'sphinx-copybutton>=0.5'],
        'benchmarks': ['matplotlib>=3.5'],
    },
    classifiers=[
        'Programming Language :: Python :: 3',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
)
