"""The one thing pyproject.toml cannot say: every package under osdp/ found, plus osdp._csrc, which lives in
the top-level csrc/ (``[tool.setuptools.package-dir]``) so that no package list has to be kept by hand."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["osdp", "osdp.*"]), "osdp._csrc"])
