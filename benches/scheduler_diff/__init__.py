"""vLLM's Scheduler on vLLM's manager and on pagedkv's drop-in, compared step by step.

The harness behind ``benches/vllm_scheduler_diff.py`` (its docstring says what
is compared): ``cases`` names the configurations, ``workload`` makes the
requests and the fake model both sides share, ``connector`` and ``build``
build the two schedulers, ``drive`` steps one of them as vLLM's engine core
does, ``compare`` turns what each step shows into plain values and finds the
first difference, ``run`` runs one configuration and seed on both sides.

Importing it points vLLM, before it is imported, at a CPU build and an
offline Hugging Face cache (unless the environment says otherwise).
"""

import os

os.environ.setdefault("HF_HOME", "/tmp/vllm_dropin/hf_home")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
