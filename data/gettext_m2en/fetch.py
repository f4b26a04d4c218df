"""Phase 1, fetch: Debian packages downloaded and unpacked (no install), their catalogs found.

Packages come with ``apt-get download`` and ``dpkg-deb -x`` into the corpus folder; when apt is
unavailable, the catalogs installed under ``/usr/share/locale`` stand in for them.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from data.gettext_m2en.errors import PrepareError
from data.gettext_m2en.languages import language_of_catalog

QUICK_PACKAGES: tuple[str, ...] = ("vlc-l10n", "libgtk-3-common", "cinnamon-l10n")
FULL_PACKAGES: tuple[str, ...] = QUICK_PACKAGES + (
    "evolution-common",
    "pidgin-data",
    "gnucash-common",
    "gnome-control-center-data",
    "wordpress-l10n",
    "krita-l10n",
    "gnumeric-common",
    "nautilus-data",
    "libglib2.0-data",
)
PACKAGE_LISTS: dict[str, tuple[str, ...]] = {"quick": QUICK_PACKAGES, "full": FULL_PACKAGES}
SYSTEM_LOCALE_ROOT = Path("/usr/share/locale")
# (origin: a package, "system" or a locale root; language; path of the .mo file)
Catalog = tuple[str, str, Path]


def resolve_packages(packages: str | Sequence[str] | None) -> tuple[str, ...]:
    """`quick`, `full`, a comma-separated list or a sequence of Debian package names."""
    if packages is None:
        return ()
    if isinstance(packages, str):
        if packages in PACKAGE_LISTS:
            return PACKAGE_LISTS[packages]
        return tuple(name.strip() for name in packages.split(",") if name.strip())
    return tuple(packages)


def _run(cmd: Sequence[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, check=False)


def fetch_packages(
    packages: Sequence[str], deb_dir: Path, log: Callable[[str], None]
) -> list[Path]:
    """Download .debs with `apt-get download` (no install); already downloaded ones are reused."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise PrepareError("apt-get/dpkg-deb not found (not a Debian-like system)")
    deb_dir.mkdir(parents=True, exist_ok=True)

    def cached(name: str) -> Path | None:
        found = sorted(deb_dir.glob(f"{name}_*.deb"))
        return found[-1] if found else None

    missing = [name for name in packages if cached(name) is None]
    stderr = ""
    if missing:
        log(f"apt-get download {' '.join(missing)}")
        result = _run(["apt-get", "download", *missing], cwd=deb_dir)
        if result.returncode != 0:
            # Empty package lists are the usual cause on a fresh container.
            log("apt-get download failed; running apt-get update once")
            _run(["apt-get", "update"])
            result = _run(["apt-get", "download", *missing], cwd=deb_dir)
        stderr = result.stderr.strip()[-300:]
        if result.returncode != 0:
            # One unknown name fails the whole command: retry one by one to keep the others.
            for name in missing:
                if _run(["apt-get", "download", name], cwd=deb_dir).returncode != 0:
                    log(f"warning: could not download package {name!r}; skipping it")
    debs = [deb for name in packages if (deb := cached(name)) is not None]
    if not debs:
        raise PrepareError(f"apt-get download fetched none of {list(packages)}: {stderr}")
    return debs


def unpack_deb(deb: Path, dest: Path) -> Path:
    """Extract a .deb's files into `dest` with `dpkg-deb -x` (no system install)."""
    done = dest / ".unpacked"
    if done.exists() and done.read_text() == deb.name:
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    result = _run(["dpkg-deb", "-x", str(deb), str(dest)])
    if result.returncode != 0:
        raise PrepareError(f"dpkg-deb -x {deb} failed: {result.stderr.strip()}")
    done.write_text(deb.name)
    return dest


def find_catalogs(root: Path) -> list[tuple[str, Path]]:
    """All (language, path) of `.mo` catalogs under `root`, English and unknown names skipped."""
    found = []
    for path in sorted(root.rglob("*.mo")):
        lang = language_of_catalog(path)
        if lang is not None and path.is_file():
            found.append((lang, path))
    return found


def gather_catalogs(
    package_names: Sequence[str],
    locale_roots: Sequence[str | Path],
    out: Path,
    log: Callable[[str], None],
    *,
    has_user_corpora: bool,
) -> tuple[list[Catalog], list[str]]:
    """Every catalog of the packages (fetched under ``out``) and of ``locale_roots``; and the
    sources they came from, for the manifest (``deb:<file>``, ``locale:<root>``)."""
    catalogs: list[Catalog] = []
    sources_used: list[str] = []
    if package_names:
        try:
            for deb in fetch_packages(package_names, out / "debs", log):
                package = deb.name.split("_", 1)[0]
                tree = unpack_deb(deb, out / "unpacked" / package)
                catalogs.extend((package, lang, path) for lang, path in find_catalogs(tree))
                sources_used.append(f"deb:{deb.name}")
        except PrepareError as error:
            log(f"warning: {error}; falling back to catalogs under {SYSTEM_LOCALE_ROOT}")
            found = find_catalogs(SYSTEM_LOCALE_ROOT) if SYSTEM_LOCALE_ROOT.is_dir() else []
            if not found and not (locale_roots or has_user_corpora):
                raise PrepareError(
                    f"apt failed ({error}) and {SYSTEM_LOCALE_ROOT} holds no .mo catalogs; "
                    "give a corpus with --locale-root, --tsv or --aligned"
                ) from error
            catalogs.extend(("system", lang, path) for lang, path in found)
            sources_used.append(f"locale:{SYSTEM_LOCALE_ROOT}")
    for root in map(Path, locale_roots):
        if not root.is_dir():
            raise PrepareError(f"locale root {root} is not a directory")
        catalogs.extend((str(root), lang, path) for lang, path in find_catalogs(root))
        sources_used.append(f"locale:{root}")
    log(f"{len(catalogs)} catalogs")
    return catalogs, sources_used
