"""Docstring examples in padim.core must stay true."""

import doctest
import importlib
import pkgutil

import pytest

import padim.core

MODULES = ["padim.core", *(m.name for m in pkgutil.iter_modules(padim.core.__path__, "padim.core."))]


@pytest.mark.parametrize("name", MODULES)
def test_doctests(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name} has no docstring example"
    assert result.failed == 0
