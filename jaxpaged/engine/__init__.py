"""The in-process step loop: ``LLMEngine`` (``llm_engine.py``), the pipeline of one step under
async scheduling (``async_scheduling.py``), and what a step reports (``output_processor.py``,
``group_outputs.py``, ``deltas.py``). The process boundary that drives it from another process
is ``jaxpaged.engine_core``."""
