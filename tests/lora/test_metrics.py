"""``lora_requests_info``: vLLM's labels from the scheduler's running and waiting adapters, as
the engine core's stats carry them."""

from __future__ import annotations

import time
from types import SimpleNamespace

from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.lora.metrics import lora_stats
from jaxpaged.metrics import ServerMetrics
from tests.core.test_scheduler import make_seq


def test_labels_name_running_and_waiting_adapters_and_the_value_is_a_timestamp():
    config = SimpleNamespace(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=32)
    scheduler = Scheduler(config, KVCacheManager(64, 4), max_loras=2)
    for seq_id, name in [("a", "sql"), ("b", None), ("c", "chat"), ("d", "sql")]:
        seq = make_seq(seq_id)
        seq.lora_request = name and SimpleNamespace(lora_int_id=len(name), lora_name=name)
        scheduler.add_request(seq)
    scheduler.schedule()  # max_num_seqs=2: a and b run, c and d wait
    stats = lora_stats(scheduler, SimpleNamespace(max_loras=2))
    assert stats == {
        "max_loras": 2,
        "running_lora_adapters": ["sql"],
        "waiting_lora_adapters": ["chat", "sql"],
    }
    metrics = ServerMetrics("m", max_loras=stats["max_loras"])
    before = time.time()
    metrics.observe_lora_adapters(stats["running_lora_adapters"], stats["waiting_lora_adapters"])
    (line,) = [
        line
        for line in metrics.render().decode().splitlines()
        if line.startswith("jaxpaged:lora_requests_info{")
    ]
    assert 'max_lora="2"' in line
    assert 'running_lora_adapters="sql"' in line
    assert 'waiting_lora_adapters="chat,sql"' in line
    assert float(line.rsplit(" ", 1)[1]) >= before - 1
