"""The execution-id bookkeeping (gateway/core/executions.py) and the SDK's side of it, in process: no sandbox needed."""

import asyncio
import functools
import json

import pytest

from sandgate.core.errors import Conflict
from sandgate.core.executions import Executions


def run(test):
    """An async test, run to its end within a bound (a join that never ends fails, not hangs)."""
    @functools.wraps(test)
    def wrapper(*a, **kw):
        asyncio.run(asyncio.wait_for(test(*a, **kw), 10))
    return wrapper


def result(n: int, text: str = "") -> dict:
    return {"status": "ok", "execution_count": n, "outputs": [{"type": "stream", "name": "stdout", "text": text}],
            "stdout": text, "stderr": "", "error": None, "truncated": False}


@run
async def test_a_finished_id_is_answered_from_the_record():
    ex, runs = Executions(), []

    async def start(emit):
        runs.append(1)
        await emit({"type": "stream", "name": "stdout", "text": "hi\n"})
        return result(len(runs), "hi\n")

    first = await ex.run("a1", start)
    seen = []

    async def collect(out):
        seen.append(out)

    again = await ex.run("a1", start, collect)
    assert runs == [1] and again == first
    assert seen == first["outputs"]  # a streamed retry gets the outputs too
    await ex.run(None, start)  # no id: always runs
    assert runs == [1, 1]


@run
async def test_a_running_id_is_joined_from_the_start_then_live():
    ex, runs, go = Executions(), [], asyncio.Event()

    async def start(emit):
        runs.append(1)
        await emit({"type": "stream", "name": "stdout", "text": "one\n"})
        await go.wait()
        await emit({"type": "stream", "name": "stdout", "text": "two\n"})
        return result(1, "one\ntwo\n")

    first = asyncio.create_task(ex.run("b", start))
    while "b" not in ex.running or not ex.running["b"].outputs:  # bounded by the test's own timeout
        await asyncio.sleep(0)
    joined = []

    async def collect(out):
        joined.append(out["text"])

    second = asyncio.create_task(ex.run("b", start, collect))
    while joined != ["one\n"]:
        await asyncio.sleep(0)
    go.set()
    assert await first == await second
    assert runs == [1] and joined == ["one\n", "two\n"]


@run
async def test_a_failed_start_may_be_retried_and_joiners_get_the_error():
    ex, runs = Executions(), []

    async def boom(emit):
        runs.append(1)
        raise Conflict("no kernel")

    with pytest.raises(Conflict):
        await ex.run("c", boom)
    with pytest.raises(Conflict):
        await ex.run("c", boom)
    assert runs == [1, 1] and "c" not in ex.finished


def test_bounds_and_the_checkpoint_record():
    ex = Executions(max_ids=3, max_bytes=600)
    for i in range(5):
        ex.remember(f"id{i}", result(i, "x" * 100))
    assert list(ex.finished) == ["id2", "id3", "id4"]  # the oldest ids go
    assert ex.finished["id2"] is None and ex.finished["id4"] is not None  # oldest results go first, ids stay
    back = Executions.from_record(ex.to_record())
    assert back.finished == ex.finished
    assert Executions.from_record({"finished": [["bad id!", None], ["ok", "junk"]]}).finished == {"ok": None}


@run
async def test_an_id_whose_result_was_dropped_is_not_run_again():
    ex = Executions(max_ids=4, max_bytes=0)
    ex.remember("d", result(1))

    async def start(emit):
        raise AssertionError("ran twice")

    with pytest.raises(Conflict) as e:
        await ex.run("d", start)
    assert e.value.code == "execution_expired"


def test_websocket_msg_ids_are_accepted_once():
    ex = Executions(max_ids=2)
    assert ex.accept("m1") and not ex.accept("m1")
    ex.forget("m1")
    assert ex.accept("m1")
    assert ex.accept("m2") and ex.accept("m3")  # bounded: m1, the oldest, is forgotten
    assert list(ex.accepted) == ["m2", "m3"]


@run
async def test_on_begin_says_how_an_id_is_served_before_any_output():
    ex, go, heard = Executions(), asyncio.Event(), []

    async def start(emit):
        await emit({"type": "stream", "name": "stdout", "text": "one\n"})
        await go.wait()
        return result(1, "one\n")

    def listener(name):
        async def begin(run):
            heard.append((name, "begin", run))

        async def output(out):
            heard.append((name, "output", out["text"]))
        return output, begin

    out, begin = listener("first")
    first = asyncio.create_task(ex.run("e", start, out, begin))
    while "e" not in ex.running or not ex.running["e"].outputs:
        await asyncio.sleep(0)
    out, begin = listener("joiner")
    second = asyncio.create_task(ex.run("e", start, out, begin))
    while ("joiner", "output", "one\n") not in heard:
        await asyncio.sleep(0)
    go.set()
    await first, await second
    out, begin = listener("late")
    await ex.run("e", start, out, begin)
    assert [h for h in heard if h[0] == "first"] == [("first", "begin", "new"), ("first", "output", "one\n")]
    assert [h for h in heard if h[0] == "joiner"] == [("joiner", "begin", "joined"), ("joiner", "output", "one\n")]
    assert [h for h in heard if h[0] == "late"] == [("late", "begin", "finished"), ("late", "output", "one\n")]


def test_the_sdk_passes_outputs_on_once_unless_the_run_was_lost():
    """The SDK's side (sandgate_client._api.Callbacks), as the SSE events of two tries drive it: a
    joined retry's repeated outputs are skipped; a new run after a lost one is passed on whole."""
    from sandgate_client import _api as api

    def sse(*events):
        return "".join(f"event: {e}\ndata: {json.dumps(d)}\n\n" for e, d in events).encode()

    def drive(cb, events):
        done = None
        for event, data in api.SSEParser().feed(sse(*events)):
            done = api.stream_event(cb, event, data) or done
        return done

    def out(text):
        return ("output", {"type": "stream", "name": "stdout", "text": text})

    final = ("result", result(1, "a\nb\n"))
    seen = []
    cb = api.Callbacks(on_stdout=seen.append)
    drive(cb, [("execution", {"id": "x", "run": "new"}), out("a\n")])  # the connection drops here
    cb.rewind()
    ex = drive(cb, [("execution", {"id": "x", "run": "joined"}), out("a\n"), out("b\n"), final])
    assert seen == ["a\n", "b\n"] and not ex.reran

    seen.clear()
    cb = api.Callbacks(on_stdout=seen.append)
    drive(cb, [("execution", {"id": "y", "run": "new"}), out("lost\n")])  # its node dies
    cb.rewind()
    ex = drive(cb, [("execution", {"id": "y", "run": "new"}), out("a\n"), out("b\n"), final])
    assert seen == ["lost\n", "a\n", "b\n"] and ex.reran and ex.stdout == "a\nb\n"
    assert cb.live.stdout == "a\nb\n"  # what a Timeout would carry: the new run's alone
