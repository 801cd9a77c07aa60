"""One redaction policy for everything trackdiag sends out of the process or writes to disk.

A value is hidden when its **key** looks secret (``password``, ``api_key``, ``WANDB_API_KEY``,
``db.Password``, ``authToken``...), or a **shape** inside any string gives it away wherever it sits:
URL userinfo (``https://user:pass@host`` keeps ``user``), ``Bearer``/``Basic`` credentials,
``Authorization:`` headers, ``password=...``-style pairs (query strings, connection strings, Hydra
overrides in run names), and common token formats (OpenAI ``sk-``, GitHub ``ghp_``/``github_pat_``,
Slack ``xox?-``, AWS ``AKIA``, Google ``AIza``, Hugging Face ``hf_``, GitLab ``glpat-``, JWTs, PEM
private keys). Long hex/base64 strings are hidden only under weakly suspicious keys (``key``,
``sig``, ``salt``...). ``None`` and empty values stay visible ("not set" leaks nothing).

Keys are normalised before matching: camelCase split, lower case, other characters as ``_``
(``apiKey``, ``API-KEY`` and ``api_key`` all read ``api_key``). Configure it with the diag config's
``redact`` section: ``enabled`` (default true), ``keys`` (extra regexes searched in the normalised
key and in its dotted path, e.g. ``db\\.host``), ``patterns`` (extra regexes for secret text; each
match is masked). Applied once, where a run's hyperparameters, diag config and name enter the
session (:class:`trackdiag.core.runinfo.RunInfo`), so every sink gets the same redacted data; and to
every message of the ``trackdiag`` logger (:class:`RedactingFilter`: a tracking URI with
credentials in a warning reads ``http://user:***redacted***@host``).
Cost: a few regex searches per key (cached) and per string value; linear in the text's length.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

MASK = "***redacted***"

#: Regexes (searched in the normalised key) that make a key secret.
DEFAULT_KEYS: tuple[str, ...] = (
    r"pass(word|wd|phrase)", r"secret", r"credential", r"api_?key", r"(^|_)pwd($|_)",
    r"(access|private|secret|session|signing|encryption|master|client|ssh|license)_?key",
    r"(^|_)(o?auth|authorization|authentication)($|_)", r"(^|_)cookies?($|_)",
    r"(?<!pad_)(?<!bos_)(?<!eos_)(?<!unk_)(?<!sep_)(?<!cls_)(?<!mask_)token$",  # not a tokenizer's pad_token
)
#: Keys under which a long hex/base64 value is taken for a secret.
WEAK_KEYS = re.compile(r"(^|_)(key|sig|signature|salt|hmac|nonce)$")
_OPAQUE = re.compile(r"(?=[^\s]*\d)(?=[^\s]*[A-Za-z])(?:[0-9a-fA-F]{32,}|[A-Za-z0-9+/_\-]{32,}={0,2})")

#: Token formats hidden wherever they appear.
DEFAULT_PATTERNS: tuple[str, ...] = (
    r"\bsk-(?:proj-|ant-|live-|test-)?[A-Za-z0-9_\-]{20,}",
    r"\bgh[pousr]_[A-Za-z0-9]{30,}", r"\bgithub_pat_[A-Za-z0-9_]{30,}",
    r"\bxox[abposr]-[A-Za-z0-9\-]{10,}",
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b",
    r"\bAIza[0-9A-Za-z_\-]{35}", r"\bhf_[A-Za-z0-9]{30,}", r"\bglpat-[A-Za-z0-9_\-]{20,}",
    r"\beyJ[A-Za-z0-9_\-]{5,}\.eyJ[A-Za-z0-9_\-]{5,}\.[A-Za-z0-9_\-]{5,}",  # JWT
    r"-----BEGIN [A-Z ]{0,40}PRIVATE KEY-----[\s\S]{0,20000}?-----END [A-Z ]{0,40}PRIVATE KEY-----",
)
_USERINFO = re.compile(r"\b([a-zA-Z][a-zA-Z0-9+.\-]{0,30}://)([^\s:/@]{0,200}):([^\s/@]{1,500})@")
_SCHEME = re.compile(r"(?i)\b(bearer|basic)\s+(?=[A-Za-z0-9\-._~+/]{0,500}[0-9+/=])[A-Za-z0-9\-._~+/]{8,}=*")
_PAIR = re.compile(r"([A-Za-z_][\w.\-]{0,100})(=|:(?!//)[ \t]*)((?:Bearer|Basic)[ \t]+[^\s&;,]+|[^\s&;,]+)")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NON_ALNUM = re.compile(r"[^a-z0-9]+")


def normalise_key(key: str) -> str:
    """``apiKey`` / ``API-KEY`` / ``api key`` -> ``api_key``: what key patterns are matched against."""
    return _NON_ALNUM.sub("_", _CAMEL.sub("_", key).lower()).strip("_")


#: ``secret_key``'s verdicts per set of user key regexes (the defaults are fixed), shared by the policies that
#: have them: every session redacts the same config keys, ~2,000 look-ups
_KEY_VERDICTS: dict[tuple[str, ...], dict[tuple[str, str], bool]] = {}


@dataclass(frozen=True)
class RedactPolicy:
    """What to hide, by key name and by value shape. Immutable; ``redact`` returns new containers.

    enabled: False turns every method into the identity. keys / patterns: regexes added to
    :data:`DEFAULT_KEYS` / :data:`DEFAULT_PATTERNS` (case-insensitive).
    """

    enabled: bool = True
    keys: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    _key_res: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _user_key_res: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _value_res: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _cache: dict[tuple[str, str], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "keys", tuple(self.keys))
        set_(self, "patterns", tuple(self.patterns))
        set_(self, "_key_res", tuple(re.compile(p, re.I) for p in DEFAULT_KEYS))
        set_(self, "_user_key_res", tuple(re.compile(p, re.I) for p in self.keys))
        set_(self, "_value_res", tuple(re.compile(p, re.I if p in self.patterns else 0)
                                       for p in (*DEFAULT_PATTERNS, *self.patterns)))
        set_(self, "_cache", _KEY_VERDICTS.setdefault(self.keys, {}))  # shared: every session asks the same keys

    @classmethod
    def from_config(cls, section: Any) -> "RedactPolicy":
        """The policy of a validated diag config's ``redact`` section (None: the defaults)."""
        section = section if isinstance(section, Mapping) else {}
        return cls(enabled=bool(section.get("enabled", True)), keys=tuple(section.get("keys") or ()),
                   patterns=tuple(section.get("patterns") or ()))

    def extended(self, keys: Iterable[str] = ()) -> "RedactPolicy":
        """This policy with more key regexes (the W&B sink's ``redact`` option)."""
        return RedactPolicy(self.enabled, (*self.keys, *keys), self.patterns)

    # ------------------------------------------------------------------ keys
    def secret_key(self, key: str, path: Sequence[str] = ()) -> bool:
        """True if ``key`` (at dotted ``path``, which ends with it) names a secret."""
        dotted = ".".join(normalise_key(p) for p in path) if path else ""
        hit = self._cache.get((key, dotted))
        if hit is None:
            norm = normalise_key(key)
            hit = any(r.search(norm) for r in self._key_res) or any(
                r.search(norm) or (dotted and r.search(dotted)) for r in self._user_key_res)
            if len(self._cache) < 100_000:
                self._cache[(key, dotted)] = hit
        return bool(hit)

    # ------------------------------------------------------------------ values
    def text(self, value: str) -> str:
        """``value`` with every secret-shaped part masked (URL passwords, credentials, tokens)."""
        if not self.enabled or not value:
            return value
        out = _USERINFO.sub(lambda m: f"{m.group(1)}{m.group(2)}:{MASK}@", value)
        out = _SCHEME.sub(lambda m: f"{m.group(1)} {MASK}", out)
        for r in self._value_res:
            out = r.sub(MASK, out)
        if "=" in out or ":" in out:
            out = _PAIR.sub(self._pair, out)
        return out

    def _pair(self, m: re.Match[str]) -> str:
        key = m.group(1).rsplit(".", 1)[-1]
        if m.group(3) == MASK or not self.secret_key(key, tuple(m.group(1).split("."))):
            return m.group(0)
        return f"{m.group(1)}{m.group(2)}{MASK}"

    def redact(self, obj: Any, path: tuple[str, ...] = ()) -> Any:
        """A copy of ``obj`` (plain dicts/lists/scalars, acyclic) with secrets masked.

        A value under a secret key becomes :data:`MASK` (a whole sub-tree included); every other
        string is passed through :meth:`text`. Dict keys are scrubbed as text too.
        """
        if not self.enabled:
            return obj
        if isinstance(obj, Mapping):
            out: dict[Any, Any] = {}
            for k, v in obj.items():
                ks = str(k)
                here = (*path, ks)
                if v not in (None, "") and not isinstance(v, bool) and (self.secret_key(ks, here) or self._weak(ks, v)):
                    out[self.text(ks) if isinstance(k, str) else k] = MASK
                else:
                    out[self.text(k) if isinstance(k, str) else k] = self.redact(v, here)
            return out
        if isinstance(obj, (list, tuple)):
            return [self.redact(v, path) for v in obj]
        if isinstance(obj, str):
            return self.text(obj)
        return obj

    def _weak(self, key: str, value: Any) -> bool:
        return isinstance(value, str) and bool(WEAK_KEYS.search(normalise_key(key))) \
            and _OPAQUE.fullmatch(value.strip()) is not None


