"""vqueue's Lua scripts, one file each under ``protocol/lua/``, and what every store stands on.

A script names the files it builds on in its opening comment (``-- uses: marks, claim_one``);
they are put before it as it is loaded. Redis runs a script whole, so each step that must not
interleave with another process (claim and push, start, record, forget) is one file read top to
bottom, its ``KEYS`` and ``ARGV`` written at its head.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import redis
from redis.commands.core import Script

LUA = Path(__file__).with_name("lua")
# Redis 7 reads a script's flags from its first line; this one lets it write when Redis is out of
# memory. Redis 6 reads no flags and refuses to load a script that has them.
ALLOW_OOM = "#!lua flags=allow-oom\n"


@functools.cache
def source(name: str) -> str:
    """The text Redis runs for ``protocol/lua/<name>.lua``: the files it uses, then its own."""
    text = (LUA / f"{name}.lua").read_text()
    uses: list[str] = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        if line.startswith("-- uses:"):
            uses = [u.strip() for u in line.removeprefix("-- uses:").split(",") if u.strip()]
    return "".join(source(u) for u in uses) + text


def names() -> list[str]:
    return sorted(p.stem for p in LUA.glob("*.lua"))


class StoreBase:
    """A Redis client, the key prefix and the results' lifetime, with every script registered
    by name (``self.lua["record"]``). Each store of a concept (``protocol.batches``,
    ``protocol.feeds``, ...) is a part of ``protocol.store.BatchStore`` built on this."""

    def __init__(self, client: redis.Redis, prefix: str = "vqueue", ttl_s: int = 7 * 24 * 3600):
        self.r = client
        self.prefix = prefix
        self.ttl_s = ttl_s
        self.lua: dict[str, Script] = {n: client.register_script(source(n)) for n in names()}

    def key(self, batch: str, part: str = "") -> str:
        return f"{self.prefix}:batch:{batch}" + (f":{part}" if part else "")

    def run_scripts(self, calls: list[tuple[Script, list[str], list[Any]]]) -> list[Any]:
        """Each (script, keys, args) in one round trip, its answer or its error in order.
        By ``EVALSHA`` alone: a redis-py pipeline that holds scripts first asks Redis whether
        it has them (``SCRIPT EXISTS``), a second round trip every time. A script Redis does
        not have (it restarted) answers NOSCRIPT and ran nothing, so those calls alone go
        again once it is loaded."""
        answers: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for _ in range(2):
            pipe = self.r.pipeline(transaction=False)
            for i in todo:
                script, keys, args = calls[i]
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            for i, answer in zip(todo, pipe.execute(raise_on_error=False), strict=True):
                answers[i] = answer
            todo = [i for i in todo if isinstance(answers[i], redis.exceptions.NoScriptError)]
            if not todo:
                break
            for script in {id(calls[i][0]): calls[i][0] for i in todo}.values():
                self.r.script_load(script.script)
        return answers
