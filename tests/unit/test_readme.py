"""The README's figures are what scripts/readme_figures.sh printed (docs/readme_figures.txt):
each line it shows is in the README as it printed it."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_shows_the_figures_the_refresh_script_printed():
    printed = (ROOT / "docs" / "readme_figures.txt").read_text().splitlines()
    shown = [line for line in printed if line and not line.startswith("#")]
    assert len(shown) >= 6  # the dense demo's steps and reward, the MoE's, the tool demo's
    readme = (ROOT / "README.md").read_text()
    assert [line for line in shown if line not in readme] == []