DEFAULT_POLICY = RedactPolicy()


def pattern_problems(path: str, patterns: Any) -> list[str]:
    """Config problems of a list of user regexes: not a list of strings, invalid, or matching ''."""
    if patterns is None:
        return []
    if not isinstance(patterns, list):
        return [f"{path}: expected a list of regular expressions, got {patterns!r}"]
    problems = []
    for i, p in enumerate(patterns):
        if not isinstance(p, str) or not p:
            problems.append(f"{path}[{i}]: expected a non-empty regular expression string, got {p!r}")
            continue
        try:
            compiled = re.compile(p, re.I)
        except re.error as exc:
            problems.append(f"{path}[{i}]: invalid regular expression {p!r}: {exc}")
            continue
        if compiled.search("") is not None:
            problems.append(f"{path}[{i}]: {p!r} matches the empty string (it would mask everything)")
    return problems


class RedactingFilter(logging.Filter):
    """Masks secret shapes (:meth:`RedactPolicy.text`) in each record of the logger it is attached to.

    Cost: only when a record is emitted: one formatting of its message and the value regexes.
    """

    def __init__(self, policy: RedactPolicy = DEFAULT_POLICY) -> None:
        super().__init__()
        self.policy = policy

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken format: let logging report it as usual
            return True
        clean = self.policy.text(message)
        if clean != message:
            record.msg, record.args = clean, None
        return True


def install_log_filter(name: str = "trackdiag") -> None:
    """Attach one :class:`RedactingFilter` to the logger ``name`` (idempotent)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, RedactingFilter) for f in logger.filters):
        logger.addFilter(RedactingFilter())


install_log_filter()
