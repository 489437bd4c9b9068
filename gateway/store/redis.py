"""The fleet session store: records shared by every gateway node in one Redis.

redis-py's asyncio client. Every write that must agree with what is stored
runs as one Lua script, so nothing is read-then-written across round trips:

- ``sandgate:sb:<id>``: a hash of ``record`` (the SandboxRecord's JSON),
  ``state``, ``node`` and ``version``; ``sandgate:sandboxes`` and
  ``sandgate:node:<node>:sandboxes`` are sets of ids (moved together with a
  record's node);
- ``sandgate:tenant:<name>``: a tenant's JSON (token hash only), created with
  SET NX, rewritten only if its token hash is still the one read (a script);
  ``sandgate:tenants`` the set of names;
- ``sandgate:nbs:<id>``: a Jupyter session's hash (``record``, ``owner``,
  ``path``); ``sandgate:nbpath:<owner>`` a hash path -> session id (who holds
  a path, taken in the same script that writes the session);
  ``sandgate:nbsessions`` the set of ids;
- ``sandgate:alive:<node>``: a node's heartbeat, with a TTL (node liveness);
  ``sandgate:nodes`` the set of nodes ever seen.

Keys carry an optional prefix (``SANDGATE_REDIS_PREFIX``) so that fleets, or
test runs, can share one Redis.

Secret values in records are sealed (store/seal.py) with a key derived from the
fleet key; ``sandgate:sealcheck`` holds that key's check value, so a node with
another key refuses to start. The URL goes to redis-py as it is: ``redis://user:
password@host`` for AUTH and ACL users, ``rediss://`` for TLS (the CA, and a
client certificate, from settings); it is never logged (``redact``).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Dict, List, Optional

from redis import asyncio as aioredis

from ..core.record import NotebookSessionRecord, SandboxRecord, TenantRecord
from ..core.states import State
from . import seal
from .base import SessionStore

log = logging.getLogger("sandgate.store")

# The record's JSON is stored as given (Lua's cjson would turn [] into {}); the
# authoritative version is the hash's field, laid over the record on reading.
# ARGV: record JSON, state, node, id, key prefix.
MOVE = """
local function move(old, new)
  if old and old ~= new then redis.call('SREM', ARGV[5] .. 'node:' .. old .. ':sandboxes', ARGV[4]) end
  redis.call('SADD', ARGV[5] .. 'node:' .. new .. ':sandboxes', ARGV[4])
end
"""

# put: bump the version, write the record, move it between node sets.
PUT = MOVE + """
local old = redis.call('HGET', KEYS[1], 'node')
local version = redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'state', ARGV[2], 'node', ARGV[3])
redis.call('SADD', ARGV[5] .. 'sandboxes', ARGV[4])
move(old, ARGV[3])
return version
"""

# compare_and_set: the same, only if the stored state is still the expected one (ARGV[6]).
CAS = MOVE + """
if redis.call('HGET', KEYS[1], 'state') ~= ARGV[6] then return 0 end
local old = redis.call('HGET', KEYS[1], 'node')
redis.call('HINCRBY', KEYS[1], 'version', 1)
redis.call('HSET', KEYS[1], 'record', ARGV[1], 'state', ARGV[2], 'node', ARGV[3])
move(old, ARGV[3])
return 1
"""

DELETE = """
local node = redis.call('HGET', KEYS[1], 'node')
redis.call('DEL', KEYS[1])
redis.call('SREM', ARGV[2] .. 'sandboxes', ARGV[1])
if node then redis.call('SREM', ARGV[2] .. 'node:' .. node .. ':sandboxes', ARGV[1]) end
return node and 1 or 0
"""

# put_session: take the path unless another session holds it, free the old
# path, write the record. ARGV: id, owner, path, record JSON, key prefix.
PUT_SESSION = """
local paths = ARGV[5] .. 'nbpath:' .. ARGV[2]
local holder = redis.call('HGET', paths, ARGV[3])
if holder and holder ~= ARGV[1] then return 0 end
local key = ARGV[5] .. 'nbs:' .. ARGV[1]
local old = redis.call('HGET', key, 'path')
if old and old ~= ARGV[3] and redis.call('HGET', paths, old) == ARGV[1] then redis.call('HDEL', paths, old) end
redis.call('HSET', key, 'record', ARGV[4], 'owner', ARGV[2], 'path', ARGV[3])
redis.call('HSET', paths, ARGV[3], ARGV[1])
redis.call('SADD', ARGV[5] .. 'nbsessions', ARGV[1])
return 1
"""

# replace_tenant: write ARGV[1] only if the stored record's token_hash is still ARGV[2].
REPLACE_TENANT = """
local raw = redis.call('GET', KEYS[1])
if not raw or cjson.decode(raw)['token_hash'] ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""

