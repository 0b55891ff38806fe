"""Join tokens: how a new host gets its node certificate without files copied from the head host
(kubeadm's bootstrap tokens are the model).

A token is `ID.SECRET`: ID (6 characters) names it, SECRET (16) proves it. etcd keeps, under
`keys.join_token(ID)`, a SHA-256 of the secret, never the secret, with the token's expiry and the uses it
has left; a spend is a compare-and-swap on that record, so two agents racing with a `--uses 1` token
cannot both win. A spent, expired or deleted token is refused in one line that says which, and the secret
is never logged (`JoinToken.__repr__` hides it). Expired records are deleted whenever tokens are listed or
made, and at most MAX_TOKENS live at once: nothing here grows without bound.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from dataclasses import dataclass

from daemon.errors import PermanentError
from daemon.store import codec, keys
from daemon.store.interface import Store

ID_LENGTH, SECRET_LENGTH = 6, 16
_ALPHABET = string.ascii_lowercase + string.digits
_TOKEN = re.compile(rf"([a-z0-9]{{{ID_LENGTH}}})\.([a-z0-9]{{{SECRET_LENGTH}}})")
MAX_TOKENS = 100
MAX_TTL_S = 7 * 86400.0
MAX_USES = 10_000
# Tries of a spend that lost its compare-and-swap to another spend of the same token.
SPEND_ATTEMPTS = 8


class TokenRefused(PermanentError):
    """The join token cannot be used (malformed, unknown or deleted, expired, spent): ask the operator for a
    new one (`trainerctl tokens create`)."""


class TokenProblem(PermanentError):
    """A token cannot be made or deleted as asked (a TTL or a number of uses out of range, too many tokens,
    no such token)."""


@dataclass(frozen=True)
class JoinToken:
    id: str
    secret: str

    def __str__(self) -> str:
        return f"{self.id}.{self.secret}"

    def __repr__(self) -> str:  # a token in a log or a traceback must not be usable
        return f"JoinToken(id={self.id!r}, secret=...)"


@dataclass(frozen=True)
class TokenRecord:
    """What etcd keeps of a token. `uses_left` None: any number of uses until it expires."""

    id: str
    secret_sha256: str
    created_at: float
    expires_at: float
    uses_left: int | None

    def to_json(self) -> dict:
        return {"id": self.id, "secret_sha256": self.secret_sha256, "created_at": self.created_at,
                "expires_at": self.expires_at, "uses_left": self.uses_left}

    @classmethod
    def from_json(cls, data: dict) -> "TokenRecord":
        return cls(str(data["id"]), str(data["secret_sha256"]), float(data["created_at"]),
                   float(data["expires_at"]), None if data["uses_left"] is None else int(data["uses_left"]))


def parse_token(text: str) -> JoinToken:
    """The token in `text`; TokenRefused naming no part of it when it is not ID.SECRET."""
    match = _TOKEN.fullmatch(text.strip())
    if match is None:
        raise TokenRefused(f"the join token is not a token: {ID_LENGTH} and {SECRET_LENGTH} lower-case letters "
                           f"or digits joined by a dot")
    return JoinToken(*match.groups())


def new_token() -> JoinToken:
    return JoinToken("".join(secrets.choice(_ALPHABET) for _ in range(ID_LENGTH)),
                     "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LENGTH)))


def secret_hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_record(token: JoinToken, now: float, ttl_s: float, uses: int | None) -> TokenRecord:
    """The record of a new token; TokenProblem for a TTL or uses out of range."""
    if not 0 < ttl_s <= MAX_TTL_S:
        raise TokenProblem(f"a token lives more than 0 s and at most {MAX_TTL_S / 86400:.0f} days, not {ttl_s:g} s")
    if uses is not None and not 1 <= uses <= MAX_USES:
        raise TokenProblem(f"a token has 1 to {MAX_USES} uses, not {uses}")
    return TokenRecord(token.id, secret_hash(token.secret), now, now + ttl_s, uses)


def refusal(record: TokenRecord | None, token: JoinToken, now: float) -> str | None:
    """Why `token` cannot be spent against `record` (None: it can). Pure: the spend and its tests decide
    with it. An unknown id and a wrong secret read alike, so a guess learns nothing."""
    if record is None or not hmac.compare_digest(record.secret_sha256, secret_hash(token.secret)):
        return f"join token {token.id} is unknown or was deleted"
    if now >= record.expires_at:
        return f"join token {token.id} has expired"
    if record.uses_left is not None and record.uses_left < 1:
        return f"join token {token.id} is spent"
    return None


def after_use(record: TokenRecord) -> TokenRecord:
    """The record once one use is spent. A spent record stays until it expires, so that its token is refused
    as spent, not as unknown."""
    if record.uses_left is None:
        return record
    return TokenRecord(record.id, record.secret_sha256, record.created_at, record.expires_at, record.uses_left - 1)


async def list_tokens(store: Store, now: float) -> list[TokenRecord]:
    """The live tokens, oldest first; expired ones are deleted on the way."""
    entries, _ = await store.get_prefix(keys.JOIN_TOKENS)
    live = []
    for entry in entries:
        record = TokenRecord.from_json(codec.decode(entry.value, key=entry.key))
        if now >= record.expires_at:
            await store.delete(entry.key, entry.mod_revision)
        else:
            live.append(record)
    return sorted(live, key=lambda r: r.created_at)


async def create_token(store: Store, now: float, ttl_s: float, uses: int | None) -> tuple[JoinToken, TokenRecord]:
    """A new token, recorded; TokenProblem when MAX_TOKENS live already or the terms are out of range."""
    if len(await list_tokens(store, now)) >= MAX_TOKENS:
        raise TokenProblem(f"{MAX_TOKENS} join tokens are live, the most allowed: delete some "
                           f"(`trainerctl tokens delete ID`) or let them expire")
    while True:
        token = new_token()
        record = new_record(token, now, ttl_s, uses)
        if await store.compare_and_swap(keys.join_token(token.id), codec.encode(record.to_json()), 0) is not None:
            return token, record  # else that id is taken: draw another


async def delete_token(store: Store, token_id: str) -> None:
    """TokenProblem when there is no such token."""
    if not re.fullmatch(rf"[a-z0-9]{{{ID_LENGTH}}}", token_id) or not await store.delete(keys.join_token(token_id)):
        raise TokenProblem(f"no join token {token_id[:20]!r}")


async def spend_token(store: Store, token: JoinToken, now: float) -> None:
    """Spend one use of `token`; TokenRefused when it cannot be. A compare-and-swap (or a delete at the
    revision read) per try, so each use is spent once whoever races for it."""
    key = keys.join_token(token.id)
    for _ in range(SPEND_ATTEMPTS):
        entry = await store.get(key)
        record = None if entry is None else TokenRecord.from_json(codec.decode(entry.value, key=key))
        reason = refusal(record, token, now)
        if reason is not None:
            raise TokenRefused(reason)
        assert entry is not None and record is not None
        spent = after_use(record)
        if spent is record:
            return
        if await store.compare_and_swap(key, codec.encode(spent.to_json()), entry.mod_revision) is not None:
            return
    raise TokenRefused(f"join token {token.id} is being spent by others at once; try again")
