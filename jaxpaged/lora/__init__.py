"""Multi-LoRA serving: adapter requests, PEFT loading, device slots and the host LRU.

``request`` (``LoRARequest``, vLLM's names), ``peft`` (adapter directories -> host arrays),
``slots`` (the ``max_loras`` device slots and their writes), ``manager`` (which adapter sits in
which slot, the ``max_cpu_loras`` host LRU). The batched matmul itself is ``models.lora``.
"""
