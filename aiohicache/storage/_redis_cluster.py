"""`RedisClusterBackend`: a Redis (or Valkey) Cluster as the L3 page store, a pipeline per
node, run concurrently."""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast
from urllib.parse import unquote, urlsplit, urlunsplit

import anyio
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, NodesManager, PipelineCommand, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.cluster import PRIMARY
from redis.connection import parse_url
from redis.exceptions import (
    AskError,
    ClusterDownError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._validate import check_number
from ..errors import ConfigError
from ._node_circuits import NodeCircuits, NodeSkippedError
from ._redis import Add, RedisBackend
from ._redis_parts import (
    CLUSTER_SCHEMES,
    Blob,
    FreshTlsConnection,
    check_query,
    check_tls_files,
    safe_reason,
)
from .base import PageFormat
from .errors import StorageWriteError

__all__ = ("RedisClusterBackend",)

log = logging.getLogger("aiohicache.storage.redis")

_NODE_ERRORS = (ConnectionError, TimeoutError, OSError, RedisConnectionError, RedisTimeoutError,
                ClusterDownError, TryAgainError)
"""Errors that mean a node (not a command) failed."""
_REDIRECTS = (AskError, TryAgainError)
"""Replies to follow elsewhere (`MovedError` is an `AskError`)."""
_CLIENT_ERRORS = (RedisError, RedisClusterException, OSError)
"""Errors of the client for a failed call (`RedisClusterException`, no seed reachable or
no slot map, is not a `RedisError`)."""
NODE_COOLDOWN_S = 10.0
"""Default seconds a node that timed out is skipped (the cache's `storage_cooldown` default)."""


class RedisClusterBackend(RedisBackend):
    """A `StorageBackend` on a Redis (or Valkey) Cluster:
    ``redis+cluster://[user:password@]host:port[,host:port...]`` (``rediss+cluster://`` for
    TLS; ``valkey+cluster://`` is the same). The hosts are seeds: the client learns the
    whole cluster from any of them.

        async with RedisClusterBackend("redis+cluster://10.0.0.5:7000,10.0.0.6:7000", fmt) as l3:
            await l3.set_from(keys, pages)

    Each page is one key, so it lives in its key's hash slot. A batch is split by the node
    that owns each slot and the per-node pipelines run concurrently; ``MOVED`` and ``ASK``
    redirections (slots migrating) are followed by redis-py. A node that fails (killed,
    partitioned, not yet replaced by its replica) costs only its share of the batch: those
    pages are misses (reads, `exists`) or not stored (writes), each lost node counted in
    `stats().errors` and ``extra["node_failures"]``, while the other nodes' pages are
    served; pages in slots no node serves (their node forgotten) are misses too. A call
    raises `StorageError` only once every primary has failed (each the last time it was
    asked), so the cache's breaker opens when the whole cluster is gone, not for a batch
    on the one node down. The client re-reads the topology after such errors, so once a
    replica has taken over (or the slots are given to a node), they are served again.

    A node that times out (hung, not dead: stopped, overloaded, a host that does not
    answer) is skipped for `node_cooldown` seconds: its pages are a failed node's at once
    (counted in ``extra["nodes_skipped"]`` too), not after a `socket_timeout` each call;
    then one call asks it again (the probe), and its answer ends the skipping.

    Same options as `RedisBackend` (`max_connections` is per node), and:

    Args:
        node_cooldown: seconds a node that timed out is skipped (default 10, as the
            cache's `storage_cooldown`); also ``?node_cooldown=`` in the URL.

    Raises:
        ConfigError: a bad URL or setting, or `node_cooldown` given both ways.
    """

    def __init__(self, url: str, fmt: PageFormat, *, node_cooldown: float | None = None,
                 **options: Any) -> None:
        self._node_cooldown = node_cooldown
        super().__init__(url, fmt, **options)

    def _connect(self, url: str, **settings: float) -> Redis | RedisCluster:
        url, cooldown = take_cooldown(url, self.url, self._node_cooldown)
        self._circuits = NodeCircuits(cooldown)
        self._node_limit = int(settings["max_connections"])
        self._retries = int(settings["retries"])
        self._node_slots: dict[str, anyio.Semaphore] = {}
        self._failed_nodes: set[str] = set()
        """Nodes whose last pipeline failed or was skipped (none answered since)."""
        self._readying = anyio.Lock()
        """One `_ready` at a time (redis-py's `initialize` takes a lock as well)."""
        return cluster_client(url, self.url, **settings)  # type: ignore[arg-type]

    async def _close_client(self) -> None:
        client = cast(RedisCluster, self._client)
        # NOTE: redis-py's aclose closes nothing while its client is to read the slot map
        # (`_initialize`: an entry cancelled or failed before the commands were read, or
        # one of its own commands failed since): each connection it had opened was left
        client._initialize = False
        await client.aclose()

    _stale = False
    """A node failed since the slot map was last read (it may be stale: a replica may have
    taken over)."""
    _read_at = -math.inf
    """When the backend last tried to read the slot map again."""

    async def _pipelined(self, names: list[str], add: Add, *,
                         raise_on_error: bool = True) -> list[object]:
        client = cast(RedisCluster, self._client)
        groups: dict[str, list[int]] = {}
        await self._ready(client)  # learns the slot map once
        await self._refresh_slot_map(client)
        for i, name in enumerate(names):
            groups.setdefault(_node_name(client, name), []).append(i)
        replies: list[object] = [None] * len(names)
        results = await self._per_node(names, groups, add)
        failures: list[BaseException] = []
        for (node_name, idx), result in zip(groups.items(), results, strict=True):
            if not isinstance(result, BaseException):
                lost = [r for r in result if isinstance(r, _NODE_ERRORS)]
                if lost and len(lost) == len(result):  # every command: the node is gone
                    result = lost[0]
            if isinstance(result, BaseException):
                if not isinstance(result, _CLIENT_ERRORS):
                    raise result
                failures.append(result)
                self._failed_nodes.add(node_name)
                result = [result] * len(idx)
            else:
                self._failed_nodes.discard(node_name)
            for i, reply in zip(idx, result, strict=True):
                if raise_on_error and isinstance(reply, Exception) and reply not in failures:
                    raise reply
                replies[i] = reply
        self._count_node_failures(client, failures, len(groups))
        return replies

    async def _per_node(self, names: list[str], groups: dict[str, list[int]],
                        add: Add) -> list[list[object] | BaseException]:
        """Each node's pipeline, all at once: its replies, or the exception it raised (for
        the caller to judge: a lost node costs only its own pages); a `NodeSkippedError`
        for a node skipped after a timeout."""
        results: list[list[object] | BaseException] = [[] for _ in groups]

        async def one(k: int, node_name: str, idx: list[int]) -> None:
            pipeline = functools.partial(self._node_pipeline, names, idx, add)
            if not node_name:  # slots no node serves: not a node to skip
                try:
                    results[k] = await pipeline()
                except Exception as exc:  # judged by _pipelined
                    results[k] = exc
                return
            results[k] = await self._circuits.call(node_name, pipeline)

        async with anyio.create_task_group() as tg:
            for k, (node_name, idx) in enumerate(groups.items()):
                tg.start_soon(one, k, node_name, idx)
        skipped = sum(isinstance(result, NodeSkippedError) for result in results)
        if skipped:
            extra = self._stats.extra
            extra["nodes_skipped"] = extra.get("nodes_skipped", 0) + skipped
        return results

    async def _node_pipeline(self, names: list[str], idx: list[int], add: Add) -> list[object]:
        client = cast(RedisCluster, self._client)
        node = client.get_node_from_key(names[idx[0]])
        name = node.name if node else ""
        for attempt in range(self._retries + 1):
            last = node is None or attempt == self._retries
            try:
                async with self._slots(name):
                    pipe = client.pipeline()
                    for i in idx:
                        add(pipe, names[i], i)
                    self._count_round_trip(len(pipe))
                    # NOTE: redirections are followed here (`_redirect`), not by redis-py: it
                    # sends ASKING and the command as two calls, each on the first idle
                    # connection of the node, so with two idle ASKING went on one and the
                    # command on the other, which the node then redirected back (MOVED),
                    # until the pages missed
                    replies: list[object] = await pipe.execute(raise_on_error=False,
                                                               allow_redirections=False)
            except RedisConnectionError:
                if last:
                    raise
            else:
                if last or not all(isinstance(r, RedisConnectionError) for r in replies):
                    break
            # NOTE: a connection the node closed (it restarted, or an idle one was dropped):
            # its other idle ones are most likely closed too, and the client retries nothing,
            # so each would have failed a call in turn (a healthy cluster opened the breaker)
            assert node is not None
            _reconnect_idle(node)
        redirected = [k for k, reply in enumerate(replies) if isinstance(reply, _REDIRECTS)]
        if redirected:
            followed = await self._redirect(names, [idx[k] for k in redirected],
                                            [replies[k] for k in redirected], add, name)
            for k, reply in zip(redirected, followed, strict=True):
                replies[k] = reply
        return replies

    async def _redirect(self, names: list[str], idx: list[int], errors: list[object],
                        add: Add, source: str) -> list[object]:
        """Follow redirections: ``ASK`` on one connection of the node named (``ASKING``, then
        the command), ``MOVED`` and ``TRYAGAIN`` through the client (which re-points the
        slot); each within the `max_connections` of the node it goes to (`source`, the node
        that answered, for ``TRYAGAIN``) and through its circuit (a node skipped: an error).
        The replies, an error where it failed again."""
        client = cast(RedisCluster, self._client)
        commands = _recorded(names, idx, add)
        followed: list[object] = list(errors)
        asks: dict[str, list[int]] = {}
        for k, error in enumerate(errors):
            if type(error) is AskError:
                asks.setdefault(f"{error.host}:{error.port}", []).append(k)
                continue
            args, options = commands[k]
            target = f"{error.host}:{error.port}" if isinstance(error, AskError) else source

            async def follow(target: str = target, args: Any = args,
                             options: dict[str, Any] = options) -> object:
                async with self._slots(target):
                    return await client.execute_command(*args, **options)

            # NOTE: a MOVED through the circuit of the node it names (TRYAGAIN: the source,
            # whose circuit this call is in already): a redirect to a hung node cost every
            # call its timeout, however long the node was skipped
            try:
                followed[k] = _judged(await follow() if target == source
                                      else await self._circuits.call(target, follow))
            except _CLIENT_ERRORS as exc:
                followed[k] = exc
        for node_name, ks in asks.items():
            results = await self._asking(node_name, [commands[k] for k in ks])
            for k, result in zip(ks, results, strict=True):
                followed[k] = result
        return followed

    async def _asking(self, node_name: str, commands: list[Recorded]) -> list[object]:
        """`commands` sent to `node_name` each after ``ASKING``, pipelined on one connection
        (a node the client does not know yet, joining the cluster, is added); their replies,
        or the error of that node for each."""
        manager = cast(RedisCluster, self._client).nodes_manager
        node = manager.get_node(node_name=node_name)
        if node is None:  # as redis-py adds a node a MOVED names (the slot map is not changed)
            host, _, port = node_name.rpartition(":")
            node = ClusterNode(host, int(port), PRIMARY, **manager.connection_kwargs)
            manager.set_nodes(manager.nodes_cache, {node.name: node})
        batch = [PipelineCommand(n, *args, **options) for n, command in enumerate(commands)
                 for args, options in ((("ASKING",), {}), command)]

        async def send() -> list[object]:
            async with self._slots(node.name):
                await node.execute_pipeline(batch)
            # NOTE: ASKING's replies too: on a hung node the first (ASKING's) times out and
            # the others are connection errors, and the circuit opens on a timeout
            return [command.result for command in batch]

        # NOTE: through the node's circuit: an ASK to a hung node (a slot migrating to it)
        # cost every call its timeout, however long the node was skipped
        replies = _judged(await self._circuits.call(node.name, send))
        if isinstance(replies, Exception):  # that node failed: these pages alone
            return [replies] * len(commands)
        return cast(list[object], replies)[1::2]

    def _slots(self, node_name: str) -> anyio.Semaphore:
        """The `max_connections` of one node (redis-py's cluster node raises, not waits,
        when its pool is empty)."""
        return self._node_slots.setdefault(node_name, anyio.Semaphore(self._node_limit))

    async def _ready(self, client: RedisCluster) -> None:
        """Have `client` read the slot map and the commands' key positions (``COMMAND``) if
        it has not yet, or must again (one of its own commands failed on a node).

        NOTE: not redis-py's `initialize`: it sends COMMAND to its default node (the first
        primary) only, and closes every connection if that fails: with that node down, a
        backend started then failed every call, the store lost for good while two nodes of
        three served (with no replica to take over); hung, each call waited its timeout.
        Here the primaries are asked in turn, through their circuits.
        """
        if not client._initialize:
            return
        async with self._readying:
            # NOTE: one call reads, the others wait for it: a burst of first calls each
            # read the slot map and COMMAND's long reply, a connection slot each
            if client._initialize:
                await self._read_map_and_commands(client)

    async def _read_map_and_commands(self, client: RedisCluster) -> None:
        with self._answering_seeds(client, at_least_one=True):
            await client.nodes_manager.initialize()
        failing = self._circuits.failing()
        error: Exception = RedisClusterException("the cluster has no primary")
        for node in sorted(client.get_primaries(), key=lambda node: node.name in failing):
            async def read_commands(node: ClusterNode = node) -> None:
                async with self._slots(node.name):
                    await client.commands_parser.initialize(node)

            outcome = _judged(await self._circuits.call(node.name, read_commands))
            if not isinstance(outcome, Exception):
                client.nodes_manager.default_node = node
                client._initialize = False
                return
            error = outcome
        raise error

    async def _refresh_slot_map(self, client: RedisCluster) -> None:
        """After a node failed, re-read the slot map (at most every 0.25 s): a replica may
        have taken over its slots. Nodes being skipped after a timeout are not asked.

        NOTE: redis-py would refresh it by closing every connection of the client and
        retrying the whole pipeline; with one pipeline per node in flight at once, that
        would fail the healthy nodes' pipelines too, so the client retries nothing
        (``retries`` applies to single commands) and the map is refreshed here instead.
        """
        # NOTE: every 0.25 s from the last read, not from the last failure: calls that came
        # more often (each failing on the node down, each renewing the time) never read it,
        # and a cache that only read served none of a failed-over primary's pages for good
        if not self._stale or time.monotonic() - self._read_at < 0.25:
            return
        self._stale = False
        self._read_at = time.monotonic()
        with self._answering_seeds(client, at_least_one=False) as any_seed:
            try:
                if not any_seed:  # every node timed out: their probes will tell
                    raise RedisClusterException("every node timed out")
                await client.nodes_manager.initialize()
            except _CLIENT_ERRORS as exc:
                self._stale = True
                log.debug("redis cluster %s: re-reading the slot map failed: %r", self.url,
                          exc)

    @contextmanager
    def _answering_seeds(self, client: RedisCluster, *, at_least_one: bool) -> Iterator[bool]:
        """While in the block, the client reads the slot map only from nodes that have not
        timed out (`NodeCircuits.failing`); with `at_least_one`, from every node if each
        has. Yields whether a node is left to read it from.

        NOTE: redis-py asks its seeds (every node it knows) in random order, each until one
        answers: a hung node asked first held the call `socket_timeout` while its pages were
        being skipped (a re-read in three, of three nodes), and with every primary hung,
        each re-read waited for every one of them. (`at_least_one` for the client's first
        read, or a read again after one of its own commands failed: without a map, no call
        could ever probe a node again.)
        """
        seeds = client.nodes_manager.startup_nodes
        failing = self._circuits.failing()
        if at_least_one and failing.issuperset(seeds):
            failing = set()
        aside = {name: seeds.pop(name) for name in failing if name in seeds}
        try:
            yield bool(seeds)
        finally:
            # NOTE: each back as it was, over the node a map just read may have added under
            # its name: a seed from the URL is a node object of its own, with connections
            # (dropped, they were left open)
            seeds.update(aside)

    def _count_node_failures(self, client: RedisCluster, failures: list[BaseException],
                             num_groups: int) -> None:
        if not failures:
            return
        self._stale = True
        log.debug("redis cluster %s: %d of %d nodes failed: %r", self.url, len(failures),
                  num_groups, failures[0])
        # NOTE: the caller's error (and breaker) only once every primary has failed: a batch
        # on the one node down of three (a page or two: a short prompt, a decode's backup)
        # failed whole, and a few in a row opened the cache's breaker, L3 bypassed while
        # two nodes of three served
        primaries = {node.name for node in client.get_primaries()}
        if len(failures) == num_groups and primaries <= self._failed_nodes:
            raise failures[0]
        self._stats.errors += len(failures)
        extra = self._stats.extra
        extra["node_failures"] = extra.get("node_failures", 0) + len(failures)

    async def _mget(self, names: list[str]) -> list[Blob]:
        # a key per slot: MGET cannot span nodes, so GETs pipelined per node
        replies = await self._pipelined(names, lambda pipe, name, _: pipe.get(name),
                                        raise_on_error=False)
        return [reply if isinstance(reply, bytes) else None for reply in replies]

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys` (a DEL each, pipelined per node); return how many existed.

        Raises:
            ConfigError: a key is not 16-128 lowercase hex characters.
            StorageWriteError: no node could be reached.

        Cancellation: keys of the pipelines in flight may or may not be removed.
        """
        names = self._names(keys)
        removed = 0
        with self._in_flight(), self._translate(StorageWriteError, "delete"):
            # NOTE: `max_batch` names a round, as the other calls: 10k DELs in one round held
            # the loop about 170 ms (building, sending and parsing every node's pipeline)
            for lo in range(0, len(names), self.max_batch):
                replies = await self._pipelined(names[lo:lo + self.max_batch],
                                                lambda pipe, name, _: pipe.delete(name),
                                                raise_on_error=False)
                removed += sum(reply for reply in replies if isinstance(reply, int))
        self._stats.pages_deleted += removed
        return removed

    async def _ping(self) -> None:
        """PING each primary (each through its circuit); raise only once none answered.

        NOTE: redis-py sends PING to one node (its default, the first primary): with that
        one down or hung (`socket_timeout`), the backend could not be entered, while it
        would have served the other nodes' pages.
        """
        replies, errors = await self._on_primaries("PING")
        if errors and not replies:
            raise errors[0]

    async def _server_info(self, section: str) -> list[dict[str, object]]:
        """Each primary's ``INFO <section>``; the first error if any node failed."""
        replies, errors = await self._on_primaries("INFO", section)
        if errors:
            raise errors[0]
        return cast(list[dict[str, object]], replies)

    async def _on_primaries(self, *command: str) -> tuple[list[object], list[Exception]]:
        """`command` sent to each primary, all at once, each within the node's
        `max_connections` and through its circuit: the replies, and the errors.

        NOTE: redis-py's INFO to every primary took a connection of each past the limit,
        and a pipeline then found its node's pool empty (MaxConnectionsError: a node lost).
        """
        client = cast(RedisCluster, self._client)
        await self._ready(client)
        replies: list[object] = []
        errors: list[Exception] = []

        async def one(node: ClusterNode) -> None:
            async def send() -> object:
                async with self._slots(node.name):
                    return await node.execute_command(*command)

            # NOTE: through the node's circuit: a hung node held a write (the look every
            # 10 s) or a reader's first call `socket_timeout`, however long it was skipped.
            # And on the node, not through the client: after a timeout the client reads the
            # slot map again at its next command, from every node (see _answering_seeds)
            reply = await self._circuits.call(node.name, send)
            if not isinstance(reply, Exception):
                replies.append(reply)
            elif isinstance(reply, _CLIENT_ERRORS):
                errors.append(reply)
            else:
                raise reply

        async with anyio.create_task_group() as tg:
            for node in client.get_primaries():
                tg.start_soon(one, node)
        return replies, errors


def _node_name(client: RedisCluster, name: str) -> str:
    """The name of the node that owns `name`'s slot; "" for a slot no node serves.

    NOTE: `get_node_from_key` raises for such a slot (its node forgotten, not yet given to
    another: the cluster serves the other slots): the whole batch failed, every batch of
    a prompt over it, and the breaker opened. Its pages are a failed node's: misses.
    """
    try:
        node = client.get_node_from_key(name)
    except SlotNotCoveredError:
        return ""
    return node.name if node else ""


def _judged(outcome: object) -> object:
    """`outcome`, a client's error included (that node's pages fail); any other exception
    (a bug) raised."""
    if isinstance(outcome, Exception) and not isinstance(outcome, _CLIENT_ERRORS):
        raise outcome
    return outcome


def _reconnect_idle(node: ClusterNode) -> None:
    """Have `node`'s idle connections reconnect when next taken.

    NOTE: not `disconnect_free_connections`: it closes them while they stay in the free
    list, and a pipeline to that node that took one meanwhile wrote to a closed connection
    (redis-py's AttributeError, not a RedisError: the call failed as a bug, healthy nodes'
    pages with it). Marked, each is closed by the one call that takes it.
    """
    for connection in node._free:
        connection.mark_for_reconnect()  # type: ignore[no-untyped-call]


Recorded = tuple[tuple[object, ...], dict[str, Any]]
"""One command as a pipeline queues it: ``(args, options)``."""

def _recorded(names: list[str], idx: list[int], add: Add) -> list[Recorded]:
    """The commands `add` queues for `names[i]`, as a pipeline of a client that never
    connects records them."""
    pipe = _recorder().pipeline(transaction=False)
    for i in idx:
        add(pipe, names[i], i)
    return [(tuple(args), dict(options)) for args, options in pipe.command_stack]


@functools.cache
def _recorder() -> Redis:
    """A client that never connects, made once (making one costs about 0.4 ms)."""
    return Redis()


def check_options(url: str, safe_url: str) -> None:
    """Raise `ConfigError` for a query option of a cluster URL that the cluster client (or
    the backend) refuses: what `cluster_client` would raise, connecting nowhere (the client
    connects at its first command)."""
    url, _ = take_cooldown(url, safe_url, None)
    cluster_client(url, safe_url, socket_timeout=1.0, connect_timeout=1.0, max_connections=1,
                   retries=0)


def take_cooldown(url: str, safe_url: str, given: float | None) -> tuple[str, float]:
    """`url` without its ``node_cooldown`` query option (the backend's, not redis-py's),
    and the cool-down: the URL's, else `given`, else `NODE_COOLDOWN_S`.

    Raises:
        ConfigError: not seconds >= 0, or given twice (in the URL, or also as `given`).
    """
    default = NODE_COOLDOWN_S if given is None else check_number("node_cooldown", given,
                                                                   low=0.0)
    try:
        parts = urlsplit(url)
    except ValueError:  # cluster_client says what is wrong
        return url, default
    options = parts.query.split("&") if parts.query else []
    values = [unquote(o.partition("=")[2]) for o in options
              if unquote(o.partition("=")[0]) == "node_cooldown"]
    if not values:
        return url, default
    if len(values) > 1 or given is not None:
        raise ConfigError(f"url {safe_url!r}: node_cooldown is given twice")
    try:
        seconds: object = float(values[0])
    except ValueError:
        seconds = values[0]
    try:
        cooldown = check_number("node_cooldown", seconds, low=0.0)
    except ConfigError as exc:
        raise ConfigError(f"url {safe_url!r}: {exc}") from None
    rest = "&".join(o for o in options if unquote(o.partition("=")[0]) != "node_cooldown")
    return urlunsplit(parts._replace(query=rest)), cooldown


def cluster_client(url: str, safe_url: str, *, socket_timeout: float,
                   connect_timeout: float, max_connections: int,
                   retries: int) -> RedisCluster:
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise ConfigError(f"url {safe_url!r}: {safe_reason(url, exc)}") from None
    if parts.scheme not in CLUSTER_SCHEMES:
        raise ConfigError(f"url {safe_url!r}: the scheme must be one of {CLUSTER_SCHEMES}")
    check_query(parts.query, safe_url)
    auth, _, hosts = parts.netloc.rpartition("@")
    tls = parts.scheme in ("rediss+cluster", "valkeys+cluster")
    try:
        seeds = [urlsplit(f"redis://{seed.strip()}") for seed in hosts.split(",")]
        nodes = [ClusterNode(seed.hostname or "", seed.port or 6379) for seed in seeds]
        # the query and credentials as redis-py reads them for one server
        first = f"redis://{auth + '@' if auth else ''}{hosts.split(',')[0]}"
        query = f"?{parts.query}" if parts.query else ""
        options: dict[str, Any] = parse_url(first + query)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigError(f"url {safe_url!r}: {safe_reason(url, exc)}") from None
    for name in ("host", "port", "db", "connection_class"):
        options.pop(name, None)
    check_tls_files(options, safe_url)
    # NOTE: no retries in the client, and no re-reading of the whole slot map after MOVED
    # (redis-py then closes every node's connections, failing the other nodes' pipelines in
    # flight): see RedisClusterBackend._refresh_slot_map
    try:
        made = RedisCluster(startup_nodes=nodes, ssl=tls, require_full_coverage=False,
                            socket_timeout=socket_timeout,
                            socket_connect_timeout=connect_timeout,
                            max_connections=max_connections, retry=Retry(NoBackoff(), 0),
                            reinitialize_steps=0, **options)
    except TypeError as exc:  # an unknown option, or one the backend sets itself
        raise ConfigError(f"url {safe_url!r}: an option the cluster client does not take "
                          f"({safe_reason(url, exc)})") from None
    made.nodes_manager.__class__ = _ConnectionKeepingNodesManager  # made by RedisCluster
    if tls:  # the nodes' connections read rotated certificate files (no keyword for it)
        made.connection_kwargs["connection_class"] = FreshTlsConnection  # nodes learnt later
        for node in made.nodes_manager.startup_nodes.values():
            node.connection_class = FreshTlsConnection
    return made


class _ConnectionKeepingNodesManager(NodesManager):
    """redis-py's `NodesManager`, except that the nodes a slot map read again still has
    keep their connections.

    NOTE: redis-py marks every connection of every node it keeps to reconnect, at each
    read (for the READONLY state of connections to replicas, which this backend never
    reads): with a node down, the map is read every 0.25 s (`_refresh_slot_map`), and every
    connection to the healthy nodes was closed and opened again each time (with TLS, a
    handshake each). A connection that failed is closed by redis-py all the same, and a
    node's idle ones then marked by `_reconnect_idle`.
    """

    __slots__ = ()

    def set_nodes(self, old: dict[str, ClusterNode], new: dict[str, ClusterNode],
                  remove_old: bool = False) -> None:
        # NOTE: synchronous: no call can mark (or use) a connection in between
        kept = [connection for name, node in old.items() if name in new
                for connection in node._connections
                if not connection.should_reconnect()]  # type: ignore[no-untyped-call]
        super().set_nodes(old, new, remove_old)
        for connection in kept:
            connection.reset_should_reconnect()  # type: ignore[no-untyped-call]
