"""Building the row-product kernel: what it needs from the environment."""

from specdraft.models import rowgemm


def test_ninja_beside_the_interpreter_goes_on_path(tmp_path, monkeypatch):
    """An unactivated environment (``.venv/bin/python``) still finds the ninja its wheel installed."""
    (tmp_path / "ninja").write_text("")
    monkeypatch.setattr(rowgemm.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", "/nowhere")
    rowgemm._put_ninja_on_path()
    rowgemm._put_ninja_on_path()  # once only
    assert rowgemm.os.environ["PATH"].split(rowgemm.os.pathsep) == [str(tmp_path), "/nowhere"]
