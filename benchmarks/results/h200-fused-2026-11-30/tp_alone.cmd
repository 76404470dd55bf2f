rerun: benchmarks/results/h200-fused-2026-11-30 (GPU alone): PYTHONPATH=. python3 scripts/check_tensor_parallel.py --phases llama8b-tp1,llama8b-tp2 --async-scheduling
