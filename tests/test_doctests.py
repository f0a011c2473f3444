"""Every docstring example in the engine and the catalogue runs and prints what it says."""

import doctest
import importlib
import pkgutil

import jaxshard.rules
import pytest

import jaxshard

MODULES = sorted(
    [f"jaxshard.{m.name}" for m in pkgutil.iter_modules(jaxshard.__path__)]
    + [f"jaxshard.rules.{m.name}" for m in pkgutil.iter_modules(jaxshard.rules.__path__)]
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
