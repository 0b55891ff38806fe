"""Join tokens: the decisions (pure), and their whole life on the in-memory store and on a real etcd: made,
listed, spent to the last use and no further (also when spends race), refused when expired, deleted or
wrong, and the secret never stored.
"""

from __future__ import annotations

import asyncio

import pytest

from daemon.join_tokens import (
    MAX_TOKENS,
    JoinToken,
    TokenProblem,
    TokenRecord,
    TokenRefused,
    after_use,
    create_token,
    delete_token,
    list_tokens,
    new_record,
    parse_token,
    refusal,
    spend_token,
)
from daemon.store import keys
from daemon.store.interface import Store
from tests.store.backends import Backend, MemoryBackend, run

NOW = 1_800_000_000.0
TOKEN = JoinToken("abc123", "0123456789abcdef")


def test_a_token_is_refused_when_unknown_wrong_expired_or_spent() -> None:
    record = new_record(TOKEN, NOW, 3600, 2)
    assert refusal(record, TOKEN, NOW) is None
    assert refusal(None, TOKEN, NOW) == "join token abc123 is unknown or was deleted"
    assert refusal(record, JoinToken("abc123", "fedcba9876543210"), NOW) == refusal(None, TOKEN, NOW)
    assert refusal(record, TOKEN, NOW + 3600) == "join token abc123 has expired"
    spent = TokenRecord("abc123", record.secret_sha256, NOW, NOW + 3600, 0)
    assert refusal(spent, TOKEN, NOW) == "join token abc123 is spent"


def test_uses_count_down_to_spent() -> None:
    record = new_record(TOKEN, NOW, 60, 2)
    once = after_use(record)
    assert once.uses_left == 1
    assert refusal(after_use(once), TOKEN, NOW) == "join token abc123 is spent"
    unlimited = new_record(TOKEN, NOW, 60, None)
    assert after_use(unlimited) == unlimited


def test_terms_out_of_range_and_malformed_tokens_are_one_line_refusals() -> None:
    with pytest.raises(TokenProblem, match="at most 7 days"):
        new_record(TOKEN, NOW, 8 * 86400, 1)
    with pytest.raises(TokenProblem, match="1 to 10000 uses"):
        new_record(TOKEN, NOW, 60, 0)
    with pytest.raises(TokenRefused, match="not a token") as refused:
        parse_token("abc123.short")
    assert "short" not in str(refused.value)  # a mistyped secret is never echoed
    assert parse_token(f" {TOKEN} \n") == TOKEN
    assert TOKEN.secret not in repr(TOKEN)


def test_token_life_on_the_store(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        token, record = await create_token(store, NOW, 3600, 2)
        stored = await store.get(keys.join_token(token.id))
        assert stored is not None and token.secret.encode() not in stored.value
        assert [r.id for r in await list_tokens(store, NOW)] == [token.id]
        await spend_token(store, token, NOW + 1)
        await spend_token(store, token, NOW + 2)
        with pytest.raises(TokenRefused, match="is spent"):
            await spend_token(store, token, NOW + 3)
        assert [r.uses_left for r in await list_tokens(store, NOW)] == [0]  # until it expires
        await delete_token(store, token.id)

        short, _ = await create_token(store, NOW, 60, None)
        with pytest.raises(TokenRefused, match="has expired"):
            await spend_token(store, short, NOW + 60)
        assert await list_tokens(store, NOW + 61) == []  # listing removes what expired
        assert await store.get(keys.join_token(short.id)) is None

        deleted, _ = await create_token(store, NOW, 60, None)
        await delete_token(store, deleted.id)
        with pytest.raises(TokenRefused, match="unknown or was deleted"):
            await spend_token(store, deleted, NOW)
        with pytest.raises(TokenProblem, match="no join token"):
            await delete_token(store, deleted.id)

    run(backend, scenario)


def test_a_one_use_token_is_spent_once_whoever_races_for_it(backend: Backend) -> None:
    async def scenario(store: Store) -> None:
        token, _ = await create_token(store, NOW, 3600, 1)
        results = await asyncio.gather(*(spend_token(store, token, NOW) for _ in range(6)), return_exceptions=True)
        assert sum(result is None for result in results) == 1
        assert all(isinstance(result, TokenRefused) for result in results if result is not None)

    run(backend, scenario)


def test_live_tokens_are_bounded() -> None:
    async def scenario(store: Store) -> None:
        for _ in range(MAX_TOKENS):
            await create_token(store, NOW, 60, 1)
        with pytest.raises(TokenProblem, match=f"{MAX_TOKENS} join tokens are live"):
            await create_token(store, NOW, 60, 1)
        await create_token(store, NOW + 60, 60, 1)  # once they expired there is room again

    run(MemoryBackend(), scenario)
