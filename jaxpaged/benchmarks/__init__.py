"""The benchmarks behind ``jaxpaged bench`` (vLLM's ``vllm bench``): throughput, latency, serving."""
