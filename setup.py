"""A shim for tools that call setup.py: the metadata is in pyproject.toml, the dependencies in
requirements*.txt."""

from setuptools import setup

setup()
