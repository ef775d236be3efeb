"""Runs a workload on vLLM's own ``KVCacheManager`` (``--engine vllm``).

:func:`vllm_payload` turns the requests and the simulation's setup (the
``KVCacheConfig`` of :mod:`pagedkv.sim.deployment`, the policy's knobs, the
clock of :mod:`pagedkv.sim.perf`) into the JSON-able input of
:mod:`pagedkv.sim.vllm_engine`, the standard-library driver that runs the same
policy over vLLM's manager; :func:`run_vllm` runs it in this interpreter or in
``vllm_python`` through a subprocess and reads its result back as a
:class:`~pagedkv.sim.result.SimResult`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any

import numpy as np

from ..specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from . import vllm_engine
from .config import SimConfig
from .deployment import Deployment, deploy
from .perf import step_time_model
from .result import ProgressFn, SimResult
from .serving import scheduler_config
from .workloads import Workload

__all__ = ["NOT_AVAILABLE", "EngineUnavailableError", "run_vllm", "vllm_payload"]


class EngineUnavailableError(RuntimeError):
    """The requested engine cannot run here (the message says why and what to do)."""


def _vllm_groups(config: KVCacheConfig) -> list[dict[str, Any]]:
    groups = []
    for g in config.kv_cache_groups:
        s = g.kv_cache_spec
        kind = getattr(s, "kind", type(s).__name__)
        if isinstance(s, MambaSpec):
            groups.append(
                {
                    "kind": "mamba",
                    "layer_names": list(g.layer_names),
                    "block_size": s.block_size,
                    "shapes": [list(x) for x in s.shapes],
                    "dtypes": [str(d).split(".")[-1] for d in s.dtypes],
                    "page_size_padded": s.page_size_padded,
                    "mamba_cache_mode": s.mamba_cache_mode,
                    "num_speculative_blocks": s.num_speculative_blocks,
                }
            )
            continue
        if (
            not isinstance(s, FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec)
            or kind not in vllm_engine.SUPPORTED_SPECS
        ):
            raise EngineUnavailableError(
                f"--engine vllm supports full, MLA, sliding-window, chunked-local attention "
                f"and Mamba groups; this model has a {type(s).__name__} group"
            )
        d: dict[str, Any] = {
            "kind": kind,
            "layer_names": list(g.layer_names),
            "block_size": s.block_size,
            "num_kv_heads": s.num_kv_heads,
            "head_size": s.head_size,
            "dtype": str(s.dtype).split(".")[-1],
        }
        if isinstance(s, SlidingWindowSpec):
            d["sliding_window"] = s.sliding_window
        if isinstance(s, ChunkedLocalAttentionSpec):
            d["attention_chunk_size"] = s.attention_chunk_size
        if isinstance(s, MLAAttentionSpec):
            d["kind"] = "mla_attention"
        groups.append(d)
    if len({g["block_size"] for g in groups}) != 1:
        raise EngineUnavailableError("--engine vllm needs one block size across groups")
    return groups


def vllm_payload(workload: Workload, cfg: SimConfig) -> dict[str, Any]:
    """The JSON-able input of :func:`pagedkv.sim.vllm_engine.run` (the requests
    :func:`~pagedkv.sim.deployment.admit` accepts)."""
    return _payload(deploy(cfg, workload))


def _payload(deployment: Deployment) -> dict[str, Any]:
    """:func:`vllm_payload` of a deployment."""
    cfg, workload = deployment.cfg, deployment.workload
    config, max_model_len = deployment.kv_config, deployment.max_model_len
    if cfg.hash_algo not in ("sha256_cbor", "xxhash_cbor"):
        raise EngineUnavailableError(
            f"--engine vllm: vLLM has no {cfg.hash_algo!r} hash (use sha256_cbor or xxhash_cbor)"
        )
    groups = _vllm_groups(config)
    loras: dict[str, int] = {}
    reqs = []
    for r in workload.requests:
        rec: dict[str, Any] = {
            "id": r.request_id,
            "prompt": np.asarray(r.prompt).tolist(),
            "output": list(r.output),
            "arrival_step": r.arrival_step,
            "arrival_s": r.arrival_s,
            "session": r.session,
            "pause": r.pause,
            "pause_s": r.pause_s,
            "salt": r.cache_salt,
        }
        if r.lora_name is not None:
            lora_id = loras.setdefault(r.lora_name, len(loras) + 1)
            rec["lora"] = [r.lora_name, lora_id, r.lora_path or ""]
        reqs.append(rec)
    return {
        "manager": {
            "num_blocks": config.num_blocks,
            "max_model_len": max_model_len,
            "block_size": groups[0]["block_size"],
            "groups": groups,
            "enable_caching": cfg.enable_caching,
            "hash_algo": cfg.hash_algo,
            "max_in_flight_tokens": cfg.max_num_batched_tokens,
            "prefix_cache_retention_interval": 0,
        },
        "scheduler": asdict(scheduler_config(cfg, config)),
        "requests": reqs,
        "clock": {
            "model": step_time_model(cfg, deployment.model).to_dict(),
            "tick_s": cfg.tick_s,
            "max_concurrency": cfg.max_concurrency,
            "slo": {"slo_ttft_ms": cfg.slo_ttft_ms, "slo_tpot_ms": cfg.slo_tpot_ms},
        },
    }


NOT_AVAILABLE = (
    "--engine vllm runs vLLM's own KVCacheManager, but vLLM is not importable in this "
    "Python ({python}). Install vllm here, or pass --vllm-python PATH: a Python that has "
    "vllm installed (for instance the venv made by tools/vllm_oracle/setup.sh)."
)


def run_vllm(
    workload: Workload,
    cfg: SimConfig,
    *,
    vllm_python: str | None = None,
    label: str = "vllm",
    progress: ProgressFn | None = None,
) -> SimResult:
    """Simulates ``workload`` on vLLM's manager: in this interpreter when vLLM is
    importable here and ``vllm_python`` is None, else as a subprocess of
    ``vllm_python``. Raises :class:`EngineUnavailableError` when neither works."""
    deployment = deploy(cfg, workload)
    admitted, workload = deployment.admitted, deployment.workload
    payload = _payload(deployment)
    if vllm_python is None:
        if not vllm_engine.vllm_available():
            raise EngineUnavailableError(NOT_AVAILABLE.format(python=sys.executable))
        out = vllm_engine.run(payload, progress)
    else:
        out = _run_subprocess(payload, vllm_python, progress)
    try:
        out = vllm_engine.check_result(out)
    except ValueError as e:
        raise EngineUnavailableError(
            f"the vLLM engine's result is not what pagedkv expects "
            f"({vllm_python or sys.executable}): {e}"
        ) from None
    config = deployment.kv_config
    per_api = {k: (int(v[0]), int(v[1])) for k, v in out["per_api"].items()}
    return SimResult(
        label=label,
        engine="vllm",
        config=deployment.report(),
        steps=out["steps"],
        requests=len(workload.requests),
        finished=out["finished"],
        prompt_tokens=workload.prompt_tokens,
        output_tokens=workload.output_tokens,
        hit_tokens=out["first_hit_tokens"],
        query_tokens=out["first_query_tokens"],
        hit_tokens_all=out["hit_tokens"],
        query_tokens_all=out["query_tokens"],
        preemptions=out["preemptions"],
        admissions=out["admissions"],
        peak_running=out["peak_running"],
        peak_usage=out["peak_usage"],
        mean_usage=out["mean_usage"],
        num_blocks=config.num_blocks,
        usable_blocks=out["usable_blocks"],
        free_blocks_at_end=out["free_blocks_at_end"],
        manager_ns=out["manager_ns"],
        manager_calls=out["manager_calls"],
        per_api=per_api,
        alloc_checksum=out["alloc_checksum"],
        wall_s=out["wall_s"],
        extra={"vllm_version": out["version"], "vllm_import_s": out["import_s"]},
        timing=out["timing"],
        rejected_requests=admitted.rejected_requests,
        rejected_prompt_tokens=admitted.rejected_prompt_tokens,
    )


def _run_subprocess(
    payload: dict[str, Any], vllm_python: str, progress: ProgressFn | None = None
) -> dict[str, Any]:
    if not (os.path.isfile(vllm_python) and os.access(vllm_python, os.X_OK)):
        raise EngineUnavailableError(f"--vllm-python {vllm_python}: not an executable file")
    script = vllm_engine.__file__
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pagedkv-sim-") as tmp:
        path = os.path.join(tmp, "payload.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(payload, f)
        out_path = os.path.join(tmp, "out.txt")
        with open(out_path, "w+", encoding="utf-8") as out_f:
            with subprocess.Popen(
                [vllm_python, script, path],
                stdout=out_f,
                stderr=subprocess.PIPE,
                text=True,
                cwd=tmp,
            ) as proc:
                assert proc.stderr is not None
                # The script's progress lines move the bar; the rest is kept for errors.
                for line in proc.stderr:
                    parts = line.split()
                    if (
                        len(parts) == 3
                        and parts[0] == vllm_engine.PROGRESS_PREFIX
                        and parts[1].isdigit()
                        and parts[2].isdigit()
                    ):
                        if progress is not None:
                            progress(int(parts[1]), int(parts[2]))
                    else:
                        # Anything else (a malformed progress line too) is
                        # kept for the error message.
                        errors.append(line.rstrip("\n"))
                        del errors[:-200]
            returncode = proc.returncode
            out_f.seek(0)
            stdout = out_f.read()
    stderr = "\n".join(errors)
    if returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-8:])
        if "No module named 'vllm'" in stderr:
            raise EngineUnavailableError(
                f"--vllm-python {vllm_python}: that Python cannot import vllm"
            )
        raise EngineUnavailableError(f"the vLLM engine failed ({vllm_python}):\n{tail}")
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise EngineUnavailableError(f"the vLLM engine printed no result ({vllm_python})")
    try:
        result = json.loads(lines[-1], parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise EngineUnavailableError(
            f"the vLLM engine printed a result that is not JSON ({vllm_python}): "
            f"{str(e).splitlines()[0] if str(e) else 'nested too deeply'}"
        ) from None
    if not isinstance(result, dict):
        raise EngineUnavailableError(
            f"the vLLM engine printed {type(result).__name__}, not a result ({vllm_python})"
        )
    return result


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")
