"""Budget-based admission control (k3.route.budget): the class syntax and its errors; a long burst queues and is
refused within its own budget while short requests are admitted at once; first come first served; a request larger
than its budget runs alone; a client that leaves while queued gives its place back; and (hypothesis) under any
order of arrivals and completions a class never holds more than its budget, except one request alone."""

import asyncio
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.route.budget import Admission, Rejected, RequestClass, parse_classes


def test_parse_classes():
    assert parse_classes(["short:2048:0.5", "long:inf:0.5"]) == [RequestClass("short", 2048, 0.5),
                                                                  RequestClass("long", math.inf, 0.5)]
    assert parse_classes(["all:inf:1"]) == [RequestClass("all", math.inf, 1.0)]
    bad = {("short:2048",): "NAME:MAX_TOKENS:SHARE",
           ("short:many:0.5", "long:inf:0.5"): "MAX_TOKENS must be a positive integer or 'inf', got 'many'",
           ("short:0:0.5", "long:inf:0.5"): "MAX_TOKENS must be a positive integer",
           ("short:2048:1.5", "long:inf:0.5"): r"SHARE must be a number in \(0, 1\], got '1.5'",
           ("short:2048:0", "long:inf:0.5"): "SHARE must be a number in",
           ("a b:inf:1",): "may hold only letters",
           ("short:2048:0.5",): "must take every longer prompt: give it MAX_TOKENS 'inf'",
           ("long:inf:0.5", "short:2048:0.5"): "from the shortest",
           ("x:10:0.5", "x:inf:0.5"): "'x' is given twice",
           ("short:2048:0.6", "long:inf:0.6"): "sum to 1.2; at most 1",
           (): "at least one"}
    for specs, message in bad.items():
        with pytest.raises(ValueError, match=message):
            parse_classes(list(specs))


def _admission(**kw) -> Admission:
    kw = {"queue_wait_s": 0.2, "max_queued": 8, **kw}
    return Admission(parse_classes(["short:100:0.5", "long:inf:0.5"]), 1000, **kw)


def test_short_requests_admitted_while_a_long_burst_queues_and_is_refused():
    async def run():
        adm = _admission(max_queued=1)
        short, long = adm.classes
        assert (short.budget, long.budget) == (500, 500)
        first = await adm.admit(400)  # a long request: its class holds 400 of 500
        queued = asyncio.create_task(adm.admit(400))  # does not fit: waits
        await asyncio.sleep(0)
        assert len(long.waiters) == 1
        with pytest.raises(Rejected, match="'long' request class is full") as full:  # the queue holds one
            await adm.admit(300)
        assert full.value.retry_after >= 1
        shorts = [await adm.admit(50) for _ in range(10)]  # the short class is untouched by the burst
        assert short.in_flight == 500 and short.queued == 0
        with pytest.raises(Rejected, match="stayed full for 0.2 s"):
            await queued
        assert (long.admitted, long.queued, long.rejected, long.in_flight) == (1, 1, 2, 400)
        for t in shorts + [first]:
            t.release()
            t.release()  # idempotent
        assert short.in_flight == long.in_flight == 0 and short.running == long.running == 0

    asyncio.run(run())


def test_release_admits_waiters_first_come_first_served():
    async def run():
        adm = _admission(queue_wait_s=5)
        a = await adm.admit(300)
        order = []

        async def wait(tokens, name):
            t = await adm.admit(tokens)
            order.append(name)
            return t

        b = asyncio.create_task(wait(400, "b"))  # needs a to finish
        await asyncio.sleep(0)
        c = asyncio.create_task(wait(150, "c"))  # would fit now, but b came first
        await asyncio.sleep(0.01)
        assert order == []
        a.release()
        tb = await b
        assert order == ["b"]  # c (150) does not fit beside b (400)
        tb.release()
        (await c).release()
        assert order == ["b", "c"] and adm.classes[1].in_flight == 0
        assert adm.classes[1].wait_seconds > 0

    asyncio.run(run())


def test_a_request_larger_than_its_budget_runs_alone():
    async def run():
        adm = _admission(queue_wait_s=5)
        huge = await adm.admit(5000)  # 10x the long budget: admitted, the class being empty
        later = asyncio.create_task(adm.admit(200))
        await asyncio.sleep(0.01)
        assert not later.done()
        huge.release()
        (await later).release()

    asyncio.run(run())


def test_a_client_that_leaves_while_queued_gives_its_place_back():
    async def run():
        adm = _admission(queue_wait_s=5)
        long = adm.classes[1]
        a = await adm.admit(300)
        gone = asyncio.create_task(adm.admit(400))
        nxt = asyncio.create_task(adm.admit(150))  # fits beside a, but waits behind `gone`
        await asyncio.sleep(0.01)
        assert not nxt.done()
        gone.cancel()
        t = await nxt  # the head left: the next waiter is admitted at once
        assert long.in_flight == 450 and long.running == 2
        a.release()
        t.release()
        assert long.in_flight == 0 and not long.waiters

    asyncio.run(run())


def test_admission_checks_its_arguments():
    with pytest.raises(ValueError, match="fleet_tokens"):
        Admission(parse_classes(["a:inf:1"]), 0)
    with pytest.raises(ValueError, match="max_queued"):
        Admission(parse_classes(["a:inf:1"]), 10, max_queued=-1)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(1, 700), min_size=1, max_size=25), order=st.randoms(use_true_random=False))
def test_budget_holds_under_any_arrivals_and_completions(sizes, order):
    """All requests of one class arrive at once; they complete in a random order as they are admitted. At every
    point the class holds at most its budget (or one request alone), admission follows arrival order, and every
    request is admitted in the end (nothing waits forever, nothing leaks)."""

    async def run():
        adm = Admission(parse_classes(["all:inf:1"]), 1000, queue_wait_s=60, max_queued=100)
        b = adm.classes[0]
        tasks = [asyncio.create_task(adm.admit(n)) for n in sizes]
        admitted, running = [], []
        while len(admitted) < len(sizes):
            for _ in range(3):  # an admitted waiter's task resumes on the loop's next turn
                await asyncio.sleep(0)
            for i, t in enumerate(tasks):
                if t.done() and i not in admitted:
                    admitted.append(i)
                    running.append(t.result())
            assert b.in_flight <= b.budget or b.running == 1
            assert b.in_flight == sum(t.tokens for t in running)
            if running:
                running.pop(order.randrange(len(running))).release()
        assert admitted == sorted(admitted)  # first come, first served
        for t in running:
            t.release()
        assert b.in_flight == 0 and b.running == 0 and b.admitted == len(sizes)

    asyncio.run(run())
