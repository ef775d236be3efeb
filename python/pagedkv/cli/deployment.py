"""The options ``simulate`` and ``calibrate`` share: the deployment a run models.

The model, its GPUs, the KV-cache memory and the scheduler's limits are
defined here once (flags, type, default, choices, metavar, help) and each
command adds the ones it takes where its help lists them; ``config_fields``
turns them into the ``SimConfig`` fields they set. A command that explains an
option in its own words passes that help text; everything else is shared.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from .. import presets
from ..sim.perf import GPUS
from .options import fraction, positive_float, positive_int


class _Option(NamedTuple):
    flags: tuple[str, ...]
    #: The ``SimConfig`` field the option sets.
    field: str
    settings: dict[str, Any]


#: The shared options by destination, in the order ``simulate`` lists them.
OPTIONS: dict[str, _Option] = {
    "model": _Option(
        ("--model", "-m"),
        "model",
        {
            "default": "llama-3.1-8b",
            "metavar": "PRESET|CONFIG",
            "help": "model preset, or the path of a Hugging Face config.json "
            "(default llama-3.1-8b)",
        },
    ),
    "gpu": _Option(
        ("--gpu",),
        "gpu",
        {
            "default": "H100-SXM",
            "choices": list(GPUS),
            "metavar": "NAME",
            "help": "GPU preset: step times and memory (default H100-SXM)",
        },
    ),
    "tp": _Option(
        ("--tp",),
        "tp",
        {"type": positive_int, "default": 1, "help": "tensor-parallel GPUs (default 1)"},
    ),
    "quantization": _Option(
        ("--quantization",),
        "quantization",
        {
            "choices": presets.QUANTIZATIONS,
            "default": "none",
            "help": "weight quantization, as vLLM's --quantization: fp8 stores the linear "
            "layers' weights in one byte and runs them at the FP8 peak (default none: the "
            "checkpoint's own; the -fp8 presets are FP8 checkpoints)",
        },
    ),
    "gpu_memory_utilization": _Option(
        ("--gpu-memory-utilization",),
        "gpu_memory_utilization",
        {
            "type": fraction,
            "default": 0.9,
            "metavar": "F",
            "help": "share of GPU memory vLLM may use (default 0.9)",
        },
    ),
    # --memory and --num-blocks exclude each other (``add_options`` groups them).
    "memory": _Option(
        ("--memory",),
        "memory_gib",
        {
            "type": positive_float,
            "metavar": "GIB",
            "help": "KV-cache memory per GPU, GiB (default: what the GPU leaves after the "
            "weights and activations)",
        },
    ),
    "num_blocks": _Option(
        ("--num-blocks",),
        "num_blocks",
        {
            "type": positive_int,
            "metavar": "N",
            "help": "a fixed number of blocks instead of --memory",
        },
    ),
    "block_size": _Option(
        ("--block-size",),
        "block_size",
        {"type": positive_int, "default": 16, "help": "tokens per block"},
    ),
    "kv_dtype": _Option(
        ("--kv-dtype",),
        "kv_dtype",
        {"default": "bfloat16", "help": "KV-cache dtype (default bfloat16)"},
    ),
    "max_model_len": _Option(
        ("--max-model-len",),
        "max_model_len",
        {
            "type": positive_int,
            "metavar": "N",
            "help": "default: the longest request the model's context accepts, rounded up to "
            "1024; also caps the built-in workloads' requests (default 16384, or the model's "
            "context if shorter)",
        },
    ),
    "max_num_seqs": _Option(
        ("--max-num-seqs",), "max_num_seqs", {"type": positive_int, "default": 256}
    ),
    "max_num_batched_tokens": _Option(
        ("--max-num-batched-tokens",),
        "max_num_batched_tokens",
        {"type": positive_int, "default": 8192},
    ),
}

#: Options given together in one mutually exclusive group.
_EXCLUSIVE = ("memory", "num_blocks")


def add_options(
    group: argparse._ArgumentGroup,
    names: Iterable[str],
    helps: Mapping[str, str] | None = None,
) -> None:
    """Adds the shared options ``names`` to ``group``, in that order; ``helps``
    replaces the help text of the ones a command explains its own way.
    ``memory`` and ``num_blocks`` come together, in one mutually exclusive group."""
    helps = helps or {}
    exclusive: argparse._MutuallyExclusiveGroup | None = None
    for name in names:
        option = OPTIONS[name]
        settings = option.settings | ({"help": helps[name]} if name in helps else {})
        if name in _EXCLUSIVE:
            if exclusive is None:
                exclusive = group.add_mutually_exclusive_group()
            exclusive.add_argument(*option.flags, **settings)
        else:
            group.add_argument(*option.flags, **settings)


def config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``SimConfig`` fields the shared options set, from parsed ``args``."""
    return {option.field: getattr(args, name) for name, option in OPTIONS.items()}
