"""Media types (``type/subtype``, RFC 6838) as an attachment records them.

An upload declares one, or it is guessed from the file name's extension, or
it is ``application/octet-stream``. Lower case, no parameters, at most 255
characters: what the machine stores, backs up and gives back.
"""

from __future__ import annotations

import mimetypes
import re
from typing import Final

from shared.errors import InvalidArgument

__all__ = ["DEFAULT_MEDIA_TYPE", "MAX_MEDIA_TYPE", "check_media_type", "media_type_for"]

#: What an upload with no declared media type and an unknown file name is.
DEFAULT_MEDIA_TYPE: Final = "application/octet-stream"
#: The longest media type accepted (RFC 6838: 127 characters each side of the slash).
MAX_MEDIA_TYPE: Final = 255
# RFC 6838 restricted-name, both sides; no parameters (";charset=...").
_MEDIA_TYPE: Final = re.compile(
    r"[a-z0-9][a-z0-9!#$&^_.+-]{0,126}/[a-z0-9][a-z0-9!#$&^_.+-]{0,126}"
)


def media_type_for(declared: str, file_name: str) -> str:
    """The media type to record: ``declared`` (lower-cased) when given, else the one
    the file name's extension suggests, else :data:`DEFAULT_MEDIA_TYPE`.

    InvalidArgument (field ``media_type``) for a declared one that is not
    ``type/subtype`` or is longer than :data:`MAX_MEDIA_TYPE`.
    """
    if declared:
        if len(declared) > MAX_MEDIA_TYPE:
            raise InvalidArgument("media_type", f"longer than {MAX_MEDIA_TYPE} characters")
        return check_media_type(declared.strip().lower())
    guessed = (mimetypes.guess_type(file_name, strict=False)[0] or "").lower()
    return guessed if _MEDIA_TYPE.fullmatch(guessed) else DEFAULT_MEDIA_TYPE


def check_media_type(value: str, field: str = "media_type") -> str:
    """Return ``value`` if it is a media type as stored (lower case, no
    parameters, at most :data:`MAX_MEDIA_TYPE`), else raise InvalidArgument."""
    if len(value) > MAX_MEDIA_TYPE or not _MEDIA_TYPE.fullmatch(value):
        raise InvalidArgument(field, "must be type/subtype (e.g. text/plain), without parameters")
    return value
