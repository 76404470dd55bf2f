"""AsyncLLMEngine on the session's real engine: streaming, rejection, aborts, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from jaxpaged import SamplingParams
from jaxpaged.engine.async_llm_engine import AsyncLLMEngine, EngineDeadError, QueueFullError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _run(llm_engine, scenario, **kwargs):
    """Run ``scenario(engine)`` on a fresh event loop with a started AsyncLLMEngine, then stop
    it and check that it left the shared engine clean."""

    async def main():
        engine = AsyncLLMEngine(llm_engine, **kwargs)
        engine.start()
        try:
            return await scenario(engine)
        finally:
            await asyncio.to_thread(engine.shutdown)

    result = asyncio.run(main())
    assert not llm_engine.has_unfinished_requests()
    kv = llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    return result


def test_concurrent_streams_are_cumulative_and_equal_llm_generate(stories_llm):
    prompts = ["Once upon a time", "The dog", "Tom had a red ball"]
    expected = stories_llm.generate(prompts, GREEDY, use_tqdm=False)

    async def scenario(engine):
        async def consume(i, prompt):
            outputs = [out async for out in engine.generate(f"r{i}", prompt, GREEDY)]
            return outputs

        return await asyncio.gather(*(consume(i, p) for i, p in enumerate(prompts)))

    results = _run(stories_llm.llm_engine, scenario)
    for outputs, reference in zip(results, expected, strict=True):
        lengths = [len(o.outputs[0].token_ids) for o in outputs]
        assert lengths == list(range(1, 7))  # one token per step, cumulative
        assert [o.finished for o in outputs] == [False] * 5 + [True]
        assert outputs[-1].outputs[0].token_ids == reference.outputs[0].token_ids
        assert outputs[-1].outputs[0].text == reference.outputs[0].text


def test_rejected_prompt_raises_and_the_loop_keeps_serving(stories_llm):
    async def scenario(engine):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.add_request("bad", {"prompt_token_ids": [1, 10**6]}, GREEDY)
        final = [o async for o in engine.generate("good", "Once upon a time", GREEDY)][-1]
        return final

    assert len(_run(stories_llm.llm_engine, scenario).outputs[0].token_ids) == 6


def test_closing_a_stream_aborts_its_request_and_leaves_others_alone(stories_llm):
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)

    async def scenario(engine):
        doomed = await engine.add_request("doomed", "The dog", long)
        kept = engine.generate("kept", "Once upon a time", GREEDY)
        await anext(doomed)
        doomed.close()
        doomed.close()  # idempotent
        return [o async for o in kept][-1]

    final = _run(stories_llm.llm_engine, scenario)
    assert final.request_id == "kept" and final.finished


def test_cancelled_add_request_is_undone(stories_llm):
    async def scenario(engine):
        long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        task = asyncio.ensure_future(engine.add_request("cancelled", "The dog", long))
        await asyncio.sleep(0)  # submitted, not yet accepted
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Had the add not been undone, "cancelled" would still run when "after" finishes.
        final = [o async for o in engine.generate("after", "The dog", GREEDY)][-1]
        return final

    assert _run(stories_llm.llm_engine, scenario).finished


def test_queue_bound_of_zero_rejects_and_negative_bound_is_invalid(stories_llm):
    async def scenario(engine):
        with pytest.raises(QueueFullError, match="max_num_queued_requests is 0"):
            await engine.add_request("r", "The dog", GREEDY)

    _run(stories_llm.llm_engine, scenario, max_num_queued_requests=0)
    with pytest.raises(ValueError, match="max_num_queued_requests must be >= 0 or None, got -1"):
        AsyncLLMEngine(stories_llm.llm_engine, max_num_queued_requests=-1)


def test_shutdown_fails_open_streams_and_later_requests(stories_llm):
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    llm_engine = stories_llm.llm_engine

    async def main():
        engine = AsyncLLMEngine(llm_engine)
        engine.start()
        stream = await engine.add_request("open", "The dog", long)
        await anext(stream)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.add_request("late", "The dog", long)
        assert not engine.is_running and not engine.is_dead

    asyncio.run(main())
    assert not llm_engine.has_unfinished_requests()  # shutdown aborted it
    kv = llm_engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
