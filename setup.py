"""Kept so `python setup.py develop` and older tooling work; metadata is in pyproject.toml."""

from setuptools import setup

setup()
