"""Tests of the vLLM drop-in (``pagedkv.vllm``) and of its scheduler against vLLM's."""
