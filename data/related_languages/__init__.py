"""Synthetic languages in families related by design (``family.py``), written from the English of
a prepared gettext corpus and prepared like one (``build.py``; see README.md)."""
