"""Many-to-English corpus from Debian's gettext catalogs; built by `prepare.py` (see README.md)."""
