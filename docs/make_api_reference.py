"""Writes docs/api.md, the API reference, from the public docstrings.

    python docs/make_api_reference.py          # rewrite docs/api.md
    python docs/make_api_reference.py --check  # exit 1 if it is out of date

Public means: the names in `keras_duq.__all__`, then, for each namespace
(`keras_duq.evaluation`, `.callbacks`, ...), its `__all__` or else its
classes and functions that come from keras_duq and do not start with `_`.
A class lists its constructor and the public methods and properties it
defines itself; Keras's methods, and overrides of them without a docstring
of their own (`fit`, `call`, `get_config`, ...), are documented by Keras.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys

NAMESPACES = ("evaluation", "callbacks", "tuning", "plots", "datasets", "batch_norm")
HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "api.md")


def _public_names(module):
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", "").startswith("keras_duq")
    ]


def _signature(value) -> str:
    try:
        return str(inspect.signature(value))
    except (TypeError, ValueError):
        return "(...)"


def _doc(value) -> str:
    return inspect.cleandoc(value.__doc__ or "(No docstring.)")


def _members(cls):
    for name, value in vars(cls).items():
        if name.startswith("_") and name != "__init__":
            continue
        inherited = any(hasattr(base, name) for base in cls.__mro__[1:])
        function = value.fget if isinstance(value, property) else value
        if inherited and not getattr(function, "__doc__", None):
            continue  # an override of Keras's method, documented by Keras
        if isinstance(value, property):
            yield name, "property", value.fget
        elif inspect.isfunction(value) and name != "__init__":
            yield name, "method", value


def _entry(qualified, value) -> list[str]:
    if inspect.isclass(value):
        lines = [
            f"### `{qualified}`",
            "",
            f"```python\n{qualified}{_signature(value)}\n```",
        ]
        lines += ["", _doc(value), ""]
        for name, kind, member in _members(value):
            signature = "" if kind == "property" else _signature(member)
            lines += [f"#### `{qualified}.{name}{signature}`", "", _doc(member), ""]
        return lines
    if callable(value):
        return [
            f"### `{qualified}`",
            "",
            f"```python\n{qualified}{_signature(value)}\n```",
            "",
            _doc(value),
            "",
        ]
    return [f"### `{qualified}`", "", f"```python\n{qualified} = {value!r}\n```", ""]


def render() -> str:
    import keras_duq

    lines = [
        "# API reference",
        "",
        "Generated from the docstrings by `python docs/make_api_reference.py`;",
        "do not edit by hand. The guide is the [README](../README.md).",
        "",
        "## `keras_duq`",
        "",
    ]
    for name in keras_duq.__all__:
        lines += _entry(f"keras_duq.{name}", getattr(keras_duq, name))
    for namespace in NAMESPACES:
        module = importlib.import_module(f"keras_duq.{namespace}")
        lines += [f"## `keras_duq.{namespace}`", "", _doc(module).split("\n\n")[0], ""]
        for name in _public_names(module):
            lines += _entry(f"keras_duq.{namespace}.{name}", getattr(module, name))
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--check" in argv:
        with open(OUTPUT) as f:
            if f.read() != text:
                print(
                    "docs/api.md is out of date: run python docs/make_api_reference.py"
                )
                return 1
        return 0
    with open(OUTPUT, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
