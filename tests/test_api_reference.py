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
        assert f"### `keras_duq.{name}`" in text, name
    for name in ("evaluation.ood_metrics", "callbacks.HealthCheck", "tuning.search"):
        assert f"### `keras_duq.{name}`" in text, name
