"""The one-GPU check (``tools/gpu_check.py``, ``make gpu-check``): one prepared command
for a lent machine with one NVIDIA GPU, no network and a deadline (docs/running_at_scale.md,
"The GPU check").

Standard library only at import time, so the check starts before anything is installed
there (``megatron_tlt`` is on ``PYTHONPATH``, not installed):

* ``schedule``: the parts in priority order under one wall deadline; each part's process
  group killed when its time is up; ``gpu_check.json`` rewritten after every part;
* ``tests_run`` and ``pytest_stream``: tests_gpu with each test's result streamed to a
  JSONL file as it finishes, a hung or crashed test killed and the rest run on;
* ``wheels``: the wheel folder the machine lacks (``make gpu-wheels``) and its check;
* ``parts``, ``first_step``, ``probe`` (torch and the package, each run as its own
  process: ``python -m megatron_tlt.gpu_check.parts ...``): the random-weight SmolLM2
  model, the GRPO run with peak memory per phase, the drafter group's micro-step, the
  bf16-vs-fp32 first step on identical responses, and the device / import / FP8 probe.
"""
