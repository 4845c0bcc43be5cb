"""Signed artifacts: HMAC-SHA256 over an artifact's manifest, with a key CI and the serving fleet share.

The manifest (manifest.toml) lists the sha256 of every file of the artifact, so a signature
over its exact bytes covers the whole artifact: every manifest field and, through the hashes,
every file. The signature lives in its own file, `manifest.sig`, so the manifest stays plain
TOML that any tool can read:

    scheme = "hmac-sha256"
    key_id = "<16 hex>"            # which key signed (a hash of the key, never the key)
    manifest_sha256 = "<64 hex>"   # informative: what was signed
    hmac = "<64 hex>"              # HMAC-SHA256(key, DOMAIN + manifest.toml bytes)

The key (shared secret; anyone holding it can sign):
- TPUMK_SIGNING_KEY: the key itself, as text (e.g. `openssl rand -hex 32`); its UTF-8 bytes,
  surrounding whitespace stripped, are the HMAC key;
- TPUMK_SIGNING_KEY_FILE: a file holding that text (a mounted secret); the same rules.
Setting both, an empty value, a missing file or a key shorter than 16 bytes is an error.

`tpumk export` signs whenever a key is configured (there is no --sign flag: a configured key
means "this pipeline signs", and a cache hit on an unsigned artifact is refused rather than
silently passed on). With a key configured, verify/load/inspect refuse an unsigned artifact or
one signed with another key, before anything of it is deserialized. TPUMK_REQUIRE_SIGNED=1
makes a missing key an error too (a serving host whose secret failed to mount then refuses to
load instead of loading unauthenticated artifacts).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from tpumk.errors import ArtifactError, ConfigError, SignatureError, SigningKeyError
from tpumk.export.paths import os_reason, read_at_most
from tpumk.files import shown
from tpumk.tomlfile import parse_toml

KEY_ENV = "TPUMK_SIGNING_KEY"
KEY_FILE_ENV = "TPUMK_SIGNING_KEY_FILE"
REQUIRE_ENV = "TPUMK_REQUIRE_SIGNED"
SIGNATURE = "manifest.sig"
SCHEME = "hmac-sha256"
MIN_KEY_BYTES = 16
MAX_SIGNATURE_BYTES = 4096
_DOMAIN = b"tpumk artifact manifest v1\0"  # what a signature is over: never valid for other data


@dataclass(frozen=True)
class SigningKey:
    secret: bytes = field(repr=False)
    source: str  # where it came from, for messages: "TPUMK_SIGNING_KEY" or "TPUMK_SIGNING_KEY_FILE (path)"

    @property
    def key_id(self) -> str:
        """Names the key in signatures and messages: the first 16 hex digits of a sha256 of it."""
        return hashlib.sha256(b"tpumk signing key id\0" + self.secret).hexdigest()[:16]


def configured_key(environ: Mapping[str, str] | None = None) -> SigningKey | None:
    """The signing key from the environment, or None (SigningKeyError when misconfigured)."""
    env = os.environ if environ is None else environ
    text, source = env.get(KEY_ENV), KEY_ENV
    file = env.get(KEY_FILE_ENV)
    if text is not None and file is not None:
        raise SigningKeyError(f"both {KEY_ENV} and {KEY_FILE_ENV} are set: set one of them")
    if file is not None:
        source = f"{KEY_FILE_ENV} ({file})"
        from tpumk.files import KEY_LIMIT, read_regular

        def refused(msg: str) -> SigningKeyError:  # "PATH: why" -> one line naming the variable
            return SigningKeyError(f"{KEY_FILE_ENV}={shown(file)}: cannot read the signing key: "
                                   f"{msg.removeprefix(shown(file) + ': ')}")

        raw = read_regular(file, KEY_LIMIT, "expected a key file", refused)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SigningKeyError(f"{KEY_FILE_ENV}={shown(file)}: the signing key is not UTF-8 text (byte "
                                  f"0x{raw[e.start]:02x} at offset {e.start}); store it as text, e.g. "
                                  "`openssl rand -hex 32`") from None
    if text is None:
        if env.get(REQUIRE_ENV, "").strip() not in ("", "0"):
            raise SigningKeyError(f"{REQUIRE_ENV} is set but no signing key is configured: "
                                  f"set {KEY_ENV} or {KEY_FILE_ENV}")
        return None
    try:
        secret = text.strip().encode()
    except UnicodeEncodeError:  # bytes that are not UTF-8 in the environment (surrogate-escaped)
        raise SigningKeyError(f"{source}: the signing key is not UTF-8 text; store it as text, e.g. "
                              "`openssl rand -hex 32`") from None
    if not secret:  # e.g. a CI secret not set for this repository (a fork) expands to ""
        raise SigningKeyError(f"{source} is set but empty (a CI secret not set for this repository?): set it to a "
                              f"key, e.g. `openssl rand -hex 32`, or unset it to export unsigned artifacts")
    if len(secret) < MIN_KEY_BYTES:
        raise SigningKeyError(f"{source}: the signing key is {len(secret)} bytes, at least {MIN_KEY_BYTES} "
                              "are needed (e.g. `openssl rand -hex 32`)")
    return SigningKey(secret, source)


def _mac(key: SigningKey, manifest: bytes) -> str:
    return hmac.new(key.secret, _DOMAIN + manifest, hashlib.sha256).hexdigest()


def signature_text(manifest: bytes, key: SigningKey) -> str:
    """The contents of manifest.sig for these exact manifest bytes."""
    return ("# tpumk artifact signature: HMAC-SHA256 over manifest.toml (which lists every file's sha256)\n"
            f'scheme = "{SCHEME}"\n'
            f'key_id = "{key.key_id}"\n'
            f'manifest_sha256 = "{hashlib.sha256(manifest).hexdigest()}"\n'
            f'hmac = "{_mac(key, manifest)}"\n')


def read_signature(path: Path) -> dict[str, Any] | None:
    """The artifact's signature file, parsed (None when there is none)."""
    sig = path / SIGNATURE
    try:
        if not sig.exists() and not sig.is_symlink():
            return None
        if not sig.is_file() or sig.is_symlink():
            raise SignatureError(f"{sig}: not a regular file")
        data = read_at_most(sig, MAX_SIGNATURE_BYTES)
    except OSError as e:  # EACCES, EIO, ...: one line, not a traceback
        raise ArtifactError(f"{sig}: cannot read: {os_reason(e)}") from None
    if len(data) > MAX_SIGNATURE_BYTES:
        raise SignatureError(f"{sig}: more than {MAX_SIGNATURE_BYTES} bytes, not a signature file")
    try:
        doc = parse_toml(data, str(sig))
    except ConfigError as e:  # not UTF-8, bad syntax, nesting or integers the parser refuses
        raise SignatureError(f"{sig}: malformed signature file: {str(e).removeprefix(f'{sig}: ')}") from None
    for f in ("scheme", "key_id", "hmac"):
        if not isinstance(doc.get(f), str):
            raise SignatureError(f"{sig}: malformed signature file: missing '{f}'")
    if doc["scheme"] != SCHEME:
        raise SignatureError(f"{sig}: signature scheme {doc['scheme']!r}, this tpumk checks {SCHEME!r}")
    return doc


