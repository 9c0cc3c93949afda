"""The wrapper search of ``apply(model)``: bounded, modules only, and a clear TypeError when nothing is found."""

import subprocess
import sys
import textwrap
import unittest.mock

import pytest
import torch

from deltafuse import patching
from deltafuse.maps import PATCHER
from tests.helpers import input_seed


class SupportedLayer(torch.nn.Linear):
    """Stands for a layer of a supported family (the patcher is told it owns this class)."""


class Holder:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


class SelfReferencing:
    def __init__(self):
        self.model = self
        self.module = Holder(model=self, base_model=Holder(module=self))


class Endless:
    """A wrapper whose get_base_model() builds a new wrapper every time."""

    def get_base_model(self):
        return Endless()


@pytest.fixture
def owns_supported_layer(monkeypatch):
    owns = PATCHER.owns
    monkeypatch.setattr(PATCHER, "owns", lambda cls: cls is SupportedLayer or owns(cls))


def _model():
    torch.manual_seed(input_seed(0))
    return torch.nn.Sequential(torch.nn.Linear(4, 4), SupportedLayer(4, 4))


def _nested(model, depth):
    obj = model
    for i in range(depth):
        obj = Holder(**{("model", "module", "base_model")[i % 3]: obj})
    return obj


@pytest.mark.parametrize("depth", [0, 1, 3, 6])
def test_supported_module_found_through_wrappers(owns_supported_layer, depth):
    model = _model()
    assert patching.find_model(_nested(model, depth)) is model
    assert patching.find_model(Holder(get_base_model=lambda: _nested(model, depth - 1) if depth else model)) is model


def test_search_depth_is_bounded(owns_supported_layer):
    with pytest.raises(patching.UnsupportedModelError) as err:
        patching.find_model(_nested(_model(), 7))
    msg = str(err.value)
    assert "stopped at its limit (6 levels, 32 objects)" in msg and "type tests.test_patching.Holder" in msg


def _message(obj) -> str:
    with pytest.raises(patching.UnsupportedModelError) as err:
        patching.apply(obj)
    assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)
    assert not PATCHER.has_records()  # nothing was patched
    return str(err.value)


@pytest.mark.parametrize("make,type_name", [
    (unittest.mock.Mock, "unittest.mock.Mock"),
    (unittest.mock.MagicMock, "unittest.mock.MagicMock"),
    (unittest.mock.NonCallableMagicMock, "unittest.mock.NonCallableMagicMock"),
])
def test_objects_that_answer_every_attribute_end_the_search(make, type_name):
    msg = _message(make())
    assert f"(type {type_name})" in msg and "stopped at its limit" in msg
    assert "Walked (through get_base_model, module, base_model, model): model: " + type_name in msg
    assert "; model.get_base_model(): unittest.mock." in msg and "; model.module: unittest.mock." in msg
    assert msg.endswith(" more")  # the walked list is cut short


def test_wrapper_building_new_wrappers_ends_at_the_depth_limit():
    msg = _message(Endless())
    walked = msg.split("Walked (through get_base_model, module, base_model, model): ")[1].split("; ")
    assert walked == [f"model{'.get_base_model()' * i}: tests.test_patching.Endless" for i in range(7)]
    assert "stopped at its limit (6 levels, 32 objects)" in msg


def test_mock_with_module_spec_is_not_taken_for_a_module(owns_supported_layer):
    """isinstance(Mock(spec=nn.Module), nn.Module) is True; only real modules are looked into or returned."""
    fake = unittest.mock.MagicMock(spec=torch.nn.Module)
    fake.modules.return_value = [SupportedLayer(2, 2)]
    assert isinstance(fake, torch.nn.Module)
    with pytest.raises(patching.UnsupportedModelError, match=r"\(type unittest.mock.MagicMock\)"):
        patching.find_model(fake)


def test_self_referencing_wrapper_walks_each_object_once():
    msg = _message(SelfReferencing())
    walked = msg.split("Walked (through get_base_model, module, base_model, model): ")[1].split("; ")
    assert walked == ["model: tests.test_patching.SelfReferencing", "model.module: tests.test_patching.Holder",
                      "model.module.base_model: tests.test_patching.Holder"]
    assert "stopped at its limit" not in msg


@pytest.mark.parametrize("obj,type_name", [(object(), "builtins.object"), (3, "builtins.int"),
                                           ("model", "builtins.str"), (torch.nn.Linear(2, 2),
                                                                       "torch.nn.modules.linear.Linear")])
def test_plain_objects_are_a_type_error_naming_the_type(obj, type_name):
    msg = _message(obj)
    assert f"found no supported model in the object given (type {type_name})" in msg
    assert msg.endswith(f"model: {type_name}") and "qwen3_5" in msg


def test_none_is_not_a_model():
    with pytest.raises(patching.UnsupportedModelError, match=r"find_model\(None\): no model given.*apply\(\) "
                                                             r"without a model"):
        patching.find_model(None)


def test_mock_search_is_quick_and_small():
    """apply(Mock()) used to follow .model/.module/get_base_model() without end (gigabytes); in a subprocess so
    that a regression fails by timeout instead of hanging the suite."""
    code = textwrap.dedent("""
        import time, tracemalloc, unittest.mock
        from deltafuse import patching
        for make in (unittest.mock.Mock, unittest.mock.MagicMock):
            tracemalloc.start()
            start = time.perf_counter()
            try:
                patching.apply(make())
            except TypeError:
                pass
            else:
                raise SystemExit("no error")
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            print(make.__name__, round(time.perf_counter() - start, 2), peak)
            assert peak < 64 * 2**20, peak
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Mock" in proc.stdout and "MagicMock" in proc.stdout
