"""docs/api.md is what docs/make_api_reference.py generates from the docstrings now."""

import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "make_api_reference.py"


def test_the_api_reference_is_current():
    script = runpy.run_path(str(SCRIPT))
    assert script["main"](["--check"]) == 0, (
        "docs/api.md is out of date: run python docs/make_api_reference.py"
    )


def test_the_api_reference_lists_every_public_name():
    import keras_duq

    text = (SCRIPT.parent / "api.md").read_text()
    for name in keras_duq.__all__:
        assert f"::: keras_duq.{name}\n" in text, name
    for name in ("evaluation.ood_metrics", "callbacks.HealthCheck", "tuning.search"):
        assert f"::: keras_duq.{name}\n" in text, name


def test_warnings_are_errors_an_undocumented_name_or_argument_fails_the_build():
    script = runpy.run_path(str(SCRIPT))

    def half_documented(x, y):
        """Does something.

        Args:
            x: a thing.
        """

    def undocumented(x):
        pass

    assert script["_problems"]("f", half_documented) == [
        "`f`'s `Args:` does not document ['y']"
    ]
    assert script["_problems"]("g", undocumented) == ["`g` has no docstring"]
    assert script["problems"]() == []  # the public API, as it is now