def check_signature(path: Path, manifest: bytes, key: SigningKey | None) -> dict[str, Any]:
    """Authenticate the manifest's exact bytes (before they are parsed). Returns what was proved:
    {"signed": bool, "verified": bool, "key_id": str | None}; SignatureError when a key is
    configured and the artifact is unsigned or its signature does not match."""
    sig = read_signature(path)
    if key is None:
        return {"signed": sig is not None, "verified": False, "key_id": sig["key_id"] if sig else None}
    if sig is None:
        raise SignatureError(f"{path}: not signed (no {SIGNATURE}) and {key.source} is set: refusing an "
                             "unauthenticated artifact (remove it and export it again with the key)")
    if not hmac.compare_digest(sig["key_id"].encode(), key.key_id.encode()):
        raise SignatureError(f"{path / SIGNATURE}: signed with key id {sig['key_id'][:16]!r}, the configured key "
                             f"({key.source}) has id {key.key_id}: another key")
    if not hmac.compare_digest(sig["hmac"].encode(), _mac(key, manifest).encode()):
        raise SignatureError(f"{path / SIGNATURE}: signature does not match manifest.toml (manifest altered)")
    return {"signed": True, "verified": True, "key_id": key.key_id}


def signing_record(key: SigningKey | None) -> dict[str, Any]:
    """The manifest's [signing] table (itself covered by the signature)."""
    if key is None:
        return {"signed": False}
    return {"signed": True, "scheme": SCHEME, "key_id": key.key_id, "file": SIGNATURE}
