"""paper_figs' SUMMARY.md: every figure's section in order, with the time of its last run."""

import importlib

main = importlib.import_module("paper_figs.__main__")


def test_a_figure_not_run_now_keeps_its_earlier_time(tmp_path, monkeypatch):
    monkeypatch.setattr(main, "OUT_DIR", tmp_path)
    for name in ("fig1_diana", "fig2_terngrad"):
        (tmp_path / f"{name}.md").write_text(f"## {name}\n")
    (tmp_path / "SUMMARY.md").write_text(main.summary({"fig1_diana": 55.0, "fig2_terngrad": 9.0}))
    text = main.summary({"fig2_terngrad": 12.0})  # only figure 2 ran now
    assert "_fig1_diana.py (ran in 55 s)_" in text and "_fig2_terngrad.py (ran in 12 s)_" in text
    assert text.index("## fig1_diana") < text.index("## fig2_terngrad")
    (tmp_path / "SUMMARY.md").unlink()
    assert "_fig1_diana.py_" in main.summary({})  # no earlier time known
