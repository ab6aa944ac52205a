"""One error hierarchy: every exception hybridkv defines is a HybridKVError, so the CLI prints
any of them as one line."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import hybridkv
from hybridkv.errors import CorruptEntry, HybridKVError, StoreError


def _modules():
    for info in pkgutil.walk_packages(hybridkv.__path__, prefix="hybridkv."):
        yield importlib.import_module(info.name)


def test_every_exception_hybridkv_defines_is_a_hybridkv_error():
    defined = {
        cls
        for module in _modules()
        for _, cls in inspect.getmembers(module, inspect.isclass)
        if issubclass(cls, BaseException) and cls.__module__.startswith("hybridkv.")
    }
    assert {StoreError, CorruptEntry} <= defined
    assert [cls.__qualname__ for cls in defined if not issubclass(cls, HybridKVError)] == []


@pytest.mark.parametrize(
    "url",
    [
        "memory://?capacity=0",
        "file:///proc/version/cannot-be-a-directory",  # FileStore's own StoreError, unwrapped
        "lmcache://nonsense",
    ],
)
def test_every_backend_constructor_raises_a_hybridkv_error(url):
    from hybridkv.store import open_store

    with pytest.raises(HybridKVError) as caught:
        open_store(url).close()
    assert "\n" not in str(caught.value)


def test_cli_prints_a_store_error_as_one_line(tmp_path, capsys):
    from hybridkv.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["store", "stats", "--store", f"file://{blocker}/store"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hybridkv: error:") and "cannot create store directory" in err[0]
