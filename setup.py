"""Kept for tools that look for setup.py; all metadata lives in pyproject.toml."""
from setuptools import setup

setup()
