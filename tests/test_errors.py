"""torch_vjp/_errors.py: every error and warning class lives there, is exported and
documented, derives from the builtin torch raises; and the helpers every module shares
(the one warn-once registry, the one environment switch, the one byte formatter)."""

from __future__ import annotations

import importlib.util
import re
import warnings
from pathlib import Path

import pytest

import torch_vjp as tv
from torch_vjp import _errors
from torch_vjp._errors import env_flag, first_time, format_bytes, warn_once

PACKAGE = Path(tv.__file__).resolve().parent
ERRORS_PAGE = PACKAGE.parent / "docs" / "pages" / "errors.md"

CLASSES = sorted(
    (obj for obj in vars(_errors).values()
     if isinstance(obj, type) and issubclass(obj, (tv.TorchVJPError, tv.TorchVJPWarning))),
    key=lambda cls: cls.__name__,
)


def test_error_and_warning_classes_are_defined_in_errors_only():
    pattern = re.compile(r"^\s*class\s+\w*(Error|Warning)\b", re.MULTILINE)
    elsewhere = [
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "_errors.py" and pattern.search(path.read_text(encoding="utf-8"))
    ]
    assert elsewhere == []


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_each_class_is_exported_documented_and_named_by_its_public_path(cls):
    assert cls.__name__ in tv.__all__
    assert getattr(tv, cls.__name__) is cls
    assert cls.__module__ == "torch_vjp"
    assert f"`{cls.__name__}`" in ERRORS_PAGE.read_text(encoding="utf-8")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda cls: cls.__name__)
def test_each_error_also_derives_from_a_builtin(cls):
    if issubclass(cls, tv.TorchVJPWarning):
        assert issubclass(cls, UserWarning)
    elif cls is not tv.TorchVJPError:
        assert issubclass(cls, tv.TorchVJPError)
        assert issubclass(cls, (RuntimeError, ValueError, TypeError, IndexError, MemoryError))


def test_every_exception_exported_is_one_of_them():
    exported = {name for name in tv.__all__
                if isinstance(getattr(tv, name), type)
                and issubclass(getattr(tv, name), (Exception, Warning))}
    assert exported == {cls.__name__ for cls in CLASSES}


@pytest.mark.parametrize("value, on", [
    (None, False), ("", False), ("  ", False), ("0", False), (" off ", False),
    ("False", False), ("no", False), ("1", True), ("true", True), ("yes", True),
    ("on", True), ("2", True),
], ids=repr)
def test_env_flag(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("TORCH_VJP_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("TORCH_VJP_TEST_SWITCH", value)
    assert env_flag("TORCH_VJP_TEST_SWITCH") is on


@pytest.mark.parametrize("value", [None, "", " ", "0", "OFF", " no ", "false", "1", "yes", "x"],
                         ids=repr)
@pytest.mark.parametrize("default", [False, True])
def test_the_hooks_copy_of_env_flag_agrees(monkeypatch, value, default):
    """The plugin hook imports nothing of torch_vjp, so it holds its own env_flag."""
    hook_source = PACKAGE / "_autoload" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_hook_copy", hook_source)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    if value is None:
        monkeypatch.delenv("TORCH_VJP_TEST_SWITCH", raising=False)
    else:
        monkeypatch.setenv("TORCH_VJP_TEST_SWITCH", value)
    got = hook.env_flag("TORCH_VJP_TEST_SWITCH", default=default)
    assert got is env_flag("TORCH_VJP_TEST_SWITCH", default=default)


def test_env_flag_default_applies_to_unset_and_empty_only(monkeypatch):
    monkeypatch.delenv("TORCH_VJP_TEST_SWITCH", raising=False)
    assert env_flag("TORCH_VJP_TEST_SWITCH", default=True) is True
    monkeypatch.setenv("TORCH_VJP_TEST_SWITCH", "")
    assert env_flag("TORCH_VJP_TEST_SWITCH", default=True) is True
    monkeypatch.setenv("TORCH_VJP_TEST_SWITCH", "0")
    assert env_flag("TORCH_VJP_TEST_SWITCH", default=True) is False


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (999, "999 B"), (1000, "1 kB"), (1536, "1.54 kB"), (640, "640 B"),
    (40e9, "40 GB"), (720e9, "720 GB"), (123.4e6, "123 MB"), (2.5e12, "2.5 TB"), (None, "-"),
], ids=str)
def test_one_byte_format(n, text):
    assert format_bytes(n) == text


def test_warn_once_warns_once_per_key():
    key = ("test_errors", object())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            warn_once(key, "said once", tv.JacobianWarning)
    assert [str(w.message) for w in caught] == ["said once"]
    assert caught[0].filename == __file__  # pointed at the caller, outside torch_vjp
    assert not first_time(key)


def test_messages_name_a_type_with_its_article():
    # messages said "is a int", "is a NoneType", "a Embedding"
    import torch

    from torch_vjp._errors import a_type, with_article

    assert [a_type(v) for v in (3, 2.5, None, [], {}, "s")] == [
        "an int", "a float", "None", "a list", "a dict", "a str"]
    assert [with_article(n) for n in ("Embedding", "LSTM", "GRU", "RNN", "MSELoss", "Linear",
                                      "ndarray", "OrderedDict", "HuberLoss")] == [
        "an Embedding", "an LSTM", "a GRU", "an RNN", "an MSELoss", "a Linear", "an ndarray",
        "an OrderedDict", "a HuberLoss"]
    with pytest.raises(tv.GradOutputsTypeError, match=r"grad_outputs\[0\] is an int, but"):
        x = torch.randn(3, requires_grad=True)
        tv.grad(x * 2, x, [5])
    with pytest.raises(tv.JacobianCallError, match=r"the output of f is None"):
        tv.jacobian(lambda x: None, torch.randn(3))
