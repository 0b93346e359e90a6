"""Every example notebook runs top to bottom (KERAS_DUQ_SMOKE=1: small data, few epochs)."""

from pathlib import Path

import pytest

# The notebooks use TensorFlow (tf.data, tensorflow-datasets, SavedModel).
pytestmark = pytest.mark.requires_backend("tensorflow")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "examples" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))


def test_there_are_notebooks_with_committed_outputs():
    import nbformat

    assert len(NOTEBOOKS) >= 3
    for path in NOTEBOOKS:
        assert path.stat().st_size < 1_000_000, path
        notebook = nbformat.read(path, as_version=4)
        code_cells = [cell for cell in notebook.cells if cell.cell_type == "code"]
        # Committed from a normal (not smoke) run, so that they read well.
        assert all(cell.get("execution_count") for cell in code_cells), path.name
        assert not any(
            output.get("output_type") == "error"
            for cell in code_cells
            for output in cell.get("outputs", [])
        ), path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_smoke_mode(
    path, monkeypatch, tmp_path, fashion_mnist_dir, mnist_dir
):
    import nbclient
    import nbformat

    # The notebooks keep their files (images, the exported model) in a
    # `tempfile.mkdtemp` folder for the reader to serve; here they land in
    # pytest's temporary folder, which pytest prunes.
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("KERAS_DUQ_SMOKE", "1")
    monkeypatch.setenv("KERAS_DUQ_DATA", str(mnist_dir.parent))
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(NOTEBOOK_DIR)}},
    )
    client.execute()  # raises CellExecutionError, with the cell, on any failure
