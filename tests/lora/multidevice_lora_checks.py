"""Multi-LoRA at tensor_parallel_size 2; run by ``test_lora_tp.py`` in a subprocess with two CPU
devices (``--xla_force_host_platform_device_count=2``, which must be set before JAX starts).

The same engine arguments and mixed batch as ``test_lora_engine.py`` (base and three adapters
of different ranks and targets, 2 slots, a 2-adapter host LRU): the tp=2 engine's greedy tokens
must equal HF transformers + peft's (``tests/data/lora/golden.json``), which the tp=1 engine's
equal in ``test_lora_engine.py`` (so tp=2's equal tp=1's; a tp=1 engine here would add ~30 s); the
slot arrays must be split as ``models.sharding.lora_partition_specs`` says; loading, swapping
and unloading adapters under tp=2 must compile nothing. Prints one line per check; exits
non-zero on the first failure.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
from jax.sharding import PartitionSpec as P

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import default_model_path
from jaxpaged.lora.request import LoRARequest
from tests.conftest import SMALL_ENGINE
from tests.lora.adapters import GOLDEN, SPECS, write_adapter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
              enable_compilation_cache=False, **SMALL_ENGINE)  # fmt: skip


def _mixed(golden: dict, requests: list[LoRARequest]):
    prompts, loras, expected = [], [], []
    for request, key in [(None, "base"), *((r, r.lora_name) for r in requests)]:
        for prompt, tokens in zip(golden["prompts"], golden[key], strict=True):
            prompts.append({"prompt_token_ids": prompt})
            loras.append(request)
            expected.append(tokens)
    # Interleaved: every step wants more adapters than the 2 slots hold.
    order = sorted(range(len(prompts)), key=lambda i: (i % 3, i))
    return [prompts[i] for i in order], [loras[i] for i in order], [expected[i] for i in order]


def _greedy(llm: LLM, prompts, loras) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def main() -> None:
    assert jax.device_count() >= 2, "run with --xla_force_host_platform_device_count=2"
    golden = json.loads(GOLDEN.read_text())
    with tempfile.TemporaryDirectory() as root:
        requests = [
            LoRARequest(spec.name, i + 1, write_adapter(default_model_path(), f"{root}/{i}", spec))
            for i, spec in enumerate(SPECS)
        ]
        prompts, loras, expected = _mixed(golden, requests)

        llm = LLM(tensor_parallel_size=2, **ENGINE)
        engine = llm.llm_engine
        manager = engine.lora_manager
        layer = manager.slots.weights[0]
        specs = {name: (w.a.sharding.spec, w.b.sharding.spec) for name, w in layer.items()}
        assert specs == {
            "qkv_proj": (P(), P(None, "tp")),
            "o_proj": (P("tp", None), P()),
            "gate_up_proj": (P(), P(None, "tp")),
            "down_proj": (P("tp", None), P()),
        }, specs
        # tp > 1 falls back from the fold layout (models.lora.lora_fold) to separate slots.
        assert not any(w.base_columns for w in layer.values())
        b = layer["qkv_proj"].b
        assert b.addressable_shards[0].data.shape == (b.shape[0], b.shape[1] // 2)
        print("tp=2: slot arrays split like their base layers", flush=True)

        two = _greedy(llm, prompts, loras)
        assert two == expected, "tp=2 differs from peft"
        # 3 adapters through 2 slots: at least one was swapped out for another.
        assert manager.slots.num_writes >= len(SPECS)
        print("tp=2: greedy tokens with mixed adapters equal peft's", flush=True)

        # Row-parallel LoRA: each o_proj / down_proj shrink [T, S * C] is reduced in the same
        # collective as its base output [T, hidden] (XLA combines the two all-reduces).
        runner = engine.worker.model_runner
        key = runner.bucket_for(1, 1, True)
        hlo = runner._executables.get(key) or runner.executable(key)
        reduces = [line for line in hlo.as_text().splitlines() if " all-reduce(" in line]
        config = engine.worker.hf_config
        shrink = f"f32[1,{ENGINE['max_loras'] * ENGINE['max_lora_rank']}]"
        base = f"f32[1,{config.hidden_size}]"
        with_shrink = [line for line in reduces if shrink in line]
        assert len(with_shrink) == 2 * config.num_hidden_layers, with_shrink
        assert all(base in line for line in with_shrink), with_shrink
        print("tp=2: row-parallel LoRA shrinks reduced with the base outputs", flush=True)

        # The same batch again (the same step shapes, compiled above) after an unload and a
        # load at run time: the third adapter comes back under a new id and a new name.
        compiled = runner.num_compilations
        assert compiled > 0
        llm.reset_prefix_cache()
        extra = LoRARequest("extra", 9, requests[2].lora_path)
        with jax.no_tracing(True):
            assert manager.remove_adapter(requests[2].lora_int_id)
            swapped = [extra if r is requests[2] else r for r in loras]
            assert _greedy(llm, prompts, swapped) == expected
        assert runner.num_compilations == compiled
        assert extra.lora_int_id in manager.slot_ids + manager.host_ids
        manager.check_invariants()
        print("tp=2: loading, swapping and unloading adapters compiled nothing", flush=True)
    print("ALL OK", flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