# delete_session: ARGV: id, key prefix.
DELETE_SESSION = """
local key = ARGV[2] .. 'nbs:' .. ARGV[1]
local owner = redis.call('HGET', key, 'owner')
if not owner then return 0 end
local paths = ARGV[2] .. 'nbpath:' .. owner
local path = redis.call('HGET', key, 'path')
if redis.call('HGET', paths, path) == ARGV[1] then redis.call('HDEL', paths, path) end
redis.call('DEL', key)
redis.call('SREM', ARGV[2] .. 'nbsessions', ARGV[1])
return 1
"""

# reseal: replace a record's JSON only if it is still the one read (ARGV[1]); the version stays.
RESEAL = """
if redis.call('HGET', KEYS[1], 'record') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'record', ARGV[2])
return 1
"""


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    url = re.sub(r"(://[^:@/]*:)[^@/]*@", r"\1[redacted]@", url)
    return re.sub(r"([?&]password=)[^&]*", r"\1[redacted]", url)


class RedisStore(SessionStore):
    def __init__(self, url: str, node: str, prefix: str = "sandgate:", sealer: Optional[seal.Sealer] = None,
                 tls: Optional[dict] = None):
        """``tls``: redis-py's ssl_* options (ssl_ca_certs, ssl_certfile, ssl_keyfile) for a rediss:// URL."""
        self.node = node
        self.prefix = prefix
        self.sealer = sealer  # None: records with secrets are refused (SealError), never stored in clear
        self.redis = aioredis.from_url(url, decode_responses=True, health_check_interval=10,
                                       retry_on_timeout=True, **(tls or {}))
        self._reseal = self.redis.register_script(RESEAL)
        self._put = self.redis.register_script(PUT)
        self._cas = self.redis.register_script(CAS)
        self._delete = self.redis.register_script(DELETE)
        self._put_session = self.redis.register_script(PUT_SESSION)
        self._delete_session = self.redis.register_script(DELETE_SESSION)
        self._replace_tenant = self.redis.register_script(REPLACE_TENANT)

    def _key(self, sandbox_id: str) -> str:
        return f"{self.prefix}sb:{sandbox_id}"

    def _args(self, record: SandboxRecord) -> list:
        # Secret values are kept, sealed, for the proxy of whichever node holds it.
        return [seal.dump(record, self.sealer), record.state.value, record.node, record.id, self.prefix]

    def _record(self, raw: Optional[str], version: Optional[str]) -> Optional[SandboxRecord]:
        if not raw:
            return None
        return seal.load(raw, self.sealer)[0].model_copy(update={"version": int(version or 0)})

    async def reseal(self) -> int:
        if self.sealer is None:
            return 0
        check = f"{self.prefix}sealcheck"
        if not await self.redis.set(check, self.sealer.check, nx=True):
            if await self.redis.get(check) != self.sealer.check:
                raise seal.SealError(f"the fleet's secret values in Redis ({check}) were sealed with another key: "
                                     "this node's SANDGATE_FLEET_KEY differs from the other nodes'")
        n = 0
        for sid in sorted(await self.redis.smembers(f"{self.prefix}sandboxes")):
            raw = await self.redis.hget(self._key(sid), "record")
            if not raw:
                continue
            rec, clear = seal.load(raw, self.sealer)
            if clear:
                n += await self._reseal(keys=[self._key(sid)], args=[raw, seal.dump(rec, self.sealer)])
        if n:
            log.info("sealed the secret values of %d sandbox records stored in clear", n)
        return n

    async def get(self, sandbox_id: str) -> Optional[SandboxRecord]:
        return self._record(*await self.redis.hmget(self._key(sandbox_id), "record", "version"))

    async def put(self, record: SandboxRecord) -> SandboxRecord:
        version = await self._put(keys=[self._key(record.id)], args=self._args(record))
        return record.model_copy(update={"version": int(version)})

    async def compare_and_set(self, record: SandboxRecord, expected: State) -> bool:
        return bool(await self._cas(keys=[self._key(record.id)], args=self._args(record) + [expected.value]))

    async def delete(self, sandbox_id: str) -> None:
        await self._delete(keys=[self._key(sandbox_id)], args=[sandbox_id, self.prefix])

    async def list(self, node: Optional[str] = None) -> List[SandboxRecord]:
        members = f"{self.prefix}node:{node}:sandboxes" if node is not None else f"{self.prefix}sandboxes"
        ids = sorted(await self.redis.smembers(members))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hmget(self._key(i), "record", "version")
            rows = await pipe.execute()
        return [r for r in (self._record(*row) for row in rows) if r]

    # -- tenants ---------------------------------------------------------------------
    async def create_tenant(self, record: TenantRecord) -> bool:
        if not await self.redis.set(f"{self.prefix}tenant:{record.name}", record.model_dump_json(), nx=True):
            return False
        await self.redis.sadd(f"{self.prefix}tenants", record.name)
        return True

    async def get_tenant(self, name: str) -> Optional[TenantRecord]:
        raw = await self.redis.get(f"{self.prefix}tenant:{name}")
        return TenantRecord.model_validate_json(raw) if raw else None

    async def list_tenants(self) -> List[TenantRecord]:
        names = sorted(await self.redis.smembers(f"{self.prefix}tenants"))
        raws = await self.redis.mget([f"{self.prefix}tenant:{n}" for n in names]) if names else []
        return [TenantRecord.model_validate_json(r) for r in raws if r]

    async def replace_tenant(self, record: TenantRecord, token_hash: str) -> bool:
        return bool(await self._replace_tenant(keys=[f"{self.prefix}tenant:{record.name}"],
                                               args=[record.model_dump_json(), token_hash]))

    async def delete_tenant(self, name: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(f"{self.prefix}tenant:{name}")
            pipe.srem(f"{self.prefix}tenants", name)
            deleted, _ = await pipe.execute()
        return deleted == 1

    # -- Jupyter sessions ------------------------------------------------------------
    async def put_session(self, record: NotebookSessionRecord) -> bool:
        return bool(await self._put_session(
            args=[record.id, record.owner, record.path, record.model_dump_json(), self.prefix]))

    async def get_session(self, session_id: str) -> Optional[NotebookSessionRecord]:
        raw = await self.redis.hget(f"{self.prefix}nbs:{session_id}", "record")
        return NotebookSessionRecord.model_validate_json(raw) if raw else None

    async def session_by_path(self, owner: str, path: str) -> Optional[NotebookSessionRecord]:
        sid = await self.redis.hget(f"{self.prefix}nbpath:{owner}", path)
        return await self.get_session(sid) if sid else None

    async def list_sessions(self, owner: Optional[str] = None) -> List[NotebookSessionRecord]:
        ids = sorted(await self.redis.smembers(f"{self.prefix}nbsessions"))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hget(f"{self.prefix}nbs:{i}", "record")
            raws = await pipe.execute()
        records = [NotebookSessionRecord.model_validate_json(r) for r in raws if r]
        return [r for r in records if owner is None or r.owner == owner]

    async def delete_session(self, session_id: str) -> bool:
        return bool(await self._delete_session(args=[session_id, self.prefix]))

    # -- node liveness -----------------------------------------------------------------
    async def heartbeat(self, node: str, ttl: float, info: Optional[dict] = None) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(f"{self.prefix}alive:{node}", json.dumps(info or {}), px=int(ttl * 1000))
            pipe.sadd(f"{self.prefix}nodes", node)
            await pipe.execute()

    async def live_nodes(self) -> Dict[str, dict]:
        nodes = sorted(await self.redis.smembers(f"{self.prefix}nodes"))
        infos = await self.redis.mget([f"{self.prefix}alive:{n}" for n in nodes]) if nodes else []
        return {n: json.loads(i) for n, i in zip(nodes, infos) if i is not None}

    async def retire(self, node: str) -> None:
        await self.redis.delete(f"{self.prefix}alive:{node}")

    async def close(self) -> None:
        await self.redis.aclose()
