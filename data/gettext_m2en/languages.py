"""Language names: a locale name (``de_DE.UTF-8``, ``pt_BR``, ``sr@Latin``) to the corpus's tag.

Used on catalog paths (``<lang>/LC_MESSAGES/x.mo``, ``admin-fr_FR.mo``) and on the user's
corpora; English and names that are not languages give None.
"""

from __future__ import annotations

import re
from pathlib import Path

# A locale name after normalisation: language, optional script or region, optional modifier
# (sr@latin, ca@valencia are different written languages and stay distinct).
_LANG_RE = re.compile(r"^[a-z]{2,3}(?:_(?:[A-Z]{2}|[0-9]{3}|[A-Z][a-z]{3}))?(?:@[a-z]+)?$")
# Locale embedded in a file name, as WordPress ships them: admin-network-pt_BR.mo, fr_FR.mo.
_FILENAME_LANG_RE = re.compile(r"(?:^|-)([a-z]{2,3}(?:_[A-Za-z]{2,4})?(?:@[a-z]+)?)$")

# Regions that are the default for their language, so `de_DE` and `de` count as one language
# while `pt_BR`, `es_MX`, `zh_TW`, `bn_IN`, `fr_CA` stay separate. A region equal to the
# language code upper-cased (de_DE, fr_FR, it_IT, ...) is always treated as the default.
DEFAULT_REGIONS: dict[str, str] = {
    "am": "ET", "ar": "SA", "be": "BY", "bn": "BD", "bs": "BA", "ca": "ES", "cs": "CZ",
    "cy": "GB", "da": "DK", "el": "GR", "et": "EE", "eu": "ES", "fa": "IR", "ga": "IE",
    "gl": "ES", "gu": "IN", "he": "IL", "hi": "IN", "hy": "AM", "ja": "JP", "jv": "ID",
    "ka": "GE", "kk": "KZ", "km": "KH", "kn": "IN", "ko": "KR", "lo": "LA", "ml": "IN",
    "mr": "IN", "ms": "MY", "my": "MM", "nb": "NO", "ne": "NP", "nn": "NO", "or": "IN",
    "pa": "IN", "pt": "PT", "si": "LK", "sl": "SI", "sq": "AL", "sr": "RS", "su": "ID",
    "sv": "SE", "sw": "TZ", "ta": "IN", "te": "IN", "ug": "CN", "uk": "UA", "ur": "PK",
    "uz": "UZ", "vi": "VN", "zu": "ZA", "af": "ZA", "ks": "IN", "ku": "TR", "as": "IN",
    "mai": "IN", "kab": "DZ", "ast": "ES", "oc": "FR", "br": "FR", "tt": "RU", "ky": "KG",
}  # fmt: skip


def normalize_lang(code: str) -> str | None:
    """Canonical language tag of a locale name, or None for English and non-languages.

    `de_DE.UTF-8` -> `de`, `pt_BR` -> `pt_BR`, `pt_PT` -> `pt`, `sr@Latin` -> `sr@latin`,
    `en_GB` -> None (English is the target side), `C` -> None.
    """
    code = code.strip()
    modifier = ""
    if "@" in code:
        code, modifier = code.split("@", 1)
        modifier = "@" + modifier.lower()
    code = code.split(".", 1)[0]  # drop a charset such as .UTF-8 or .GB2312
    parts = code.replace("-", "_").split("_")
    language = parts[0].lower()
    region = ""
    if len(parts) > 1 and parts[1]:
        region = parts[1]
        # Scripts are title case (Latn, Hans), regions upper case (BR).
        region = region.title() if len(region) == 4 else region.upper()
    if language == "en":
        return None
    if region and (region == language.upper() or DEFAULT_REGIONS.get(language) == region):
        region = ""
    tag = language + ("_" + region if region else "") + modifier
    return tag if _LANG_RE.match(tag) else None


def language_of_catalog(path: Path) -> str | None:
    """Language of a `.mo` file, from `<lang>/LC_MESSAGES/x.mo` or a file name like `admin-fr_FR.mo`."""
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "LC_MESSAGES":
        return normalize_lang(parts[-3])
    match = _FILENAME_LANG_RE.search(path.stem)
    return normalize_lang(match.group(1)) if match else None

