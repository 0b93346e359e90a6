"""Writes docs/api.md, the API reference page of the documentation site.

    python docs/make_api_reference.py          # rewrite docs/api.md
    python docs/make_api_reference.py --check  # exit 1 if it is out of date
    pip install -e ".[docs]" && mkdocs build --strict   # the site, in site/

docs/api.md lists what the reference documents, one mkdocstrings block
(`::: keras_duq.wrap`) a name; `mkdocs build` (mkdocs-material and
mkdocstrings, `mkdocs.yml`) renders each block from the docstring and the
signature. Public means: the names in `keras_duq.__all__`, then, for each
namespace (`keras_duq.evaluation`, `.callbacks`, ...), its `__all__` or else
its classes and functions that come from keras_duq and do not start with
`_`. A class lists its constructor and the public methods and properties it
defines itself; Keras's methods, and overrides of them without a docstring
of their own (`fit`, `call`, `get_config`, ...), are documented by Keras.

Warnings are errors, twice: this script fails (exit 1, with each problem
named, before anything is written) on a public name without a docstring or
an argument its `Args:` section (a dataclass: `Attributes:`) does not list;
`mkdocs build --strict` fails on anything mkdocstrings warns about, such as
an `Args:` entry the signature does not have.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys

NAMESPACES = ("evaluation", "callbacks", "tuning", "plots", "datasets")
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
            yield name, value.fget
        elif isinstance(value, (classmethod, staticmethod)):
            yield name, value.__func__
        elif inspect.isfunction(value) and name != "__init__":
            yield name, value


def _documented_names(doc: str) -> set[str] | None:
    """The names an `Args:` (or, for a dataclass, `Attributes:`) section lists."""
    section = re.search(r"^(?:Args|Attributes):\n((?:[ \t]+.*\n?|\n)*)", doc, re.M)
    if section is None:
        return None
    names = set()
    for line in section.group(1).splitlines():
        entry = re.match(r"^    ([\w, *]+?):", line)
        if entry:
            names.update(name.strip().lstrip("*") for name in entry.group(1).split(","))
    return names


def _parameters(function) -> list[str]:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        p.name
        for p in parameters
        if p.name not in ("self", "cls") and p.kind not in variadic
    ]


def _problems(qualified, function, doc_owner=None) -> list[str]:
    """What the reference would be missing for `function`: a docstring, an argument."""
    doc = (doc_owner or function).__doc__
    if not doc:
        return [f"`{qualified}` has no docstring"]
    parameters = _parameters(function)
    if not parameters:
        return []
    documented = _documented_names(inspect.cleandoc(doc))
    if documented is None:
        return [f"`{qualified}` takes {parameters} but its docstring has no `Args:`"]
    missing = [name for name in parameters if name not in documented]
    if missing:
        return [f"`{qualified}`'s `Args:` does not document {missing}"]
    return []


def _entry_problems(qualified, value) -> list[str]:
    if inspect.isclass(value):
        init = value.__init__ if "__init__" in vars(value) else value
        found = _problems(qualified, init, doc_owner=value)
        for name, member in _members(value):
            found += _problems(f"{qualified}.{name}", member)
        return found
    return _problems(qualified, value) if callable(value) else []


def _entry(qualified, value) -> list[str]:
    lines = [f"::: {qualified}"]
    if inspect.isclass(value):
        # Only what the class defines itself: Keras documents the rest.
        members = [name for name, _ in _members(value)]
        lines += ["    options:", f"      members: {members or 'false'}"]
    return lines + [""]


def _public() -> list[tuple[str, str, object]]:
    """`(module, qualified name, value)` of everything the reference documents, in order."""
    import keras_duq

    found = [
        ("keras_duq", f"keras_duq.{name}", getattr(keras_duq, name))
        for name in keras_duq.__all__
    ]
    for namespace in NAMESPACES:
        module = importlib.import_module(f"keras_duq.{namespace}")
        found += [
            (module.__name__, f"{module.__name__}.{name}", getattr(module, name))
            for name in _public_names(module)
        ]
    return found


def problems() -> list[str]:
    """Docstrings the reference would render incomplete (the build's warnings)."""
    return [
        problem
        for _, qualified, value in _public()
        for problem in _entry_problems(qualified, value)
    ]


def render() -> str:
    lines = [
        "# API reference",
        "",
        "Every public class and function, rendered from its docstring by",
        "`mkdocs build` (mkdocstrings). This page is generated by",
        "`python docs/make_api_reference.py`; do not edit it by hand. The guide",
        "is the [README](../README.md).",
        "",
        "## `keras_duq`",
        "",
    ]
    section = "keras_duq"
    for module_name, qualified, value in _public():
        if module_name != section:
            section = module_name
            module = importlib.import_module(module_name)
            lines += [f"## `{module_name}`", "", _doc(module).split("\n\n")[0], ""]
        lines += _entry(qualified, value)
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Warnings are errors: an undocumented name or argument fails the build.
    found = problems()
    for problem in found:
        print(f"docs/make_api_reference.py: {problem}")
    if found:
        return 1
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
