"""Data preparation: Debian packages and image folders to the formats the apps read.

The layer below the apps: nothing here imports ``apps``, ``scripts`` or ``gpipe_core``.
"""
