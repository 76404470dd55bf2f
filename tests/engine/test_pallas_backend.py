"""The engine with ``attention_backend="pallas"`` (interpret mode on CPU) against the reference
backend and golden.json: same greedy tokens, float32."""

from __future__ import annotations

from jaxpaged import LLM, SamplingParams
from tests.conftest import SMALL_ENGINE


def test_pallas_backend_reproduces_golden_greedy_outputs(golden):
    llm = LLM(dtype="float32", attention_backend="pallas", **SMALL_ENGINE)
    assert llm.llm_engine.worker.attention_backend == "pallas"
    cases = golden["cases"]
    params = SamplingParams(temperature=0.0, max_tokens=golden["max_new_tokens"])
    outputs = llm.generate(
        [{"prompt_token_ids": c["prompt_ids"]} for c in cases], params, use_tqdm=False
    )
    assert [o.outputs[0].token_ids for o in outputs] == [c["greedy_new_ids"] for c in cases]
